"""Logits processors, inverse-CDF sampling and logprobs (specc.runtime.sampling)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specc.runtime.sampling import (
    compute_logprobs,
    greedy_mask,
    process_logits,
    sample_from_probs,
)

NEG_INF = float("-inf")


def reference_keep(row: list[float], temperature: float, top_k: int, top_p: float):
    """Plain per-row reference: the set of kept token ids and the boundary slack.

    Returns (kept ids, slack) where slack is how far the top-p cut is from a float
    tie (small slack = the float32 implementation may legitimately differ).
    """
    vocab = len(row)
    if temperature <= 0:
        return set(range(vocab)), math.inf
    scaled = [x / temperature for x in row]
    kept = set(range(vocab))
    if 0 < top_k < vocab:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        kept = {i for i in kept if scaled[i] >= kth}
    slack = math.inf
    if top_p < 1.0:
        m = max(scaled[i] for i in kept)
        w = {i: math.exp(scaled[i] - m) for i in kept}
        z = sum(w.values())
        order = sorted(kept, key=lambda i: (-scaled[i], i))
        new_kept, cum = set(), 0.0
        for i in order:
            new_kept.add(i)
            cum += w[i] / z
            slack = min(slack, abs(cum - top_p))
            if cum >= top_p:
                break
        kept = new_kept
    return kept, slack


def _random_case(gen: torch.Generator, n: int, vocab: int):
    logits = torch.randn(n, vocab, generator=gen) * 3.0
    temperature = torch.rand(n, generator=gen) * 2.0 + 0.05
    temperature[torch.rand(n, generator=gen) < 0.15] = 0.0
    top_k = torch.randint(-1, vocab + 2, (n,), generator=gen)
    top_p = torch.rand(n, generator=gen) * 0.95 + 0.05
    top_p[torch.rand(n, generator=gen) < 0.3] = 1.0
    return logits, temperature, top_k, top_p


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vocab", [1, 2, 7, 64])
def test_process_logits_matches_reference(seed, vocab):
    gen = torch.Generator().manual_seed(seed * 100 + vocab)
    logits, temperature, top_k, top_p = _random_case(gen, 48, vocab)
    out = process_logits(logits, temperature, top_k, top_p)
    assert out.shape == logits.shape and out.dtype == torch.float32
    for r in range(logits.shape[0]):
        t, k, p = float(temperature[r]), int(top_k[r]), float(top_p[r])
        kept, slack = reference_keep(logits[r].double().tolist(), t, k, p)
        got = set(torch.nonzero(torch.isfinite(out[r])).flatten().tolist())
        if slack > 1e-5:
            assert got == kept, (r, t, k, p)
        if t <= 0:
            torch.testing.assert_close(out[r], logits[r], rtol=0, atol=0)
        else:
            idx = sorted(got)
            torch.testing.assert_close(out[r, idx], logits[r, idx] / t)


def test_top_k_keeps_ties_with_kth_value():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    one = torch.ones(1)
    out = process_logits(logits, one, torch.tensor([2]), one)
    assert torch.isfinite(out).tolist() == [[True, False, True, True, False]]
    out = process_logits(logits, one, torch.tensor([1]), one)
    assert torch.isfinite(out).tolist() == [[True, False, False, False, False]]


def test_top_p_semantics_and_top_token_always_kept():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    one = torch.ones(1)
    no_k = torch.zeros(1, dtype=torch.int64)

    def kept(p):
        out = process_logits(logits, one, no_k, torch.tensor([p]))
        return torch.isfinite(out)[0].tolist()

    assert kept(0.5) == [True, False, False, False]  # 0.5 >= 0.5 already
    assert kept(0.51) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(0.96) == [True, True, True, True]
    assert kept(1e-6) == [True, False, False, False]
    # top-p after top-k: renormalised over {0.5, 0.3}: 0.625, 0.375
    out = process_logits(logits, one, torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(out)[0].tolist() == [True, False, False, False]
    out = process_logits(logits, one, torch.tensor([2]), torch.tensor([0.7]))
    assert torch.isfinite(out)[0].tolist() == [True, True, False, False]


def test_top_p_off_keeps_everything_even_tiny_tail():
    # exclusive cumsum of the tail can round to >= 1.0; top_p == 1 must still be off
    logits = torch.cat([torch.tensor([[40.0]]), torch.zeros(1, 999)], dim=1)
    out = process_logits(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))
    assert torch.isfinite(out).all()


def test_temperature_scaling_and_greedy_rows_untouched():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=gen)
    temperature = torch.tensor([0.0, 0.5, 2.0])
    out = process_logits(logits, temperature, torch.tensor([3, 0, 0]), torch.tensor([0.1, 1.0, 1.0]))
    torch.testing.assert_close(out[0], logits[0], rtol=0, atol=0)  # greedy: no filtering
    torch.testing.assert_close(out[1], logits[1] / 0.5)
    torch.testing.assert_close(out[2], logits[2] / 2.0)
    assert greedy_mask(temperature).tolist() == [True, False, False]


def test_tiny_temperature_is_sampling_not_greedy():
    """Only temperature 0 is greedy (SamplingParams.is_greedy agrees); a tiny positive
    temperature scales (near-argmax) and stays finite."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    temperature = torch.tensor([1e-6, 1e-38])
    assert not greedy_mask(temperature).any()
    out = process_logits(logits, temperature, torch.zeros(2, dtype=torch.int64), torch.ones(2))
    assert torch.isfinite(out).all()
    probs = torch.softmax(out, -1)
    assert probs[:, 1].tolist() == [1.0, 1.0]


