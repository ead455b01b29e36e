"""C4 Batch composition (../shared/cases/correctness.md).

Two identical greedy requests, the second admitted (continuous batching: a KV slot frees)
while the first is mid-generation, into a batch whose rows carry different numbers of
drafts (padded at the cache's trash position); prompts of 1, 7 and 300 tokens admitted
at different steps, one of them finishing at its prefill. Every request must give the
non-speculative output of the same request run alone; placeholder or padding tokens
never appear in outputs, logprobs or the drafter's history.

Drafters: n-gram, suffix, draft model (own KV cache: slot moves, stale state, rollback after
rejections; once == target, once another model with the same tokenizer), early exit
(the target's first layer, shared cache) and an oracle (scripted, records the history
it is called with).

Every run goes through the KV shadow checker of ``kv_shadow.py`` (also used by C5): no
real KV entry is overwritten by padding, drafts or another request; every key a real
query sees holds the request's own token (or a draft of the current call); ``kv_len``
covers the query; logits stay finite. For a model drafter this is the drafter's history:
what it attends to is exactly prompt + emitted tokens (+ its own drafts of this step).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import TINY_SEED, build_tiny_model, drafter_spec, greedy, make_session
from kv_shadow import Checks, checked
from spec_drafters import OracleDrafter
from specc import SamplingParams, Session
from specc.kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID

K = 4
MAX_MODEL_LEN = 384


# ------------------------------------------------------------------------------ checks
def assert_histories(checks: Checks, proposer, outs) -> None:
    """The drafter was only ever shown prompt + emitted tokens."""
    full = {o.request_id: list(o.prompt_token_ids) + list(o.token_ids) for o in outs}
    plen = {o.request_id: len(o.prompt_token_ids) for o in outs}
    for hist in checks.ngram_histories:
        assert any(len(hist) > plen[r] and f[: len(hist)] == hist for r, f in full.items()), hist
    for rid, hist, proposed in getattr(proposer, "calls", []):
        assert len(hist) > plen[rid] and full[rid][: len(hist)] == hist, (rid, hist)
        assert all(t >= 0 for t in proposed)


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def base(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=1)


@pytest.fixture(scope="module")
def prompts(base) -> dict[str, list[int]]:
    tok = base.tokenizer
    rep = tok.encode("The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown")
    para = tok.encode(
        "Speculative decoding drafts several tokens cheaply and lets the large model check "
        "them all in one forward pass; the tokens it agrees with are kept, the first one it "
        "rejects is replaced by its own choice. " * 12
    )
    assert len(para) >= 300
    out = {
        "rep": rep,
        "filler": tok.encode("Hello there, how are"),
        "one": tok.encode(" the")[:1],
        "one_b": tok.encode(" Paris")[:1],
        "seven": tok.encode("Once upon a time, in a land far")[:7],
        "seven_b": tok.encode("def add(a, b):\n    return a +")[:7],
        "p300": para[:300],
    }
    assert [len(out[n]) for n in ("one", "one_b", "seven", "seven_b", "p300")] == [1, 1, 7, 7, 300]
    return out


def _params(max_tokens: int) -> SamplingParams:
    return greedy(max_tokens, logprobs=3)


@pytest.fixture(scope="module")
def alone(base):
    """Non-speculative output of each (prompt, max_tokens), run alone (batch of one)."""
    memo: dict = {}

    def get(prompt: list[int], max_tokens: int):
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = base.generate([prompt], _params(max_tokens), use_speculation=False)[0]
        return memo[key]

    return get


METHODS = ["ngram", "suffix", "draft_model", "draft_model_other", "early_exit", "oracle"]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, smollm2_tokenizer):
    """A second tiny Llama (other random weights, same tokenizer): a drafter that is
    mostly wrong, so the draft model's state is rolled back after rejections."""
    return build_tiny_model("llama", smollm2_tokenizer, tmp_path_factory.mktemp("c4_other"), seed=TINY_SEED + 1)


@pytest.fixture(scope="module")
def sessions(tiny_llama_dir, other_llama_dir, prompts, alone):
    made: dict[str, Session] = {}

    def get(method: str) -> Session:
        if method in made:
            return made[method]
        spec, proposer = None, None
        if method in ("ngram", "suffix", "early_exit"):
            spec = drafter_spec(method, K)
        elif method == "draft_model":
            spec = drafter_spec("draft_model", K, tiny_llama_dir)
        elif method == "draft_model_other":  # a different model: most drafts rejected
            spec = drafter_spec("draft_model", K, other_llama_dir)
        else:
            truth = {tuple(p): alone(p, 40).token_ids for p in prompts.values()}
            proposer = OracleDrafter(K, truth)
        made[method] = make_session(tiny_llama_dir, spec, proposer=proposer, max_model_len=MAX_MODEL_LEN,
                                    max_num_seqs=2)
        return made[method]

    return get


