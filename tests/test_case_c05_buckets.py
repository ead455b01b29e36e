"""C5 Between buckets (../shared/cases/correctness.md).

Config buckets {1, 2, 4, 8}, max_num_seqs 8; live batch sizes 3, 5, 6, 7 with mixed
prompt lengths (1..90 tokens); every request has its own max_tokens, so requests finish
at different steps and the live batch shrinks across bucket boundaries (7 -> ... -> 1).

Checked, for the n-gram, early-exit, draft-model, EAGLE and EAGLE-3 drafters:

* no crash, no NaN (every forward's logits are finite, padded rows included);
* padded rows change no real sequence length, KV entry or counter: the KV shadow
  checker of C4 (``kv_shadow.py``) sees no write of a wrong token below a request's length
  and no real query seeing a wrong key; each request's counters (steps, tokens per step,
  drafts, accepted) equal those of the same request run alone with speculation;
* each row equals the same request run alone without speculation (greedy, fp32).

TODO(compile path): the eager runtime runs each step at the exact live batch size; once
compiled programs exist per bucket, add "graph replay equals eager": run the same
batches through the bucketed programs (padded up to the bucket) and require token- and
logprob-identical outputs to this eager path.
"""

from __future__ import annotations

import pytest

from helpers import drafter_spec, greedy, make_session
from kv_shadow import checked
from specc import SamplingParams

K = 4
BUCKETS = [1, 2, 4, 8]
MAX_MODEL_LEN = 160

METHODS = ["ngram", "early_exit", "draft_model", "suffix", "eagle", "eagle3"]  # draft_model: drafter == target
# suffix: per-request trees only, so a request drafts the same alone and in a batch (the
# global tree would carry the earlier runs' outputs into later drafts)
OVERRIDES = {"suffix": dict(suffix_decoding_max_cached_requests=0)}


def _session(model_dir, spec=None):
    return make_session(model_dir, spec, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, batch_buckets=BUCKETS)


@pytest.fixture(scope="module")
def pool(tiny_llama_dir) -> list[tuple[list[int], int]]:
    """Seven (prompt ids, max_tokens): lengths 1..90, all max_tokens different."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = ("One fish, two fish, red fish, blue fish. This one has a little star. "
            "This one has a little car. Say, what a lot of fish there are. ") * 4
    ids = tok.encode(text)
    lengths = [17, 1, 60, 5, 90, 33, 9]
    max_tokens = [10, 3, 12, 6, 9, 2, 11]
    starts = [0, 7, 3, 40, 1, 21, 55]
    return [(ids[s : s + n], m) for s, n, m in zip(starts, lengths, max_tokens)]


def _greedy(m: int) -> SamplingParams:
    return greedy(m, logprobs=2)


@pytest.fixture(scope="module")
def base_outputs(tiny_llama_dir, pool):
    base = _session(tiny_llama_dir)
    return [base.generate([p], _greedy(m), use_speculation=False)[0] for p, m in pool]


@pytest.fixture(scope="module", params=METHODS)
def spec_session(request, tiny_llama_dir, pool, tiny_eagle_heads):
    model_dir = tiny_eagle_heads.get(request.param, tiny_llama_dir)  # EAGLE: random heads
    session = _session(tiny_llama_dir, drafter_spec(request.param, K, model_dir,
                                                    **OVERRIDES.get(request.param, {})))
    # each request alone, with speculation: the reference for its counters
    alone = [session.generate([p], _greedy(m))[0] for p, m in pool]
    return request.param, session, alone


def _counters(out):
    m = out.metrics
    return (m.num_steps, list(m.tokens_per_step), m.num_generation_tokens, m.spec.num_drafts,
            m.spec.num_draft_tokens, m.spec.num_accepted_tokens, list(m.spec.accepted_per_position))


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_live_batch_between_buckets(n, spec_session, pool, base_outputs):
    method, session, alone = spec_session
    reqs = pool[:n]
    with checked(session) as checks:
        outs = session.generate([p for p, _ in reqs], [_greedy(m) for _, m in reqs])
    assert checks.errors == []
    assert checks.target.num_padded > 0  # rows with fewer drafts were padded at trash

    # the batch really was n wide, then shrank across at least one bucket boundary
    live = [u for _, u in checks.step_sizes]
    assert live[0] == n, live
    cfg = session.config
    assert len({cfg.bucket_for(u) for u in live}) >= 2, live
    assert cfg.bucket_for(n) != n  # n itself lies between buckets: a padded bucket on the compile path

    for i, (out, ref, solo) in enumerate(zip(outs, base_outputs, alone)):
        assert out.token_ids == ref.token_ids, (method, n, i)
        assert out.finish_reason == ref.finish_reason == "length"
        assert len(out.logprobs) == len(out.token_ids)
        for lp, rl in zip(out.logprobs, ref.logprobs):
            assert lp.token_id == rl.token_id and abs(lp.logprob - rl.logprob) < 1e-4
            assert [t for t, _ in lp.top] == [t for t, _ in rl.top]
        # padded rows changed no counter: same as the request alone (same drafts, same steps)
        assert _counters(out) == _counters(solo), (method, n, i)
        assert sum(out.metrics.tokens_per_step) == len(out.token_ids)
    if method in ("ngram", "draft_model", "suffix"):
        assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0
