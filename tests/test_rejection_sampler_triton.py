"""Triton accept/reject kernel (specc.kernels.rejection_sampler_triton) vs the torch reference.

Where the Triton side runs: ``tests/triton_modes.py`` (CUDA, Triton's interpreter in a
child pytest, or skipped without triton).

Exactness. Accept decisions, ``num_accepted``, accepted tokens and greedy tokens must be
bit-identical. The sampled recovered/bonus token can only differ where ``u * total``
falls within float32 summation error of a CDF boundary (the reference's ``torch.cumsum``
and the kernel's blockwise scan add in different orders). Most tests rule such ties out
by construction: the sampling uniform is put in the middle of one token's CDF interval,
that token holding >= 1% of the row's final weight (the input generators make sure one
does), a margin of >= 0.5% of the total: above even the worst-case float32 summation
error bound ``V * 2**-24 * total`` (0.3% at V = 50257; typical errors are ~1e-6), and
then demand exact equality. One test keeps the
uniforms fully random and accepts a differing final token only if it is a verified tie
(the two tokens are neighbours in the CDF and ``u * total`` is within the float32 error
bound ``V * 2**-24 * total`` of their shared boundary).
"""

from __future__ import annotations

import pytest
import torch

from specc.kernels import rejection_sampler_triton as rst
from specc.kernels.rejection_sampler import RejectionOutput, rejection_sample
from specc.runtime.sampling import sample_from_probs
from triton_modes import cuda_compiler_or_skip, rerun_in_interpreter


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def small_blocks(monkeypatch):
    """Force 64-wide vocabulary blocks, so small vocabularies cross many blocks."""
    monkeypatch.setattr(rst, "_MAX_BLOCK_V", 64)
    monkeypatch.setattr(rst, "_MAX_BLOCK_V_INTERPRET", 64)


# --------------------------------------------------------------------------- inputs


def _make_inputs(bsz, k, vocab, mode, use_q, seed, device):
    """Random inputs as a dict of ``rejection_sample`` keyword arguments.

    Target logits: a tail of ``N(0, 1)`` logits, 30% of it filtered (``-inf``), plus 5
    "head" tokens per position around 14, so the distributions are peaked like an LM's
    and drafts get accepted. The drafter's ``q`` is the unfiltered logits plus noise
    (it may propose tokens the target filtered). Drafts: the target argmax half of the
    time, else a sample of the drafter; padding holds out-of-range garbage.
    ``num_draft_tokens`` covers ``0..K``; ``mode`` is ``greedy``, ``sampling`` or ``mixed``.
    ``uniforms_sample`` is random here (see :func:`_tie_free_uniforms`).
    """
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(bsz, k + 1, vocab, generator=gen)
    n_head = min(5, vocab)
    head = torch.rand(bsz, k + 1, vocab, generator=gen).argsort(dim=-1)[..., :n_head]
    raw.scatter_add_(2, head, 14.0 + 1.5 * torch.randn(bsz, k + 1, n_head, generator=gen))
    filtered = (torch.rand(bsz, k + 1, vocab, generator=gen) < 0.3)
    filtered.scatter_(2, head, False)
    logits = raw.masked_fill(filtered, float("-inf"))

    q_full = torch.softmax(raw[:, :k] + 0.7 * torch.randn(bsz, k, vocab, generator=gen), -1)
    sampled = sample_from_probs(
        q_full.reshape(-1, vocab), torch.rand(bsz * k, generator=gen)
    ).view(bsz, k)
    drafts = torch.where(
        torch.rand(bsz, k, generator=gen) < 0.5, logits[:, :k].argmax(-1), sampled
    )
    num_draft = (torch.arange(bsz) % (k + 1))[torch.randperm(bsz, generator=gen)]
    padding = torch.arange(k).unsqueeze(0) >= num_draft.unsqueeze(1)
    garbage = torch.randint(-5, vocab + 5, (bsz, k), generator=gen)
    drafts = torch.where(padding, garbage, drafts)

    if mode == "greedy":
        is_greedy = torch.ones(bsz, dtype=torch.bool)
    elif mode == "sampling":
        is_greedy = torch.zeros(bsz, dtype=torch.bool)
    else:
        is_greedy = (torch.arange(bsz) % 3 == 0)[torch.randperm(bsz, generator=gen)]

    inputs = dict(
        target_logits=logits,
        draft_token_ids=drafts,
        num_draft_tokens=num_draft,
        draft_probs=q_full if use_q else None,
        is_greedy=is_greedy,
        uniforms_accept=torch.rand(bsz, k, generator=gen),
        uniforms_sample=torch.rand(bsz, generator=gen),
    )
    return _on(inputs, device)


