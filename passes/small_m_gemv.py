"""Few-row bf16 and fp32 linears through ``specc::small_m_linear`` (kernels/small_m_gemv.py).

In a flat FX graph (:func:`specc.passes.signature.export_flat`), every
``aten.linear.default(x, W[, b])`` whose input, weight (and bias) are all bf16 or all
fp32 and whose input has a static row count ``M = prod(x.shape[:-1])`` within the kernel's limit
(16 rows in bf16, 40 in fp32)
becomes ``specc.small_m_linear.default(x, W[, b])``: the same ``[..., N]`` result (fp32
accumulation, one rounding), computed by a kernel that streams the plain ``[N, K]``
weight once for all rows (bf16: AMX tiles straight from the weight's rows, no packed
copy; fp32: AVX-512 FMAs), where MKL's fp32 GEMM over 5 rows costs ~2x its one-row
sgemv and oneDNN's bf16 linear pays ~30 us a call. Linears with a symbolic row count
(the prefill chunk), more rows or another dtype are left alone (in a bf16 program
Inductor's freezing then packs them for oneDNN, :mod:`specc.passes.packed_weights`).

The op is an extern call in the compiled program: AOTInductor calls it by name through
its proxy executor, so a process that loads such a package must have imported
:mod:`specc.kernels.small_m_gemv` first (it defines the op; the C++ kernel is built or
loaded on the first call).

Invariants: placeholders, outputs and in-place writes untouched (the graph re-exports
with the same calling convention); each weight stays one ``get_attr`` of its original
layout; new nodes get ``meta["val"]``.
"""

from __future__ import annotations

import math

import torch
from torch import fx

import specc.kernels.small_m_gemv as gemv
from specc.passes.graph_attrs import fake_val, set_meta
from specc.passes.small_m_linear import static_rows

__all__ = ["DTYPES", "small_m_gemvs"]

#: Dtypes the kernel has a fast path for (input, weight and bias all the same one).
DTYPES = (torch.bfloat16, torch.float32)
_LINEAR = torch.ops.aten.linear.default
_OP = torch.ops.specc.small_m_linear.default


def _rows(x: fx.Node) -> int | None:
    """Static row count ``M`` of a linear's input, or None (symbolic or unknown shape)."""
    shape = static_rows(x)
    return None if shape is None else math.prod(shape[0])


def small_m_gemvs(gm: fx.GraphModule, *, max_rows: int | None = None) -> int:
    """Rewrite every bf16 / fp32 ``aten.linear`` over at most ``max_rows`` static rows into
    ``specc::small_m_linear`` (module docstring). Returns how many were rewritten.

    Args:
        gm: a flat graph whose nodes carry ``meta["val"]`` (torch.export output).
        max_rows: the largest M rewritten, capped per dtype by the kernel's limit
            (:func:`specc.kernels.small_m_gemv.max_rows`: 16 rows in bf16, 40 in fp32);
            None: that limit.

    Raises:
        ValueError: ``max_rows`` below 1.
    """
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _LINEAR:
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        vals = [a.meta.get("val") for a in (x, w) + ((bias,) if bias is not None else ())]
        if any(v is None or v.dtype not in DTYPES or v.dtype != vals[0].dtype for v in vals):
            continue
        m = _rows(x)
        limit = gemv.max_rows(vals[0].dtype)
        if m is None or not 1 <= m <= (limit if max_rows is None else min(max_rows, limit)):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(_OP, (x, w, bias))
            set_meta(new, fake_val(_OP, x, w, bias), like=node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    graph.lint()
    gm.recompile()
    return count
