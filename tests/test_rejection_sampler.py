"""Accept/reject reference (specc.kernels.rejection_sampler).

Greedy: exact cases. Sampling: losslessness checked statistically on a toy vocabulary
(V = 6) whose target distribution per position is fixed, so the target's sequence
distribution is the product p[0] x p[1] x ...: a full generation by speculative steps
must give the first token ~ p[0] and, jointly, (first, second) ~ p[0] x p[1].
All trials of one check run as one batch (B = trials).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specc.kernels.rejection_sampler import RejectionOutput, rejection_sample
from specc.runtime.sampling import process_logits, sample_from_probs

P_MIN = 1e-3


def _greedy_call(logits, drafts, num_draft):
    bsz, k = drafts.shape
    return rejection_sample(
        logits,
        drafts,
        num_draft,
        None,
        torch.ones(bsz, dtype=torch.bool),
        torch.rand(bsz, k),
        torch.rand(bsz),
    )


def _logits_with_argmax(argmaxes: list[list[int]], vocab: int = 10) -> torch.Tensor:
    t = torch.zeros(len(argmaxes), len(argmaxes[0]), vocab)
    for b, row in enumerate(argmaxes):
        for i, a in enumerate(row):
            t[b, i, a] = 5.0
    return t


# ---------------------------------------------------------------------------- greedy


def test_greedy_cases():
    # target argmax per position (K = 3 -> 4 positions)
    logits = _logits_with_argmax(
        [
            [1, 2, 3, 4],  # all accepted -> bonus = argmax at K
            [1, 2, 3, 4],  # mismatch at 1
            [1, 2, 3, 4],  # mismatch at 0
            [1, 2, 3, 4],  # only 2 drafts, both right -> bonus at position 2
            [1, 2, 3, 4],  # zero drafts -> plain argmax at position 0
            [1, 2, 3, 4],  # padding equals the target but is never accepted
        ]
    )
    drafts = torch.tensor(
        [[1, 2, 3], [1, 9, 3], [7, 2, 3], [1, 2, 0], [5, 5, 5], [1, 2, 3]]
    )
    num_draft = torch.tensor([3, 3, 3, 2, 0, 1])
    out = _greedy_call(logits, drafts, num_draft)
    assert isinstance(out, RejectionOutput)
    assert out.output_token_ids.tolist() == [
        [1, 2, 3, 4],
        [1, 2, -1, -1],
        [1, -1, -1, -1],
        [1, 2, 3, -1],
        [1, -1, -1, -1],
        [1, 2, -1, -1],
    ]
    assert out.num_accepted.tolist() == [3, 1, 0, 2, 0, 1]
    assert out.num_emitted.tolist() == [4, 2, 1, 3, 1, 2]
    assert out.output_token_ids.dtype == torch.int64 and out.num_accepted.dtype == torch.int64


def test_greedy_later_match_after_mismatch_not_accepted():
    logits = _logits_with_argmax([[1, 2, 3, 4, 5]])
    out = _greedy_call(logits, torch.tensor([[1, 0, 3, 4]]), torch.tensor([4]))
    assert out.output_token_ids.tolist() == [[1, 2, -1, -1, -1]]
    assert out.num_accepted.tolist() == [1]


def test_zero_draft_slots():
    logits = _logits_with_argmax([[3], [0]])
    out = _greedy_call(logits, torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert out.output_token_ids.tolist() == [[3], [0]]
    assert out.num_emitted.tolist() == [1, 1]


def test_padding_values_out_of_range_are_ignored():
    logits = _logits_with_argmax([[1, 2, 3]])
    out = _greedy_call(logits, torch.tensor([[1, -1]]), torch.tensor([1]))
    assert out.output_token_ids.tolist() == [[1, 2, -1]]
    out = _greedy_call(logits, torch.tensor([[10**9, 10**9]]), torch.tensor([0]))
    assert out.output_token_ids.tolist() == [[1, -1, -1]]


def test_greedy_ignores_drafter_probs():
    logits = _logits_with_argmax([[1, 2, 3]], vocab=4)
    q = torch.softmax(torch.randn(1, 2, 4), -1)
    out = rejection_sample(
        logits, torch.tensor([[1, 2]]), torch.tensor([2]), q,
        torch.tensor([True]), torch.full((1, 2), 0.999), torch.tensor([0.999]),
    )
    assert out.output_token_ids.tolist() == [[1, 2, 3]]


# ------------------------------------------------------------------ sampling, exact


def test_no_drafts_equals_plain_sampling():
    """k = 0 (or no drafts) emits what non-speculative sampling emits, same uniform."""
    gen = torch.Generator().manual_seed(0)
    bsz, k, vocab = 500, 3, 17
    logits = torch.randn(bsz, k + 1, vocab, generator=gen)
    u = torch.rand(bsz, generator=gen)
    out = rejection_sample(
        logits, torch.zeros(bsz, k, dtype=torch.int64), torch.zeros(bsz, dtype=torch.int64),
        None, torch.zeros(bsz, dtype=torch.bool), torch.rand(bsz, k, generator=gen), u,
    )
    plain = sample_from_probs(torch.softmax(logits[:, 0], -1), u)
    assert torch.equal(out.output_token_ids[:, 0], plain)
    assert (out.output_token_ids[:, 1:] == -1).all()


def test_rows_independent_of_batch():
    """A row's result depends only on its own inputs (seeded requests stay exact)."""
    gen = torch.Generator().manual_seed(1)
    bsz, k, vocab = 12, 4, 9
    logits = torch.randn(bsz, k + 1, vocab, generator=gen) * 2
    q = torch.softmax(torch.randn(bsz, k, vocab, generator=gen), -1)
    drafts = torch.randint(0, vocab, (bsz, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (bsz,), generator=gen)
    greedy = torch.rand(bsz, generator=gen) < 0.3
    ua, us = torch.rand(bsz, k, generator=gen), torch.rand(bsz, generator=gen)
    for probs in (q, None):
        full = rejection_sample(logits, drafts, num_draft, probs, greedy, ua, us)
        for b in range(bsz):
            s = slice(b, b + 1)
            one = rejection_sample(
                logits[s], drafts[s], num_draft[s], None if probs is None else probs[s],
                greedy[s], ua[s], us[s],
            )
            assert torch.equal(one.output_token_ids[0], full.output_token_ids[b])


def test_draft_with_zero_target_prob_never_accepted():
    # target keeps only tokens {0, 1}; drafts propose 2 with q(2) = 1
    logits = torch.tensor([[[1.0, 0.5, float("-inf"), float("-inf")]] * 2])
    q = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]])
    for probs in (q, None):
        out = rejection_sample(
            logits, torch.tensor([[2]]), torch.tensor([1]), probs,
            torch.tensor([False]), torch.zeros(1, 1), torch.tensor([0.999]),
        )
        assert out.num_accepted.item() == 0
        assert out.output_token_ids[0, 0].item() in (0, 1)


