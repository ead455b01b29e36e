"""Few-row linears as row-wise reductions that read each weight once (Inductor's C++ codegen).

What it does
------------
In a flat FX graph (:func:`specc.passes.signature.export_flat`), every
``aten.linear.default(x, W[, b])`` whose input has a static row count
``M = prod(x.shape[:-1]) <= max_rows`` (``W``: ``[N, K]``, any node) becomes::

    x2  = x.reshape(M, K)
    y_m = (x2[m] * W).sum(-1)          for m in 0..M-1      # [N] each
    y   = stack(y_0 .. y_{M-1}).reshape(*x.shape[:-1], N) (+ b)

The M products-and-sums have the same iteration space, so Inductor fuses them into ONE
C++ kernel: for each output feature n it streams the row ``W[n, :]`` once, 16 floats
per AVX-512 vector, and accumulates it against the M input rows (which stay in L1).
The aim: a verify over k+1 tokens that costs what a decode step costs, where MKL's
sgemm for a few rows runs well below the memory bandwidth (table below). Rows
with symbolic M (the prefill chunk) and M > ``max_rows`` keep ``aten.linear`` (there
the GEMM is compute-bound and MKL's blocking wins). Weights keep their
``[out_features, in_features]`` layout, so the tied embedding needs no special case.

Measured: not the default (``specc.compiler.apply_linear_passes`` keeps MKL GEMMs)
-----------------------------------------------------------------------------------
The 30 layers' projections of SmolLM2-135M alone (fp32, cold weights, one thread,
``torch.compile``), vs the same GEMMs through MKL on pre-transposed weights, ms::

    M (rows)             1      2      3      5      8      16
    MKL NN              27.9   41.5   45.6   51.8   70.2   80.6
    this pass           24.3   28.3   33.1   38.8   52.2   94.4

but in the whole AOTInductor program (bench/fuse_projections_speed.py, variant
``small_m+fused``, kv_len 128) it LOSES: T=1 0.88x and T=5 1.02x of the unpassed
program, against 1.13x / 1.02x for fusion + pre-transpose; the 49152 x 576 lm_head
alone takes 15 ms as a reduction against 8 ms in MKL. Without the
``inductor_force_stride_order`` on the input Inductor inlines the RMSNorm into the
reduction and recomputes it per output feature (0.74x / 0.70x). Kept, tested, for the
benchmarks (``--linear-passes small_m``) and as the starting point for a better
lowering; see docs/compile.md, "Verify cost".

Invariants
----------
* Same values up to summation order (vectorised partial sums; max |d| ~1e-5 on unit
  weights); placeholders, outputs and in-place writes untouched, so the graph
  re-exports with the same calling convention.
* Each weight is still one ``get_attr`` (nothing copied); a weight read by several
  linears is read by each rewrite.
* New nodes get ``meta["val"]`` when the inputs carry it.
"""

from __future__ import annotations

import math

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)
from torch import fx

from specc.passes.graph_attrs import fake_val, set_meta

__all__ = ["DEFAULT_MAX_ROWS", "small_m_linears", "static_rows"]

DEFAULT_MAX_ROWS = 8

aten = torch.ops.aten
_FORCE_STRIDE = torch.ops.prims.inductor_force_stride_order.default


def static_rows(x: fx.Node) -> tuple[list[int], int] | None:
    """``(leading dims, K)`` of ``x`` if every size is a plain int, else None."""
    val = x.meta.get("val")
    if val is None or val.dim() < 1:
        return None
    shape = list(val.shape)
    if not all(isinstance(s, int) for s in shape):
        return None
    return shape[:-1], shape[-1]


def small_m_linears(gm: fx.GraphModule, *, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Rewrite every ``aten.linear`` over at most ``max_rows`` static rows into fused
    row-wise reductions (module docstring). Returns how many linears were rewritten.

    Args:
        gm: a flat graph whose nodes carry ``meta["val"]`` (torch.export output).
        max_rows: the largest M rewritten (>= 1).

    Raises:
        ValueError: ``max_rows < 1``.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        dims = static_rows(x)
        if dims is None:
            continue
        lead, k = dims
        m = math.prod(lead)
        if not 1 <= m <= max_rows:
            continue
        n = w.meta["val"].shape[0]
        with graph.inserting_before(node):
            x2 = graph.call_function(aten.reshape.default, (x, [m, k]))
            set_meta(x2, fake_val(lambda v: v.reshape(m, k), x), like=node)
            # a stored, contiguous input: otherwise Inductor inlines the producer (an
            # RMSNorm, a gather) into the reduction and recomputes it for every output
            x2 = graph.call_function(_FORCE_STRIDE, (x2, [k, 1]))
            set_meta(x2, fake_val(lambda v: v.contiguous(), x2.args[0]), like=node)
            rows = []
            for i in range(m):
                xi = graph.call_function(aten.select.int, (x2, 0, i))
                set_meta(xi, fake_val(lambda v: v[i], x2), like=node)
                prod = graph.call_function(aten.mul.Tensor, (xi, w))
                set_meta(prod, fake_val(aten.mul.Tensor, xi, w), like=node)
                row = graph.call_function(aten.sum.dim_IntList, (prod, [-1]))
                set_meta(row, fake_val(lambda v: v.sum(-1), prod), like=node)
                rows.append(row)
            y = graph.call_function(aten.stack.default, (rows,))
            set_meta(y, fake_val(lambda vs: torch.stack(vs), rows), like=node)
            out = graph.call_function(aten.reshape.default, (y, [*lead, n]))
            set_meta(out, fake_val(lambda v: v.reshape(*lead, n), y), like=node)
            if bias is not None:
                out = graph.call_function(aten.add.Tensor, (out, bias))
                set_meta(out, fake_val(aten.add.Tensor, out.args[0], bias), like=node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    graph.lint()
    gm.recompile()
    return count
