"""Speculative decoding on the real SmolLM2-135M-Instruct (../shared/cases/correctness.md).

Greedy, 48 new tokens, three prompts batched (a summarization-style chat prompt with
repeated content, a list continuation, a plain text prompt), for the n-gram drafter
(k=4, lookup 1..4) and the early-exit self-draft (first 8 of 30 layers, k=4).

Real-model rule: the speculative output must equal the non-speculative one, except that
a divergence is tolerated at a position where the non-speculative top-1/top-2 logit gap
is below 1e-3 (a verify pass over k+1 tokens may round differently from a one-token
decode); after such a tolerated divergence the rest is not compared. The gap comes from
the non-speculative run's top-2 logprobs (greedy logprobs are those of the raw logits,
so a logprob difference is a logit difference).
"""

from __future__ import annotations

import pytest

from helpers import drafter_spec, make_session
from specc import SamplingParams

pytestmark = pytest.mark.real_model

K = 4
MAX_NEW = 48
GAP = 1e-3

ARTICLE = (
    "The city council met on Tuesday to discuss the new park. The new park will have a "
    "playground, a pond and a running track. Residents said the new park is needed "
    "because the old park is too small. The council voted to build the new park next "
    "year. The new park will cost two million dollars, and the council said the new park "
    "will open in the spring."
)
PROMPTS = [
    [{"role": "user", "content": f"Summarize the following text in two sentences.\n\n{ARTICLE}"}],
    [{"role": "user", "content": "List the days of the week, one per line, starting with Monday."}],
    "The three primary colors are red, yellow and blue. The three primary colors are",
]


@pytest.fixture(scope="module")
def sessions(smollm2_dir):
    ngram = make_session(smollm2_dir, drafter_spec("ngram", K), max_model_len=512)
    early = make_session(smollm2_dir, drafter_spec("early_exit", K, num_draft_layers=8), max_model_len=512)
    return {"ngram": ngram, "early_exit": early}


@pytest.fixture(scope="module")
def reference(sessions):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2)
    return sessions["ngram"].generate(PROMPTS, params, use_speculation=False)


def compare_with_gap_rule(spec_ids: list[int], ref) -> tuple[int, int | None]:
    """Number of positions compared; the tolerated divergence position (None if equal)."""
    for i, (a, b) in enumerate(zip(spec_ids, ref.token_ids)):
        if a == b:
            continue
        top = ref.logprobs[i].top
        gap = top[0][1] - top[1][1]
        assert gap < GAP, (
            f"position {i}: speculative token {a} != non-speculative {b} where the "
            f"non-speculative top-1/top-2 gap is {gap:.2e} (>= {GAP})")
        return i, i
    assert len(spec_ids) == len(ref.token_ids), (len(spec_ids), len(ref.token_ids))
    return len(spec_ids), None


@pytest.mark.parametrize("method", ["ngram", "early_exit"])
def test_real_model_greedy_equals_non_spec(method, sessions, reference):
    s = sessions[method]
    outs = s.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    accepted = drafted = 0
    for out, ref in zip(outs, reference):
        compared, diverged = compare_with_gap_rule(out.token_ids, ref)
        if diverged is None:
            assert out.finish_reason == ref.finish_reason
            assert out.text == ref.text
        assert compared > 0
        accepted += out.metrics.spec.num_accepted_tokens
        drafted += out.metrics.spec.num_draft_tokens
        assert sum(out.metrics.tokens_per_step) == len(out.token_ids)
    # speculation really happened (the 8-layer early exit of SmolLM2 is rarely right,
    # n-gram lookup on these repetitive prompts often is)
    assert drafted > 0
    if method == "ngram":
        assert accepted > 0