# -------------------------------------------------------------- sampling, statistics

# C6's settings: (temperature, top_k, top_p)
SETTINGS = {
    "t0.7_p0.5": (0.7, 0, 0.5),
    "k2": (1.0, 2, 1.0),
    "t1.3": (1.3, 0, 1.0),
}
V, K = 6, 3


def _toy(setting: str, seed: int = 0):
    """Processed target logits [K+1, V] and drafter probs [K, V] (different from p)."""
    gen = torch.Generator().manual_seed(seed)
    temp, top_k, top_p = SETTINGS[setting]
    raw_target = torch.randn(K + 1, V, generator=gen) * 0.6
    raw_draft = raw_target[:K] + torch.randn(K, V, generator=gen) * 0.6
    n = K + 1

    def proc(raw):
        m = raw.shape[0]
        return process_logits(
            raw, torch.full((m,), temp), torch.full((m,), top_k, dtype=torch.int64),
            torch.full((m,), top_p),
        )

    target = proc(raw_target)
    q = torch.softmax(proc(raw_draft), -1)
    assert n == target.shape[0]
    return target, q


def _speculative_generate(target, q, use_q: bool, trials: int, gen: torch.Generator, length: int):
    """Generate `length` tokens per trial with speculative steps (B = trials).

    target[i] is the target's (context-free) processed logits for output position i;
    drafts at output position i are sampled from q[i]; with use_q False they are handed
    over as a deterministic drafter's (q one-hot at the draft: valid for any draft chosen
    independently of the accept/sample uniforms; not uniform drafts, under which some
    wrong residuals happen to average out).
    Returns the generated tokens [trials, length] and the first step's num_accepted.
    """
    nt = target.shape[0]
    tokens = torch.full((trials, length), -1, dtype=torch.int64)
    done = torch.zeros(trials, dtype=torch.int64)
    first_num_accepted = None
    while (done < length).any():
        rows = torch.nonzero(done < length).squeeze(1)
        b = rows.numel()
        pos = done[rows].unsqueeze(1) + torch.arange(K + 1)  # output positions [b, K+1]
        pos_c = pos.clamp(max=nt - 1)
        logits = target[pos_c]  # [b, K+1, V]
        q_rows = q[pos_c[:, :K].clamp(max=K - 1)]  # [b, K, V]
        u_draft = torch.rand(b * K, generator=gen)
        drafts = sample_from_probs(q_rows.reshape(b * K, V), u_draft).view(b, K)
        num_draft = torch.full((b,), K, dtype=torch.int64)
        out = rejection_sample(
            logits, drafts, num_draft, q_rows if use_q else None,
            torch.zeros(b, dtype=torch.bool),
            torch.rand(b, K, generator=gen), torch.rand(b, generator=gen),
        )
        if first_num_accepted is None:
            first_num_accepted = out.num_accepted.clone()
        emitted = out.output_token_ids
        for j in range(K + 1):  # scatter emitted tokens into the output (K+1 columns)
            col = done[rows] + j
            ok = (j < out.num_emitted) & (col < length)
            tokens[rows[ok], col[ok]] = emitted[ok, j]
        done[rows] = (done[rows] + out.num_emitted).clamp(max=length)
    return tokens, first_num_accepted