def _final_weights(inputs, num_accepted) -> torch.Tensor:
    """``[B, V]`` float64 (CPU): the weights the final token of each sampling row is drawn
    from, given ``num_accepted`` (an independent statement of the reference's rule)."""
    logits = inputs["target_logits"]
    bsz, k_plus_1, vocab = logits.shape
    k = k_plus_1 - 1
    p = torch.softmax(logits.to(torch.float32), dim=-1)  # as the reference, same device
    q = inputs["draft_probs"]
    n = inputs["num_draft_tokens"].clamp(0, k)
    rows = []
    for b in range(bsz):
        f = int(num_accepted[b])
        w = p[b, f]
        if f < int(n[b]):
            d = int(inputs["draft_token_ids"][b, f].clamp(0, vocab - 1))
            if q is None:
                r = w.clone()
                r[d] = 0.0
            else:
                r = (w - q[b, f].to(torch.float32)).clamp_min(0.0)
            if bool((r > 0).any()):
                w = r
        rows.append(w)
    return torch.stack(rows).double().cpu()


def _tie_free_uniforms(weights: torch.Tensor, seed: int) -> torch.Tensor:
    """``[B]`` float32 uniforms, each in the middle of the CDF interval of a token holding
    >= 1% of its row's weight (picked at random among those; the heaviest if none)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for w in weights:
        total = w.sum()
        eligible = torch.nonzero(w >= 0.01 * total).squeeze(1)
        if eligible.numel() == 0:
            t = int(w.argmax())
        else:
            t = int(eligible[torch.randint(eligible.numel(), (1,), generator=gen)])
        upper = w[: t + 1].sum()
        out.append(float((upper - 0.5 * w[t]) / total))
    return torch.tensor(out, dtype=torch.float32)


def _with_tie_free_uniforms(inputs, seed):
    first = rejection_sample(**inputs)  # the accept decisions do not use uniforms_sample
    weights = _final_weights(inputs, first.num_accepted.cpu())
    u = _tie_free_uniforms(weights, seed).to(inputs["uniforms_sample"].device)
    return dict(inputs, uniforms_sample=u)


def _is_float_tie(w: torch.Tensor, u: float, tok_a: int, tok_b: int) -> bool:
    """Whether two tokens drawn from weights ``w`` with uniform ``u`` differ only by
    summation order: neighbours in the CDF, ``u * total`` at their boundary up to the
    float32 error bound ``V * 2**-24 * total``."""
    lo, hi = sorted((tok_a, tok_b))
    if w[lo] <= 0 or w[hi] <= 0 or bool((w[lo + 1 : hi] > 0).any()):
        return False
    total = float(w.sum())
    boundary = float(w[: lo + 1].sum())
    return abs(u * total - boundary) <= w.numel() * 2.0**-24 * total


def _assert_same(inputs, ref: RejectionOutput, tri: RejectionOutput, allow_ties=False) -> int:
    """Exact equality of the two results; with ``allow_ties`` a sampling row's final token
    may differ if :func:`_is_float_tie` says so. Returns the number of such rows."""
    assert isinstance(tri, RejectionOutput)
    for name in ("output_token_ids", "num_accepted", "num_emitted"):
        t = getattr(tri, name)
        assert t.dtype == torch.int64, name
        assert t.device == inputs["target_logits"].device, name
        assert t.shape == getattr(ref, name).shape, name
    ref_ids, tri_ids = ref.output_token_ids.cpu(), tri.output_token_ids.cpu()
    n_acc = ref.num_accepted.cpu()
    assert torch.equal(n_acc, tri.num_accepted.cpu())
    assert torch.equal(ref.num_emitted.cpu(), tri.num_emitted.cpu())
    if torch.equal(ref_ids, tri_ids):
        return 0
    assert allow_ties, f"outputs differ:\nref {ref_ids}\ntri {tri_ids}"
    weights = _final_weights(inputs, n_acc)
    greedy = inputs["is_greedy"].cpu()
    u = inputs["uniforms_sample"].cpu()
    ties = 0
    for b in torch.nonzero((ref_ids != tri_ids).any(dim=1)).squeeze(1).tolist():
        f = int(n_acc[b])
        mask = torch.ones_like(ref_ids[b], dtype=torch.bool)
        mask[f] = False
        assert torch.equal(ref_ids[b][mask], tri_ids[b][mask]), (b, ref_ids[b], tri_ids[b])
        assert not bool(greedy[b]), (b, ref_ids[b], tri_ids[b])
        a, c = int(ref_ids[b, f]), int(tri_ids[b, f])
        assert _is_float_tie(weights[b], float(u[b]), a, c), (b, a, c)
        ties += 1
    return ties


def _on(inputs, device):
    """The input dict with every tensor moved to ``device``."""
    return {n: (t.to(device) if t is not None else None) for n, t in inputs.items()}


def _compare(inputs, allow_ties=False) -> int:
    ref = rejection_sample(**inputs)
    tri = rst.rejection_sample_triton(**inputs)
    return _assert_same(inputs, ref, tri, allow_ties)


# ------------------------------------------------------------- always run (no triton)


def test_module_flags_and_api():
    assert isinstance(rst.TRITON_AVAILABLE, bool)
    assert set(rst.__all__) == {
        "TRITON_AVAILABLE", "rejection_sample_auto", "rejection_sample_triton"
    }
    for fn in (rst.rejection_sample_auto, rst.rejection_sample_triton):
        assert fn.__doc__ and "[B, K+1, V]" in fn.__doc__ + rst.__doc__


def test_auto_on_cpu_is_the_reference():
    inputs = _make_inputs(9, 3, 101, "mixed", True, seed=3, device="cpu")
    ref = rejection_sample(**inputs)
    auto = rst.rejection_sample_auto(**inputs)
    assert torch.equal(ref.output_token_ids, auto.output_token_ids)
    assert torch.equal(ref.num_accepted, auto.num_accepted)


def test_triton_path_errors_without_a_device(monkeypatch):
    inputs = _make_inputs(2, 1, 11, "mixed", False, seed=4, device="cpu")
    if not rst.TRITON_AVAILABLE:
        with pytest.raises(RuntimeError, match="triton"):
            rst.rejection_sample_triton(**inputs)
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        rst.rejection_sample_triton(**inputs)


def test_shape_errors(triton_device):
    inputs = _make_inputs(2, 2, 11, "mixed", True, seed=5, device=triton_device)
    for name, bad in (
        ("target_logits", inputs["target_logits"][0]),
        ("draft_token_ids", inputs["draft_token_ids"][:, :1]),
        ("draft_probs", inputs["draft_probs"][..., :5]),
        ("uniforms_sample", inputs["uniforms_sample"][:1]),
    ):
        with pytest.raises(ValueError):
            rst.rejection_sample_triton(**dict(inputs, **{name: bad}))


def test_triton_side_in_interpreter_subprocess():
    """No GPU, triton installed: rerun this file with TRITON_INTERPRET=1 from the start."""
    rerun_in_interpreter(__file__)


# ----------------------------------------------------------------- Triton vs reference


@pytest.mark.parametrize("use_q", [False, True], ids=["onehot", "q"])
@pytest.mark.parametrize("mode", ["greedy", "sampling", "mixed"])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_matches_reference_v1000(triton_device, k, mode, use_q):
    inputs = _make_inputs(12, k, 1000, mode, use_q, seed=100 + k, device=triton_device)
    _compare(_with_tie_free_uniforms(inputs, seed=k))


@pytest.mark.parametrize("use_q", [False, True], ids=["onehot", "q"])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_matches_reference_v50257(triton_device, k, use_q):
    inputs = _make_inputs(8, k, 50257, "mixed", use_q, seed=200 + k, device=triton_device)
    _compare(_with_tie_free_uniforms(inputs, seed=k))


@pytest.mark.parametrize("vocab", [1, 37, 1000])
def test_matches_reference_many_small_blocks(triton_device, small_blocks, vocab):
    """64-wide blocks: the carried scan / argmax across blocks and a partial last block."""
    for use_q in (False, True):
        inputs = _make_inputs(12, 4, vocab, "mixed", use_q, seed=300 + vocab, device=triton_device)
        _compare(_with_tie_free_uniforms(inputs, seed=vocab))


@pytest.mark.parametrize("vocab", [1000, 50257])
def test_matches_reference_random_uniforms(triton_device, vocab):
    """Unconstructed uniforms: equal up to verified float ties (expected: none)."""
    ties = 0
    for use_q in (False, True):
        inputs = _make_inputs(16, 4, vocab, "mixed", use_q, seed=400, device=triton_device)
        ties += _compare(inputs, allow_ties=True)
    assert ties <= 1


def test_greedy_argmax_ties_take_the_first_index(triton_device, small_blocks):
    vocab = 300
    logits = torch.zeros(2, 3, vocab)
    logits[:, :, [70, 5, 250]] = 3.0  # equal maxima in blocks 1, 0 and 3 (64 wide)
    drafts = torch.tensor([[5, 5], [70, 5]])  # row 1: a later tie index is still rejected
    inputs = _on(dict(
        target_logits=logits, draft_token_ids=drafts, num_draft_tokens=torch.tensor([2, 2]),
        draft_probs=None, is_greedy=torch.tensor([True, True]),
        uniforms_accept=torch.rand(2, 2), uniforms_sample=torch.rand(2),
    ), triton_device)
    tri = rst.rejection_sample_triton(**inputs)
    assert tri.output_token_ids.cpu().tolist() == [[5, 5, 5], [5, -1, -1]]
    _compare(inputs)


# target keeps tokens {0, 1, 2} (p ~ 0.63, 0.23, 0.14) at every position; 3..6 filtered
_EDGE_LOGITS = torch.tensor([[[2.0, 1.0, 0.5] + [float("-inf")] * 4] * 3])
_U_MAX = 0.99999994  # largest float32 below 1
_EDGE_CASES = {
    # name: (drafts, num_draft, greedy, u_accept, u_sample, q kind, expected output)
    "greedy_clamped_ids": ([-3, 7 + 9], 2, True, [0.5, 0.5], 0.5, None, [0, 0, -1]),
    "q_on_filtered_u0": ([4, 0], 2, False, [0.0, 0.0], 0.0, "onehot_4", [0, -1, -1]),
    "onehot_filtered_u0": ([5, 0], 2, False, [0.0, 0.0], 0.5, None, [0, -1, -1]),
    "zero_residual_fallback": ([0, 1], 2, False, [0.7, 0.7], _U_MAX, "2p", [2, -1, -1]),
    "no_drafts_u_max": ([0, 0], 0, False, [0.0, 0.0], _U_MAX, None, [2, -1, -1]),
    "clamped_filtered_q_eq_p": ([7 + 100, -100], 2, False, [0.1, 0.1], 0.3, "p", [0, -1, -1]),
    "onehot_residual_skips_draft": ([1, 2], 1, False, [0.99, 0.2], 0.9, None, [2, -1, -1]),
}


@pytest.mark.parametrize("case", list(_EDGE_CASES))
def test_edge_cases(triton_device, case):
    drafts, n, greedy, ua, us, q_kind, expected = _EDGE_CASES[case]
    p = torch.softmax(_EDGE_LOGITS[:, :2], -1)
    q = {None: None, "p": p.clone(), "2p": 2.0 * p, "onehot_4": torch.zeros_like(p)}[q_kind]
    if q_kind == "onehot_4":
        q[..., 4] = 1.0
    inputs = _on(dict(
        target_logits=_EDGE_LOGITS, draft_token_ids=torch.tensor([drafts]),
        num_draft_tokens=torch.tensor([n]), draft_probs=q, is_greedy=torch.tensor([greedy]),
        uniforms_accept=torch.tensor([ua]), uniforms_sample=torch.tensor([us]),
    ), triton_device)
    tri = rst.rejection_sample_triton(**inputs)
    assert tri.output_token_ids.cpu().tolist() == [expected]
    _compare(inputs)


def test_exact_cdf_boundaries(triton_device, small_blocks):
    """Equal logits give dyadic probabilities, so every CDF value is exact in any order:
    ``u * total`` equal to ``cdf[i]`` must pick ``i + 1`` (the first ``cdf > target``),
    also where ``i`` ends a 64-wide block."""
    for vocab, us, expected in (
        (4, [0.0, 0.25, 0.5, 0.75], [0, 1, 2, 3]),
        (256, [0.25, 0.5, 0.75, 0.2490234375], [64, 128, 192, 63]),
    ):
        bsz = len(us)
        inputs = _on(dict(
            target_logits=torch.zeros(bsz, 1, vocab),
            draft_token_ids=torch.zeros(bsz, 0, dtype=torch.int64),
            num_draft_tokens=torch.zeros(bsz, dtype=torch.int64), draft_probs=None,
            is_greedy=torch.zeros(bsz, dtype=torch.bool), uniforms_accept=torch.zeros(bsz, 0),
            uniforms_sample=torch.tensor(us),
        ), triton_device)
        tri = rst.rejection_sample_triton(**inputs)
        assert tri.output_token_ids[:, 0].cpu().tolist() == expected
        _compare(inputs)


def test_empty_batch_low_precision_and_strided_inputs(triton_device):
    dev = triton_device
    empty = _make_inputs(0, 2, 13, "mixed", True, seed=6, device=dev)
    out = rst.rejection_sample_triton(**empty)
    assert out.output_token_ids.shape == (0, 3) and out.num_accepted.shape == (0,)
    # bfloat16 logits and q, inputs that are non-contiguous views
    inputs = _make_inputs(10, 3, 515, "mixed", True, seed=7, device=dev)
    wide = torch.zeros(10, 4, 600, dtype=torch.bfloat16, device=dev)
    wide[..., :515] = inputs["target_logits"].to(torch.bfloat16)
    inputs = dict(
        inputs,
        target_logits=wide[..., :515],
        draft_probs=inputs["draft_probs"].to(torch.bfloat16),
        draft_token_ids=inputs["draft_token_ids"].t().contiguous().t(),
        uniforms_accept=inputs["uniforms_accept"].t().contiguous().t(),
    )
    _compare(_with_tie_free_uniforms(inputs, seed=7))


def test_auto_dispatch_matches(triton_device):
    inputs = _make_inputs(6, 2, 257, "mixed", True, seed=8, device=triton_device)
    inputs = _with_tie_free_uniforms(inputs, seed=8)
    _assert_same(inputs, rejection_sample(**inputs), rst.rejection_sample_auto(**inputs))


# --------------------------------------------------------- compiled (not interpreted)


def test_kernel_compiles_for_cuda_ahead_of_time(monkeypatch):
    """The interpreter runs the kernel as Python; this checks the real Triton compiler
    accepts it (loop-carried types, scalar control flow) for sm_90, with no GPU needed."""
    triton, GPUTarget, ASTSource = cuda_compiler_or_skip(monkeypatch)
    fn = triton.jit(rst._rejection_sample_kernel)
    sig = {
        "logits_ptr": "*fp32", "probs_ptr": "*fp32", "q_ptr": "*fp32", "drafts_ptr": "*i64",
        "num_draft_ptr": "*i64", "greedy_ptr": "*i32", "ua_ptr": "*fp32", "us_ptr": "*fp32",
        "out_ptr": "*i64", "num_acc_ptr": "*i64", "K": "i32", "V": "i32",
        "HAS_Q": "constexpr", "BLOCK_V": "constexpr",
    }
    for has_q in (False, True):
        src = ASTSource(fn=fn, signature=sig, constexprs={"HAS_Q": has_q, "BLOCK_V": 2048})
        compiled = triton.compile(
            src, target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 8, "enable_fp_fusion": False},
        )
        assert "ptx" in compiled.asm