def test_compiled_path_matches_eager(monkeypatch):
    """The branch-free path taken under torch.compile gives the eager result."""
    gen = torch.Generator().manual_seed(7)
    logits, temperature, top_k, top_p = _random_case(gen, 64, 50)
    eager = process_logits(logits, temperature, top_k, top_p)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = process_logits(logits, temperature, top_k, top_p)
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
def test_fast_path_identical_to_full_sort(monkeypatch, kind):
    """Eager topk-candidate path == full stable sort, bit for bit, incl. fallback rows."""
    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    n, vocab = 24, 5000
    if kind == "peaked":  # top-p mass inside the first 1024 candidates
        logits = torch.randn(n, vocab, generator=gen) * 4.0
    elif kind == "flat":  # top-p needs more than 1024 tokens: falls back to the sort
        logits = torch.randn(n, vocab, generator=gen) * 0.05
    else:  # many exact ties, also at the candidate boundary
        logits = torch.randint(0, 6, (n, vocab), generator=gen).float()
    temperature = torch.rand(n, generator=gen) + 0.5
    top_k = torch.randint(0, 1100, (n,), generator=gen)
    top_k[::3] = 0
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.05
    top_p[1::4] = 1.0
    fast = process_logits(logits, temperature, top_k, top_p)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    full = process_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(full))
    torch.testing.assert_close(fast, full, rtol=0, atol=0)
    for r in range(0, n, 5):  # and the definition, on a few rows
        kept, slack = reference_keep(
            logits[r].double().tolist(), float(temperature[r]), int(top_k[r]), float(top_p[r])
        )
        if slack > 1e-5 and kind != "ties":
            assert set(torch.nonzero(torch.isfinite(fast[r])).flatten().tolist()) == kept


def test_process_logits_rows_are_independent():
    gen = torch.Generator().manual_seed(3)
    logits, temperature, top_k, top_p = _random_case(gen, 16, 30)
    full = process_logits(logits, temperature, top_k, top_p)
    for r in range(16):
        one = process_logits(logits[r : r + 1], temperature[r : r + 1], top_k[r : r + 1], top_p[r : r + 1])
        torch.testing.assert_close(one[0], full[r], rtol=0, atol=0)


# ---------------------------------------------------------------- sample_from_probs


def test_sample_from_probs_distribution():
    probs = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.6])
    n = 40_000
    gen = torch.Generator().manual_seed(1234)
    u = torch.rand(n, generator=gen)
    ids = sample_from_probs(probs.expand(n, -1), u)
    assert ids.dtype == torch.int64 and ids.shape == (n,)
    counts = torch.bincount(ids, minlength=6).numpy()
    assert counts[1] == 0 and counts[4] == 0
    nz = probs.numpy() > 0
    assert chisquare(counts[nz], probs.numpy()[nz] * n).pvalue > 1e-3


