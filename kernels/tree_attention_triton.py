"""Tree attention: the Triton kernel for CUDA (device twin of the reference).

Same inputs, semantics and output as :func:`specc.kernels.tree_attention.tree_attention`
(read its module docstring: SpecInfer / Medusa tree attention of the ``N`` nodes of a
token tree over the cached prefix plus their ancestors), computed without the dense
``[B, N, S]`` mask: the kernel reads the prefix length and the compact ``[B, N, N]``
tree mask.

Shapes and dtypes: ``q [B, H, N, D]``; ``k_cache, v_cache [B, KVH, S, D]`` (``q``'s
dtype: float32, bfloat16 or float16; any strides with a unit last-dim stride, e.g. the
model's transposed ``q`` view or a ``KVCache`` tensor); ``prefix_lens [B]`` int64;
``tree_mask [B, N, N]`` bool; out ``[B, H, N, D]`` in ``q``'s dtype, contiguous.

Algorithm (flash-attention style, Dao et al. 2022, one pass with an online softmax). One
program per ``(node block, batch row * query head)``: a block of ``BLOCK_N`` tree nodes
of one head, which reads KV head ``h // (H // KVH)`` (grouped-query attention). It walks
the row's keys ``[0, prefix_len + N)`` in blocks of ``BLOCK_S``:

1. *prefix part*, keys ``j < prefix_len``: all visible;
2. *tree part*, keys ``j = prefix_len + m``: visible iff ``tree_mask[b, i, m]`` (read for
   the block's nodes; keys at or past ``S`` are never read or attended).

Each block's scores ``q k^T * scale`` (in base 2: ``scale * log2(e)``, then ``exp2``) are
folded into a running row maximum ``m``, normaliser ``l`` and accumulator ``acc``
(rescaled by ``exp2(m_old - m_new)``); masked scores are ``-inf`` and a block with no
visible key for a row leaves that row unchanged. The output is ``acc / l``. Both parts are
one loop (the tree keys follow the prefix in the cache; the block that holds the prefix's
end also holds the first tree keys), so each K/V entry is read once per program.
Everything is computed in float32: 16-bit inputs are widened on load and multiplied on
TF32 tensor cores, which hold every bfloat16 / float16 value exactly (so this loses
nothing against a native 16-bit product and keeps the probabilities at TF32 precision
for ``softmax @ V``); float32 inputs use exact IEEE products, not TF32. (Widening also
keeps the kernel off Triton 3.9's interpreter, whose ``tl.dot`` on bfloat16 operands
returns garbage.)

Exactness: equal to the reference within float rounding (different summation order:
~1e-6 relative in float32, a few bf16 ulps in bfloat16), not bit-exact.

Cost: a verify has few nodes (``N = K + 1 <= 17``) and a long prefix, so the kernel is
bound by reading the prefix's K/V, ``H * ceil(N / BLOCK_N)`` reads of it per row (query
heads of one KV group re-read the same K/V; packing a group's heads into one program is
the next step if this shows up in profiles). Limits: offsets are int32 inside a row, so
``S * D`` per KV head must be < 2**31.

When each path is used. :func:`tree_attention_auto` runs this kernel when ``q`` is a
CUDA tensor and Triton is importable, else the torch reference.
:func:`tree_attention_triton` always runs the kernel: on CUDA, or on CPU tensors under
Triton's interpreter (:mod:`specc.kernels.triton_support`). Where the model will call it:
``models/llama.py``'s ``Attention`` takes the dense mask (``TreeAttention.mask``) on the
eager path, where the reference's own ``scaled_dot_product_attention`` over that mask is
what runs; a CUDA tree verify hands ``TreeAttention.tree_mask`` and the rows' start
positions to this kernel instead (the compiled tree ``spec_step``, not built yet, is that
caller).
"""

from __future__ import annotations

import math

import torch

from specc.kernels.tree_attention import check_tree_attention_inputs, tree_attention
from specc.kernels.triton_support import TRITON_AVAILABLE, launch_mode, tl, triton

__all__ = ["TRITON_AVAILABLE", "tree_attention_auto", "tree_attention_triton"]

#: Node rows per program and keys per loop step, compiled / interpreted (the interpreter
#: runs each block op as one numpy call: bigger key blocks are much faster there).
_BLOCK_N = 16
_BLOCK_S = 64
_BLOCK_S_INTERPRET = 256

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- kernel
# Plain function, decorated by ``triton.jit`` on first use (``_kernel``); with
# ``from __future__ import annotations`` the ``tl.constexpr`` annotations stay strings.