def _chi2_ok(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value; cells of zero probability must be empty."""
    n = observed.sum()
    zero = probs <= 0
    assert observed[zero].sum() == 0, "emitted a token of zero target probability"
    if (~zero).sum() < 2:  # a single possible token: nothing more to test
        return 1.0
    return chisquare(observed[~zero], probs[~zero] / probs[~zero].sum() * n).pvalue


@pytest.mark.parametrize("use_q", [True, False], ids=["q", "onehot"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_lossless_distribution(setting, use_q):
    target, q = _toy(setting)
    p = torch.softmax(target, -1).double().numpy()
    gen = torch.Generator().manual_seed(hash((setting, use_q)) % 2**31)
    trials = 30_000
    tokens, first_acc = _speculative_generate(target, q, use_q, trials, gen, length=K + 1)
    t = tokens.numpy()
    # drafts were actually used (not just bonus/recovered sampling)
    assert (first_acc > 0).float().mean() > 0.1
    # every position's marginal equals the target's, and filtered tokens never appear
    for i in range(K + 1):
        counts = np.bincount(t[:, i], minlength=V)
        assert _chi2_ok(counts, p[i]) > P_MIN, (setting, use_q, i)
    # joint of the first two tokens equals p[0] x p[1] (i.e. second | first ~ p[1])
    joint = np.bincount(t[:, 0] * V + t[:, 1], minlength=V * V)
    assert _chi2_ok(joint, np.outer(p[0], p[1]).ravel()) > P_MIN, (setting, use_q)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_first_step_per_position_distribution(setting):
    """Within one step: token j, given the step emitted > j tokens, is ~ p[j]."""
    target, q = _toy(setting, seed=1)
    p = torch.softmax(target, -1).double().numpy()
    gen = torch.Generator().manual_seed(99)
    trials = 30_000
    logits = target.expand(trials, -1, -1)
    q_b = q.expand(trials, -1, -1)
    drafts = sample_from_probs(
        q_b.reshape(-1, V), torch.rand(trials * K, generator=gen)
    ).view(trials, K)
    out = rejection_sample(
        logits, drafts, torch.full((trials,), K), q_b, torch.zeros(trials, dtype=torch.bool),
        torch.rand(trials, K, generator=gen), torch.rand(trials, generator=gen),
    )
    toks = out.output_token_ids.numpy()
    emitted = out.num_emitted.numpy()
    for j in range(K + 1):
        sel = emitted > j
        if sel.sum() < 2000:
            continue
        counts = np.bincount(toks[sel, j], minlength=V)
        assert _chi2_ok(counts, p[j]) > P_MIN, (setting, j)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_drafter_equal_to_target_accepts_everything(setting):
    target, _ = _toy(setting)
    trials = 20_000
    gen = torch.Generator().manual_seed(5)
    logits = target.expand(trials, -1, -1).contiguous()
    q = torch.softmax(logits[:, :K], -1)
    drafts = sample_from_probs(q.reshape(-1, V), torch.rand(trials * K, generator=gen)).view(trials, K)
    num_draft = torch.randint(0, K + 1, (trials,), generator=gen)
    out = rejection_sample(
        logits, drafts, num_draft, q, torch.zeros(trials, dtype=torch.bool),
        torch.rand(trials, K, generator=gen), torch.rand(trials, generator=gen),
    )
    assert torch.equal(out.num_accepted, num_draft)


def test_top_k_filtered_tokens_never_emitted_under_stress():
    """Drafter mass concentrated on tokens the target's top-k removed."""
    gen = torch.Generator().manual_seed(8)
    trials, vocab = 20_000, 8
    raw = torch.randn(trials * (K + 1), vocab, generator=gen)
    n = raw.shape[0]
    target = process_logits(
        raw, torch.ones(n), torch.full((n,), 2, dtype=torch.int64), torch.ones(n)
    ).view(trials, K + 1, vocab)
    allowed = torch.isfinite(target)
    # q puts 90% of its mass on tokens the target filtered out
    q_logits = torch.where(allowed[:, :K], 0.0, 3.0) + torch.randn(trials, K, vocab, generator=gen) * 0.1
    q = torch.softmax(q_logits, -1)
    drafts = sample_from_probs(q.reshape(-1, vocab), torch.rand(trials * K, generator=gen)).view(trials, K)
    for probs in (q, None):
        out = rejection_sample(
            target, drafts, torch.full((trials,), K), probs, torch.zeros(trials, dtype=torch.bool),
            torch.rand(trials, K, generator=gen), torch.rand(trials, generator=gen),
        )
        ids = out.output_token_ids
        emitted = ids >= 0
        pos_ok = allowed.gather(2, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        assert (pos_ok | ~emitted).all()
        # drafts were in fact accepted sometimes (those landing on allowed tokens)
        assert out.num_accepted.sum() > 0