def test_sample_from_probs_is_the_inverse_cdf():
    probs = torch.tensor([[0.25, 0.25, 0.5]]).expand(6, -1)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 0.99999])
    assert sample_from_probs(probs, u).tolist() == [0, 0, 1, 1, 2, 2]


def test_sample_from_probs_never_returns_zero_prob_token_at_extremes():
    # cumsum that does not reach 1 (or overshoots), trailing and leading zeros, u -> 1
    u_max = 1.0 - 2.0**-24  # largest float32 below 1 (what torch.rand can return)
    rows = torch.tensor(
        [
            [0.0, 0.3, 0.3, 0.3, 0.0, 0.0],  # sums to 0.9 (unnormalised)
            [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
            [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [1e-30, 0.0, 0.0, 1.0, 0.0, 0.0],
            [0.2, 0.2, 0.2, 0.2, 0.2000001, 0.0],  # sums slightly above 1
            [5.0, 0.0, 3.0, 0.0, 0.0, 0.0],  # arbitrary scale
        ]
    )
    for u in [0.0, 1e-12, 0.5, 0.9, 0.999999, u_max]:
        ids = sample_from_probs(rows, torch.full((rows.shape[0],), u))
        assert (rows.gather(1, ids[:, None]) > 0).all(), (u, ids)
    assert sample_from_probs(rows[1:2], torch.tensor([0.0])).item() == 5
    assert sample_from_probs(rows[0:1], torch.tensor([u_max])).item() == 3


def test_sample_from_probs_random_rows_never_zero():
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(2000, 40, generator=gen)
    probs[torch.rand(2000, 40, generator=gen) < 0.7] = 0.0
    probs[:, 7] += 1e-3  # no all-zero rows
    probs = probs / probs.sum(-1, keepdim=True)
    u = torch.rand(2000, generator=gen)
    u[:200] = 1.0 - 2.0**-24
    ids = sample_from_probs(probs, u)
    assert (probs.gather(1, ids[:, None]) > 0).all()


def test_sample_from_processed_logits_respects_filters():
    gen = torch.Generator().manual_seed(11)
    n, vocab = 5000, 20
    logits = torch.randn(n, vocab, generator=gen)
    out = process_logits(
        logits, torch.full((n,), 0.7), torch.full((n,), 5), torch.full((n,), 0.6)
    )
    ids = sample_from_probs(torch.softmax(out, -1), torch.rand(n, generator=gen))
    assert torch.isfinite(out.gather(1, ids[:, None])).all()


# ---------------------------------------------------------------- compute_logprobs


def test_compute_logprobs():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 12, generator=gen)
    temperature = torch.tensor([0.0, 1.0, 0.5, 1.0])
    processed = process_logits(logits, temperature, torch.tensor([0, 3, 0, 0]), torch.ones(4))
    tokens = torch.tensor([1, int(processed[1].argmax()), 4, 11])
    lp, top_ids, top_lp = compute_logprobs(processed, tokens, 3)
    assert lp.shape == (4,) and top_ids.shape == (4, 3) and top_lp.shape == (4, 3)
    ref = torch.log_softmax(processed.double(), -1).float()
    torch.testing.assert_close(lp, ref[torch.arange(4), tokens])
    # greedy row: logprobs of the raw logits
    torch.testing.assert_close(lp[0], torch.log_softmax(logits[0], -1)[1])
    assert top_ids[0].tolist() == torch.argsort(logits[0], descending=True)[:3].tolist()
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()
    # top-k filtered row: exactly 3 finite logprobs that sum (in prob space) to 1
    assert torch.isfinite(top_lp[1]).all()
    assert math.isclose(float(top_lp[1].exp().sum()), 1.0, rel_tol=1e-5)
    # zero top alternatives, and more than V
    _, ids0, lp0 = compute_logprobs(processed, tokens, 0)
    assert ids0.shape == (4, 0) and lp0.shape == (4, 0)
    _, ids_all, _ = compute_logprobs(processed, tokens, 100)
    assert ids_all.shape == (4, 12)
    assert np.isneginf(compute_logprobs(processed, torch.tensor([0, int(processed[1].argmin()), 0, 0]), 1)[0][1].item())
