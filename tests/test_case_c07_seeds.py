"""C7 Seeds (../shared/cases/correctness.md).

temperature 2.0, seed 42, max_tokens 10, k=5: the request is sent 5 times alone and 5
times beside unseeded sampled requests (different prompts, lengths, max_tokens and
sampling settings; in different slots; admitted mid-generation of the others; with the
others finishing before or after it). All 10 outputs must be identical (tokens, and the
logprobs too).

Why it can break: a seeded request's uniforms come from its own generator in a fixed
pattern per step (2k+1 per step, whatever its draft count or the batch's), so its
random stream never depends on its neighbours. Drawing per batch, per draft actually
made, or per step of the batch would make the output depend on what it is batched with.

Drafters: n-gram (one-hot q), a draft model (== target: sampled drafts, real q), early
exit (the target's first layer: partial acceptance, so the number of steps varies) and
random EAGLE / EAGLE-3 heads (sampled drafts from the head's q; EAGLE-3's over its draft
vocabulary).

Known limit (see the xfail diagnostic at the end): the random stream is batch-invariant,
the eager numerics are not quite (~1e-5 on the logits), so over a flat 49k-token
distribution some seeds other than 42 give a different output batched than alone.
"""

from __future__ import annotations

import pytest
import torch

from helpers import drafter_spec, make_session
from specc import SamplingParams

K = 5
SEEDED = dict(temperature=2.0, seed=42, max_tokens=10, logprobs=2)


PROMPT = "Roses are red, violets are blue, roses are red, violets are"
OTHERS = [
    "The history of the printing press",
    "one two three four five six seven eight nine ten one two three four",
    "a",
    "Write a haiku about the sea. The sea, the sea, the endless sea",
]


def _unseeded(i: int) -> SamplingParams:
    settings = [dict(temperature=2.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=5),
                dict(temperature=0.0), dict(temperature=1.5)]
    return SamplingParams(**settings[i % len(settings)], max_tokens=[3, 14, 7, 10, 20][i % 5])


# suffix: per-request trees only; with the global tree a request's drafts, and so which
# uniforms decide which token, depend on the requests that finished before it
OVERRIDES = {"suffix": dict(suffix_decoding_max_cached_requests=0)}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "early_exit", "suffix", "eagle", "eagle3"])
def test_seeded_request_identical_alone_and_batched(method, tiny_llama_dir, tiny_eagle_heads):
    results = []
    model_dir = tiny_eagle_heads.get(method, tiny_llama_dir)  # EAGLE: random heads, sampled drafts
    for max_num_seqs in (4, 2):  # 2: requests wait for a slot and join mid-generation
        s = make_session(tiny_llama_dir, drafter_spec(method, K, model_dir, **OVERRIDES.get(method, {})),
                         max_num_seqs=max_num_seqs)
        if max_num_seqs == 4:
            for _ in range(5):  # alone
                results.append(("alone", s.generate(PROMPT, SamplingParams(**SEEDED))[0]))
            batches = [
                [0, "S", 1],  # seeded in the middle slot
                ["S", 2, 3, 0],  # first slot, full batch; neighbours finish first
                [3, 1, 2, "S"],  # last slot
            ]
        else:
            batches = [
                [0, 1, "S", 2],  # admitted when a slot frees, beside a running request
                [1, "S", 3, 0, 2],  # joined mid-generation by others
            ]
        for b, layout in enumerate(batches):
            prompts = [PROMPT if x == "S" else OTHERS[x] for x in layout]
            params = [SamplingParams(**SEEDED) if x == "S" else _unseeded(x + b) for x in layout]
            outs = s.generate(prompts, params)
            results.append((f"batch{max_num_seqs}-{b}", outs[layout.index("S")]))
            spec = [o.metrics.spec for o in outs]
            assert sum(m.num_draft_tokens for m in spec) > 0

    assert len(results) == 10
    ref = results[0][1]
    assert len(ref.token_ids) == 10 and ref.finish_reason == "length"
    for name, out in results[1:]:
        assert out.token_ids == ref.token_ids, (method, name)
        assert [lp.token_id for lp in out.logprobs] == [lp.token_id for lp in ref.logprobs]
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


@pytest.mark.xfail(strict=False, reason=(
    "eager verify numerics depend on the batch: the verify forward runs at the batch's "
    "widest draft count (T = K+1) and kv_len = the longest row + 1, and attention's "
    "reductions round differently for other T / kv_len (~1e-5 on the logits). At "
    "temperature 2.0 over a 49k-token vocabulary that flips a sampled token often enough "
    "that about 1 seed in 12 gives a different output batched than alone (seed 42 happens "
    "not to). Only fixed shapes everywhere (T, kv_len and the GEMMs' row count) would "
    "make it bitwise; the compiled programs fix T but not kv_len or the bucket "
    "(tests/test_compiled.py checks their tokens); a model drafter's eager forwards have "
    "batch-dependent shapes too."))
def test_seeded_request_logits_bitwise_independent_of_batch(tiny_llama_dir):
    """Diagnostic for the numerics under C7: for twelve seeds, the seeded request's tokens
    and logprobs (log-softmax of the processed target logits behind each token), alone
    vs. batched, must be bitwise equal for batch invariance to hold for every seed."""
    s = make_session(tiny_llama_dir, drafter_spec("ngram", K))
    for seed in range(12):
        params = SamplingParams(**dict(SEEDED, seed=seed))
        alone = s.generate(PROMPT, params)[0]
        batched = s.generate([OTHERS[0], PROMPT, OTHERS[1]], [_unseeded(0), params, _unseeded(1)])[1]
        assert [(lp.token_id, lp.logprob) for lp in batched.logprobs] == \
            [(lp.token_id, lp.logprob) for lp in alone.logprobs], seed
