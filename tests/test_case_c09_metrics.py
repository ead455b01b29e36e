"""C9: metrics (../shared/cases/correctness.md).

Oracle drafter, k=5: (a) the end token at draft position 3 of the last step; (b)
max_tokens cutting the last block; (c) a batch of 3 ending at different offsets.
Checked: the tokens emitted per step sum to the output length; acceptance length ==
emitted tokens / verify steps; the accepted counters never count tokens after the end
(exact expected counters, per position too); the session totals are the sum of the
requests'. The identities are also checked with a real drafter (draft model == target).

Counting conventions (``specc/outputs.py``): ``tokens_per_step`` starts with the
prefill token; a verify step emits accepted + 1 tokens, so the accepted count of a step
cut by an end token is what it emitted minus one, and ``mean_acceptance_length`` =
1 + accepted / drafts = tokens emitted by verify steps / verify steps.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from helpers import drafter_spec, find_block_end, greedy, greedy_truth, make_session, oracle_table
from spec_drafters import OracleDrafter
from specc.outputs import SpecMetrics
from specc.session import Session

K = 5
TRUTH_LEN = 64
PROMPTS = [
    "The quick brown fox",
    "Hello world, this is a test",
    "one two three one two three one two three",
    "In a hole in the ground there lived",
    "def fibonacci(n):",
    "Lorem ipsum dolor sit amet",
]


@pytest.fixture(scope="module")
def truth(base) -> list[tuple[list[int], list[int]]]:
    return greedy_truth(base, PROMPTS, TRUTH_LEN, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, truth) -> Session:
    return make_session(tiny_llama_dir, proposer=OracleDrafter(K, oracle_table(truth)))


@pytest.fixture(scope="module")
def draft_model(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, drafter_spec("draft_model", K, tiny_llama_dir))


def find_end(truth, eos_ids, p: int, block: int):
    """(prompt, output, index): the output's first occurrence of a token, at offset p
    (1-based) of verify block ``block`` (1-based) or one of the next four."""
    return find_block_end(truth, eos_ids, K, p, range(block - 1, block + 4))


def snapshot(m: SpecMetrics) -> SpecMetrics:
    return SpecMetrics(m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, list(m.accepted_per_position))


def check_identities(out) -> None:
    """The C9 identities for one request whose every verify step carried drafts."""
    met, s = out.metrics, out.metrics.spec
    n_out = len(out.token_ids)
    assert sum(met.tokens_per_step) == n_out == met.num_generation_tokens
    assert len(met.tokens_per_step) == met.num_steps + 1 and met.tokens_per_step[0] == 1
    assert s.num_drafts == met.num_steps  # precondition: every verify step drafted
    emitted_by_verify = n_out - 1
    assert Fraction(s.num_accepted_tokens, s.num_drafts) + 1 == Fraction(emitted_by_verify, met.num_steps)
    assert s.mean_acceptance_length == pytest.approx(emitted_by_verify / met.num_steps, rel=1e-12)
    # accepted = emitted minus the one recovered/bonus/end-cut token of each step
    assert s.num_accepted_tokens == sum(t - 1 for t in met.tokens_per_step[1:])
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert len(s.accepted_per_position) == K
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    assert s.accepted_per_position[0] <= s.num_drafts
    assert s.num_accepted_tokens <= s.num_draft_tokens <= K * s.num_drafts
    assert s.acceptance_rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)


def test_end_token_at_draft_position_3_of_last_step(base, truth, oracle):
    p = 3
    prompt, out_true, i = find_end(truth, oracle.eos_token_ids, p, block=3)
    stop = out_true[i]
    before = snapshot(oracle.metrics)
    out = oracle.generate([prompt], greedy(TRUTH_LEN, stop_token_ids=[stop]))[0]
    ref = base.generate([prompt], greedy(TRUTH_LEN, stop_token_ids=[stop]), use_speculation=False)[0]
    assert out.token_ids == ref.token_ids == out_true[: i + 1]
    assert out.finish_reason == "stop"
    met, s = out.metrics, out.metrics.spec
    n = met.num_steps
    assert n == (i - 1) // (K + 1) + 1 and n >= 3
    assert met.tokens_per_step == [1] + [K + 1] * (n - 1) + [p]
    check_identities(out)
    # the last step verified 5 drafts; d1, d2 and the end token d3 were emitted; d4, d5
    # and the bonus token (all correct!) come after the end and are never counted
    assert s.num_drafts == n
    assert s.num_draft_tokens == K * n
    assert s.num_accepted_tokens == K * (n - 1) + (p - 1)
    assert s.accepted_per_position == [n] * (p - 1) + [n - 1] * (K - p + 1)
    assert s.mean_acceptance_length == pytest.approx((len(out.token_ids) - 1) / n)
    # session totals grew by exactly this request's counters
    after = oracle.metrics
    assert after.num_drafts - before.num_drafts == s.num_drafts
    assert after.num_draft_tokens - before.num_draft_tokens == s.num_draft_tokens
    assert after.num_accepted_tokens - before.num_accepted_tokens == s.num_accepted_tokens


@pytest.mark.parametrize("last", [1, 2, 3, 5])
def test_max_tokens_cutting_last_block(base, truth, oracle, last):
    """max_tokens = prefill token + 2 full blocks + ``last`` tokens: the last step may
    verify only last-1 drafts, all accepted."""
    m = 1 + 2 * (K + 1) + last
    prompt, out_true = truth[0]
    out = oracle.generate([prompt], greedy(m))[0]
    ref = base.generate([prompt], greedy(m), use_speculation=False)[0]
    assert out.token_ids == ref.token_ids == out_true[:m]
    assert out.finish_reason == "length" and len(out.token_ids) == m
    met, s = out.metrics, out.metrics.spec
    assert met.tokens_per_step == [1, K + 1, K + 1, last]
    if last == 1:  # no room for a draft: the last step is a plain decode, not a draft step
        assert met.num_steps == 3 and s.num_drafts == 2
        assert s.num_draft_tokens == s.num_accepted_tokens == 2 * K
        assert s.accepted_per_position == [2] * K
        assert sum(met.tokens_per_step) == m
    else:
        check_identities(out)
        assert s.num_drafts == met.num_steps == 3
        assert s.num_draft_tokens == s.num_accepted_tokens == 2 * K + last - 1
        assert s.acceptance_rate == 1.0
        assert s.accepted_per_position == [3] * (last - 1) + [2] * (K - last + 1)
        assert s.mean_acceptance_length == pytest.approx((m - 1) / 3)


def test_batch_of_three_ending_at_different_offsets(base, truth, oracle):
    """Three rows: end token at offset 1 of block >= 2, end token at offset 4 of block 1,
    max_tokens ending at offset 6 (the bonus slot) of block 2. Per-row counters are exact
    and the session totals are their sum."""
    a = find_end(truth, oracle.eos_token_ids, 1, block=2)
    b = find_end(truth, oracle.eos_token_ids, 4, block=1)
    c_prompt, c_out = next((p, o) for p, o in truth if tuple(p) not in {tuple(a[0]), tuple(b[0])})
    prompts = [a[0], b[0], c_prompt]
    params = [greedy(TRUTH_LEN, stop_token_ids=[a[1][a[2]]]),
              greedy(TRUTH_LEN, stop_token_ids=[b[1][b[2]]]),
              greedy(1 + 2 * (K + 1))]
    expected = [a[1][: a[2] + 1], b[1][: b[2] + 1], c_out[: 1 + 2 * (K + 1)]]
    offsets = [1, 4, K + 1]
    before = snapshot(oracle.metrics)
    outs = oracle.generate(prompts, params)
    refs = base.generate(prompts, params, use_speculation=False)
    total = SpecMetrics()
    for out, ref, exp, p in zip(outs, refs, expected, offsets):
        assert out.token_ids == ref.token_ids == exp
        check_identities(out)
        met, s = out.metrics, out.metrics.spec
        n = met.num_steps
        assert met.tokens_per_step == [1] + [K + 1] * (n - 1) + [p]
        assert s.num_draft_tokens == K * n
        assert s.num_accepted_tokens == K * (n - 1) + (p - 1)
        assert s.accepted_per_position == [n] * (p - 1) + [n - 1] * (K - p + 1)
        total.add(s)
    assert [o.finish_reason for o in outs] == ["stop", "stop", "length"]
    after = oracle.metrics
    assert after.num_drafts - before.num_drafts == total.num_drafts
    assert after.num_draft_tokens - before.num_draft_tokens == total.num_draft_tokens
    assert after.num_accepted_tokens - before.num_accepted_tokens == total.num_accepted_tokens
    assert [x - y for x, y in zip(after.accepted_per_position, before.accepted_per_position)] == \
        total.accepted_per_position


def test_identities_with_draft_model(base, truth, draft_model):
    """A real drafter, a batch of three with an end token, a max_tokens cut and a long run:
    every request satisfies the identities, and no step counts more accepted tokens than
    it emitted."""
    a = find_end(truth, draft_model.eos_token_ids, 3, block=2)
    prompts = [a[0], truth[1][0], truth[2][0]]
    params = [greedy(TRUTH_LEN, stop_token_ids=[a[1][a[2]]]), greedy(17), greedy(TRUTH_LEN)]
    outs = draft_model.generate(prompts, params)
    refs = base.generate(prompts, params, use_speculation=False)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        check_identities(out)
