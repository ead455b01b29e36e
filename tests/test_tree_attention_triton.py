"""Triton tree attention kernel (specc.kernels.tree_attention_triton) vs the torch reference
on random trees: random parents, odd tree and head sizes, GQA, rows with different prefix
lengths (0 and up to the cache's end), padding nodes, several node and key blocks.

Where the Triton side runs: ``tests/triton_modes.py`` (CUDA, Triton's interpreter in a
child pytest, or skipped without triton). Tolerances: float32 1e-5 (summation order
only); bfloat16 / float16 inputs are compared against the reference run in float32 on
the same (rounded) inputs, within the output's 16-bit rounding.
"""

from __future__ import annotations

import pytest
import torch

from specc.kernels import tree_attention_triton as tat
from specc.kernels.tree_attention import tree_attention
from specc.passes.tree_mask import tree_attention_inputs
from helpers import random_parents, random_tree_inputs
from triton_modes import cuda_compiler_or_skip, rerun_in_interpreter

_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture
def small_blocks(monkeypatch):
    """16-key blocks: long prefixes cross many blocks and trees straddle two."""
    monkeypatch.setattr(tat, "_BLOCK_S", 16)
    monkeypatch.setattr(tat, "_BLOCK_S_INTERPRET", 16)


def _compare(q, k, v, plen, tmask, scale=None):
    got = tat.tree_attention_triton(q, k, v, plen, tmask, scale)
    assert got.shape == q.shape and got.dtype == q.dtype and got.device == q.device
    want = tree_attention(q.float(), k.float(), v.float(), plen, tmask, scale)
    tol = _TOL[q.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


# ------------------------------------------------------------- always run (no triton)


def test_module_flags_and_api():
    assert isinstance(tat.TRITON_AVAILABLE, bool)
    assert set(tat.__all__) == {"TRITON_AVAILABLE", "tree_attention_auto", "tree_attention_triton"}
    for fn in (tat.tree_attention_auto, tat.tree_attention_triton):
        assert fn.__doc__ and "[B, H, N, D]" in fn.__doc__ + tat.__doc__


def test_auto_on_cpu_is_the_reference():
    q, k, v, plen, tmask, _ = random_tree_inputs(0, 3, 4, 2, 5, 8, 20)
    assert torch.equal(tat.tree_attention_auto(q, k, v, plen, tmask), tree_attention(q, k, v, plen, tmask))


def test_triton_path_errors_without_a_device(monkeypatch):
    q, k, v, plen, tmask, _ = random_tree_inputs(0, 1, 2, 2, 3, 8, 10)
    if not tat.TRITON_AVAILABLE:
        with pytest.raises(RuntimeError, match="triton"):
            tat.tree_attention_triton(q, k, v, plen, tmask)
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        tat.tree_attention_triton(q, k, v, plen, tmask)


def test_triton_side_in_interpreter_subprocess():
    """No GPU, triton installed: rerun this file with TRITON_INTERPRET=1 from the start."""
    rerun_in_interpreter(__file__)


# ----------------------------------------------------------------- Triton vs reference


@pytest.mark.parametrize("bsz,heads,kv_heads,n,d,s", [
    (1, 2, 2, 1, 16, 9),  # the root alone
    (3, 4, 2, 7, 24, 50),  # GQA, odd sizes, head size not a power of two
    (4, 6, 1, 5, 16, 37),  # multi-query
    (2, 4, 4, 20, 8, 61),  # 20 nodes: two node blocks of 16
])
def test_matches_reference_random_trees(triton_device, bsz, heads, kv_heads, n, d, s):
    for seed in range(2):
        _compare(*random_tree_inputs(seed, bsz, heads, kv_heads, n, d, s, device=triton_device)[:5])


def test_matches_reference_many_key_blocks(triton_device, small_blocks):
    """Prefixes of 0..190 keys in 16-key blocks; trees whose nodes straddle two blocks."""
    for seed in range(2):
        _compare(*random_tree_inputs(10 + seed, 4, 4, 2, 9, 32, 199, device=triton_device)[:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_16_bit(triton_device, dtype):
    _compare(*random_tree_inputs(3, 3, 4, 2, 6, 64, 90, dtype=dtype, device=triton_device)[:5])


def test_engine_verify_inputs_padding_rows_and_views(triton_device, small_blocks):
    """The engine's inputs: ``TreeAttention.tree_mask`` with padding nodes (rows with
    fewer drafts, one with none), trees past ``kv_len`` for a row with fewer drafts, the
    model's transposed ``q`` view and a cache slice ``[:, :, :kv_len]``; custom scale."""
    dev = triton_device
    gen = torch.Generator().manual_seed(7)
    bsz, k_max, heads, kv_heads, d = 3, 6, 4, 2, 16
    parents = random_parents(gen, bsz, k_max)
    nd, start = torch.tensor([6, 2, 0]), torch.tensor([40, 55, 3])
    kv_len = int((start + nd).max()) + 1
    tree = tree_attention_inputs(parents, nd, start, kv_len, 99)
    q = torch.randn(bsz, k_max + 1, heads, d, generator=gen).to(dev).transpose(1, 2)  # [B, H, N, D] view
    cache_k = torch.randn(bsz, kv_heads, 100, d, generator=gen).to(dev)
    cache_v = torch.randn(bsz, kv_heads, 100, d, generator=gen).to(dev)
    args = (q, cache_k[:, :, :kv_len], cache_v[:, :, :kv_len], start.to(dev), tree.tree_mask.to(dev))
    _compare(*args, scale=0.3)


def test_empty_batch(triton_device):
    q, k, v, plen, tmask, _ = random_tree_inputs(0, 1, 2, 2, 3, 8, 10, device=triton_device)
    out = tat.tree_attention_triton(q[:0], k[:0], v[:0], plen[:0], tmask[:0])
    assert out.shape == (0, 2, 3, 8)


# --------------------------------------------------------- compiled (not interpreted)


def test_kernel_compiles_for_cuda_ahead_of_time(monkeypatch):
    """The interpreter runs the kernel as Python; this checks the real Triton compiler
    accepts it (runtime loop bound, dots, masks) for sm_90, for float32 (IEEE products)
    and bfloat16 (TF32), with no GPU needed."""
    triton, GPUTarget, ASTSource = cuda_compiler_or_skip(monkeypatch)
    fn = triton.jit(tat._tree_attention_kernel)
    for dtype, precision in (("fp32", "ieee"), ("bf16", "tf32")):
        sig = {name: "i32" for name in fn.arg_names}
        sig.update({p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")})
        sig.update(plen_ptr="*i64", tmask_ptr="*i8", qk_scale="fp32")
        consts = dict(BLOCK_N=tat._BLOCK_N, BLOCK_S=tat._BLOCK_S, BLOCK_D=64, DOT_PRECISION=precision)
        sig.update({c: "constexpr" for c in consts})
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert "ptx" in compiled.asm
