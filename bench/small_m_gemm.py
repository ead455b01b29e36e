"""Few-row GEMM kernels on CPU: what a (k+1)-row verify pays per weight byte.

The projections of a Llama-family model (default: SmolLM2-135M's 30 layers of q/k/v
fused 576->960, o 576->576, gate/up fused 576->3072, down 1536->576, random fp32
weights, ~425 MB, so every call streams them from memory) run for M rows with each
variant, timed interleaved (best of ``--repeats`` rounds, ms), and the ratio to the
variant's own M=1 time:

* ``nt``: ``F.linear`` (MKL sgemm, weight [N, K], B transposed) — eager specc;
* ``nn``: ``x @ W.t().contiguous()`` (MKL sgemm, row-major B) — what
  ``passes/pretranspose_weights.py`` gives compiled programs;
* ``mkl_packed``: ``torch.ops.mkl._mkl_linear`` on weights packed for M rows
  (``_mkl_reorder_linear_weight``), what Inductor's freezing uses for fp32;
* ``reduction``: the rows as fused Inductor reductions (``torch.compile`` of the
  formulation ``passes/small_m_linear.py`` writes);
* ``cpp_template``: ``torch.compile`` with ``freezing`` + ``max_autotune`` and the CPP
  GEMM template (Inductor's own AVX-512 micro-kernels over packed weights; one
  autotuned compile per M, ~1 min each);
* ``bf16_nt``: the same weights in bf16 through ``F.linear`` (oneDNN, weight re-laid-out
  per call) — eager specc with ``dtype: bfloat16``;
* ``bf16_packed``: bf16 weights packed once (``mkldnn._reorder_linear_weight``) through
  ``mkldnn._linear_pointwise``, what Inductor's freezing (and so a compiled bf16 program,
  ``passes/packed_weights.py``) runs;
* ``bf16_gemv``: bf16 weights as they are ``[N, K]`` through ``specc::small_m_linear``
  (``kernels/small_m_gemv.py``: AVX512_BF16 dot products streaming each weight once);
* ``gemv``: the fp32 weights as they are ``[N, K]`` through the same op (its fp32 path:
  AVX-512 FMAs streaming each weight once) — what ``"gemv"`` lowering gives fp32 programs.

``--lm-head`` times SmolLM2's 49152 x 576 lm_head alone instead of the layers. Besides ms
the table gives GB/s of weight bytes read (fp32 variants 4 bytes a weight, bf16 ones 2).

Usage: python bench/small_m_gemm.py [--rows 1 2 3 5 8 16] [--variants nt nn ...] [--threads 1] [--lm-head]
Results and conclusions: docs/compile.md, "Verify cost".
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) per projection
LM_HEAD = [(576, 49152)]
VARIANTS = ("nt", "nn", "mkl_packed", "reduction", "cpp_template", "bf16_nt", "bf16_packed", "bf16_gemv", "gemv")


def _rows_reduction(x, weights):
    return [torch.stack([(x[j % len(x)][m, None, :] * w).sum(-1) for m in range(x[0].shape[0])])
            for j, w in enumerate(weights)]


class _Stack(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.ls = torch.nn.ModuleList()
        for w in weights:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data = w
            self.ls.append(lin)

    def forward(self, xs):
        return [lin(xs[j % len(xs)]) for j, lin in enumerate(self.ls)]


def build(variant: str, weights, m: int):
    """A function of the per-shape inputs running every projection once."""
    if variant == "nt":
        return lambda xs: [F.linear(xs[j % 4], w) for j, w in enumerate(weights)]
    if variant == "nn":
        wts = [w.t().contiguous() for w in weights]
        return lambda xs: [xs[j % 4] @ w for j, w in enumerate(wts)]
    if variant == "mkl_packed":
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
        return lambda xs: [torch.ops.mkl._mkl_linear(xs[j % 4], p, w, None, m)
                           for j, (p, w) in enumerate(zip(packed, weights))]
    if variant == "reduction":
        return torch.compile(lambda xs: _rows_reduction(xs, weights), dynamic=False)
    if variant == "cpp_template":
        import torch._inductor.config as ic

        with ic.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
            fn = torch.compile(_Stack(weights).eval(), dynamic=False)
            xs = [torch.randn(m, k) for k, _ in SHAPES]
            with torch.no_grad():
                fn(xs)  # compile (and autotune) under the patched config
        return fn
    if variant == "bf16_nt":
        w16 = [w.bfloat16() for w in weights]
        return lambda xs: [F.linear(xs[j % 4].bfloat16(), w) for j, w in enumerate(w16)]
    if variant == "bf16_packed":
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), m) for w in weights]
        return lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[j % 4].bfloat16(), p, None, "none", [], "")
                           for j, p in enumerate(packed)]
    if variant == "bf16_gemv":
        from specc.kernels.small_m_gemv import small_m_linear

        w16 = [w.bfloat16() for w in weights]
        return lambda xs: [small_m_linear(xs[j % 4].bfloat16(), w) for j, w in enumerate(w16)]
    if variant == "gemv":
        from specc.kernels.small_m_gemv import small_m_linear

        return lambda xs: [small_m_linear(xs[j % 4], w) for j, w in enumerate(weights)]
    raise ValueError(variant)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS[:4]), choices=VARIANTS)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lm-head", action="store_true", help="the 49152 x 576 lm_head alone (once per layer count 1)")
    a = ap.parse_args(argv)
    shapes = LM_HEAD if a.lm_head else SHAPES
    layers = 1 if a.lm_head else a.layers
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.05 for _ in range(layers) for k, n in shapes]
    nweights = sum(w.numel() for w in weights)
    mib = nweights * 4 / 2**20
    inputs = {m: [torch.randn(m, k) for k, _ in shapes] * (4 // len(shapes)) for m in a.rows}
    fns = {(v, m): build(v, weights, m) for v in a.variants for m in a.rows}
    with torch.no_grad():
        for (v, m), fn in fns.items():
            ref = [inputs[m][j % 4] @ w.t() for j, w in enumerate(weights)]
            err = max((x.float() - y).abs().max().item() for x, y in zip(fn(inputs[m]), ref))
            assert err < (0.1 if v.startswith("bf16") else 1e-3), (v, m, err)
        best: dict[tuple[str, int], float] = {}
        for _ in range(a.repeats):
            for (v, m), fn in fns.items():
                t = time.perf_counter()
                fn(inputs[m])
                dt = time.perf_counter() - t
                best[v, m] = min(best.get((v, m), dt), dt)
    what = "the lm_head" if a.lm_head else f"{layers} layers' projections"
    print(f"{what}, {mib:.0f} MiB fp32 (half in bf16), {a.threads} thread(s); best of {a.repeats}, "
          "ms (ratio to the variant's M=1) GB/s of weight bytes")
    print("variant       " + "".join(f"M={m:<22}" for m in a.rows))
    for v in a.variants:
        base = best[v, a.rows[0]]
        nbytes = nweights * (2 if v.startswith("bf16") else 4)
        print(f"{v:<13} " + "".join(f"{best[v, m] * 1e3:6.1f} ({best[v, m] / base:4.2f}x) {nbytes / best[v, m] / 1e9:5.1f}  "
                                    for m in a.rows))


if __name__ == "__main__":
    main()