def _run_and_check(session: Session, method: str, reqs: list[tuple[list[int], int]], alone):
    """Run ``reqs`` ((prompt, max_tokens)) as one generate call with every check on."""
    if method == "oracle":
        session.proposer.calls.clear()
    with checked(session) as checks:
        outs = session.generate([p for p, _ in reqs], [_params(m) for _, m in reqs])
    assert checks.errors == []
    vocab = session.target.config.vocab_size
    for (prompt, m), out in zip(reqs, outs):
        ref = alone(prompt, m)
        assert out.token_ids == ref.token_ids, (method, len(prompt), m)
        assert out.finish_reason == ref.finish_reason
        assert all(0 <= t < vocab for t in out.token_ids) and PLACEHOLDER_TOKEN_ID not in out.token_ids
        # one logprob entry per emitted token, for that token, equal to non-spec
        assert len(out.logprobs) == len(out.token_ids)
        for lp, ref_lp, tok in zip(out.logprobs, ref.logprobs, out.token_ids):
            assert lp.token_id == tok and np.isfinite(lp.logprob)
            assert abs(lp.logprob - ref_lp.logprob) < 1e-4
            assert [t for t, _ in lp.top] == [t for t, _ in ref_lp.top]
            assert all(0 <= t < vocab and np.isfinite(v) for t, v in lp.top)
            assert np.allclose([v for _, v in lp.top], [v for _, v in ref_lp.top], atol=1e-4)
        assert out.metrics.num_generation_tokens == len(out.token_ids)
        assert sum(out.metrics.tokens_per_step) == len(out.token_ids)
    assert_histories(checks, session.proposer, outs)
    if method in ("ngram", "suffix"):
        assert checks.ngram_histories  # the host drafter's histories were recorded
    if method in ("draft_model", "oracle"):
        # the drafter proposes the target's own greedy tokens: if its state survived the
        # admissions and slot moves, every draft is accepted
        for out in outs:
            s = out.metrics.spec
            assert s.num_accepted_tokens == s.num_draft_tokens, (method, out.request_id, s)
    return outs, checks


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("method", METHODS)
def test_identical_request_admitted_mid_generation(method, sessions, prompts, alone):
    """max_num_seqs=2: A runs; a short filler ends after a step or two, freeing its slot;
    A' (identical to A) is admitted into it while A is mid-generation. Their rows sit at
    different offsets with different draft counts in every shared step."""
    s = sessions(method)
    reqs = [(prompts["rep"], 24), (prompts["filler"], 3), (prompts["rep"], 24)]
    outs, checks = _run_and_check(s, method, reqs, alone)
    assert outs[0].token_ids == outs[2].token_ids
    a, a2 = outs[0].request_id, outs[2].request_id
    adm = {rid: (step, others) for rid, step, others in checks.admissions}
    step, others = adm[a2]
    assert step > 0 and 0 < others.get(a, 0) < 24, (step, others)  # A was mid-generation
    assert any(n == 2 for n, _ in checks.step_sizes[step:])  # and they then shared steps
    assert checks.target.num_padded > 0  # some of them padded (rows with fewer drafts)
    assert checks.errors == []
    if method != "oracle":
        assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("method", METHODS)
def test_prompts_1_7_300_admitted_at_different_steps(method, sessions, prompts, alone):
    """max_num_seqs=2 with six requests: the 1-, 7- and 300-token prompts are admitted
    at different steps as slots free (one request ends at its prefill: max_tokens=1)."""
    s = sessions(method)
    reqs = [
        (prompts["seven"], 14),
        (prompts["one"], 1),  # finishes at prefill, still sits in the next step's batch
        (prompts["p300"], 10),
        (prompts["one_b"], 6),
        (prompts["seven_b"], 4),
        (prompts["rep"], 9),
    ]
    outs, checks = _run_and_check(s, method, reqs, alone)
    steps = [step for _, step, _ in checks.admissions]
    assert len(steps) == len(reqs)
    assert len(set(steps)) >= 4, steps  # admitted over (at least) four different steps
    mid = [others for _, step, others in checks.admissions if step > 0]
    assert any(any(0 < n for n in o.values()) for o in mid)  # admitted beside a running request
    assert outs[1].token_ids == alone(prompts["one"], 1).token_ids and len(outs[1].token_ids) == 1