def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # q [B, H, N, D], k/v [B, KVH, S, D], out [B, H, N, D]
    plen_ptr,  # [B] int64
    tmask_ptr,  # [B, N, N] int8 (0/1), contiguous
    sq_b, sq_h, sq_n,  # q strides (unit stride along D)
    sk_b, sk_h, sk_s,  # k_cache strides
    sv_b, sv_h, sv_s,  # v_cache strides
    so_b, so_h, so_n,  # out strides
    H, N, S, D, GROUP,  # query heads, nodes, cache length, head size, H // KVH
    qk_scale,  # softmax scale * log2(e)
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = (h // GROUP).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # this block's nodes
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_n < N
    d_ok = offs_d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_n[:, None] * sq_n + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    plen = tl.load(plen_ptr + b).to(tl.int32)
    k_row = k_ptr + b * sk_b + kvh * sk_h
    v_row = v_ptr + b * sv_b + kvh * sv_h
    tmask_rows = tmask_ptr + b * N * N + offs_n[:, None] * N  # [BLOCK_N, 1]

    m_i = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_N,), tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for s0 in range(0, plen + N, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        rel = offs_s - plen  # the key's tree node when 0 <= rel < N
        in_prefix = (offs_s < plen) & (offs_s < S)
        in_tree = (rel >= 0) & (rel < N) & (offs_s < S)
        key_ok = in_prefix | in_tree
        tree_vis = tl.load(tmask_rows + rel[None, :], mask=row_ok[:, None] & in_tree[None, :], other=0)
        visible = in_prefix[None, :] | (tree_vis != 0)  # [BLOCK_N, BLOCK_S]

        k = tl.load(k_row + offs_s[:, None] * sk_s + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_row + offs_s[:, None] * sv_s + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # rows past N: never stored
    tl.store(out_ptr + b * so_b + h * so_h + offs_n[:, None] * so_n + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_KERNELS: dict[bool, object] = {}


def _kernel(interpret: bool):
    """The ``triton.jit`` kernel for the current mode (built once per mode)."""
    kern = _KERNELS.get(interpret)
    if kern is None:
        kern = _KERNELS[interpret] = triton.jit(_tree_attention_kernel)
    return kern


# --------------------------------------------------------------------------- host side


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          prefix_lens: torch.Tensor, tree_mask: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """Tree attention with the Triton kernel; the contract of
    :func:`specc.kernels.tree_attention.tree_attention` (module docstrings: algorithm,
    exactness).

    Args:
        q: ``[B, H, N, D]`` float queries of the tree nodes (RoPE applied).
        k_cache, v_cache: ``[B, KVH, S, D]`` in ``q``'s dtype: prefix K/V at
            ``[0, prefix_lens[b])``, node ``m``'s at ``prefix_lens[b] + m``.
        prefix_lens: ``[B]`` int64, ``0..S`` (not checked: reading it would sync).
        tree_mask: ``[B, N, N]`` bool, node ``i`` sees node ``m``.
        scale: softmax scale (default ``1 / sqrt(D)``).

    Returns:
        ``[B, H, N, D]`` contiguous, ``q``'s dtype, on ``q``'s device.

    Raises:
        RuntimeError: ``triton`` is not importable, or ``TRITON_INTERPRET=1`` was set only
            after ``triton`` was imported.
        ValueError: shapes, dtypes or devices that do not fit, ``S * D >= 2**31``, or
            tensors not on CUDA while Triton's interpreter is off.
    """
    interpret = launch_mode("tree_attention_triton", q.device, "tree_attention_auto or the torch "
                            "reference tree_attention")
    check_tree_attention_inputs(q, k_cache, v_cache, prefix_lens, tree_mask)
    bsz, heads, n, d = q.shape
    kv_heads, s = k_cache.shape[1], k_cache.shape[2]
    if s * d >= 2**31:
        raise ValueError(f"S * D must be < 2**31 (int32 offsets in a row), got S = {s}, D = {d}")
    out = torch.empty(bsz, heads, n, d, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    unit = [t.stride(-1) == 1 for t in (q, k_cache, v_cache)]
    q, k_cache, v_cache = (t if ok else t.contiguous() for t, ok in zip((q, k_cache, v_cache), unit))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    block_s = _BLOCK_S_INTERPRET if interpret else _BLOCK_S
    grid = (triton.cdiv(n, _BLOCK_N), bsz * heads)
    _kernel(interpret)[grid](
        q, k_cache, v_cache, out, prefix_lens.contiguous(), tree_mask.to(torch.int8).contiguous(),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, n, s, d, heads // kv_heads, scale * _LOG2E,
        BLOCK_N=_BLOCK_N, BLOCK_S=block_s, BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def tree_attention_auto(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        prefix_lens: torch.Tensor, tree_mask: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """Tree attention with the best available implementation: :func:`tree_attention_triton`
    for CUDA tensors when Triton is importable, else the torch reference
    :func:`specc.kernels.tree_attention.tree_attention` (same arguments and result)."""
    if TRITON_AVAILABLE and q.is_cuda:
        return tree_attention_triton(q, k_cache, v_cache, prefix_lens, tree_mask, scale)
    return tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale)
