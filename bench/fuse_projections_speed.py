"""Speed of AOTInductor-compiled VerifyProgram under the GEMM-layout passes.

Variants (``--variants``, default all): ``baseline`` (no pass), ``fused``
(:func:`~specc.passes.fuse_projections.fuse_projections`), ``pretranspose``
(:func:`~specc.passes.pretranspose_weights.pretranspose_weights`, default
``shared="embedding"``: the tied embedding / lm_head tensor is stored once, transposed),
``pretranspose_copy`` (``shared="copy"``: lm_head gets a transposed copy, the embedding
keeps the original), ``pretranspose_skip`` (``shared="skip"``: the tied tensor is left
untransposed, lm_head stays an NT GEMM), ``pretranspose+fused`` (fuse, then
pretranspose) and ``small_m+fused`` (fuse, then
:func:`~specc.passes.small_m_linear.small_m_linears`).

On the real SmolLM2-135M (fp32, 30 layers, tied embeddings), batch ``--batch`` (default
1), a KV cache of max_model_len 1024, ONE torch thread: for each T in ``--tokens``
(default 1 and 5, i.e. ``decode[1]`` and a 4-draft ``spec_step[1]``) the program is
exported flat (attending over the whole cache; with ``--kv-len N`` as
``specc.compiler`` builds it, kv_len symbolic, and run with ``key_positions =
arange(N)``), transformed, and compiled with AOTInductor the way specc packages
programs (constants not in the .so, bound at load with ``user_managed=True``). The
variants are then timed interleaved (the order rotates every round, so drift on a
shared machine hits all alike): each sample is the mean of ``--inner`` calls; the table
shows the median (and p10/p90) of ``--repeats`` samples in ms per call, the min, the
speed-up baseline/variant of the medians, and "paired" = the median over rounds of the
ratio baseline/variant within one round (robust to a machine shared with other jobs),
after ``--warmup`` calls of each.

Also checks that every variant agrees with the baseline (max |dlogits|) and reports the
size of each variant's constants.

Usage: python bench/fuse_projections_speed.py [--tokens 1 5] [--batch 1] [--kv-len 0]
    [--repeats 60] [--inner 3] [--variants baseline pretranspose ...]
One AOTInductor compile of the real model per variant and T (~50 s each on a 2-core box).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specc.models.kv_cache import KVCache
from specc.models.loader import load_model
from specc.passes.fuse_projections import fuse_projections
from specc.passes.pretranspose_weights import pretranspose_weights
from specc.passes.small_m_linear import small_m_linears
from specc.passes.signature import export_flat
from specc.runtime.programs import VerifyProgram, flat_kv


def _pretranspose(shared: str):
    return lambda gm: f"{pretranspose_weights(gm, shared=shared)} linears pretransposed"


def _fuse_then_pretranspose(gm) -> str:
    groups = fuse_projections(gm)
    return f"{groups} groups fused, {pretranspose_weights(gm)} linears pretransposed"


def _fuse_then_small_m(gm) -> str:
    groups = fuse_projections(gm)
    return f"{groups} groups fused, {small_m_linears(gm)} linears as row reductions"


VARIANTS = {
    "baseline": lambda gm: "untouched",
    "fused": lambda gm: f"{fuse_projections(gm)} groups fused",
    "pretranspose": _pretranspose("embedding"),
    "pretranspose_copy": _pretranspose("copy"),
    "pretranspose_skip": _pretranspose("skip"),
    "pretranspose+fused": _fuse_then_pretranspose,
    "small_m+fused": _fuse_then_small_m,
}


def compile_variant(model, cfg, max_model_len: int, b: int, T: int, variant: str, workdir: Path,
                    kv_len: int = 0):
    """(runner, args, note, constants_mb, compile_s): the AOTI-compiled VerifyProgram[b, T]
    (kv_len > 0: with a symbolic kv_len, called with that many keys)."""
    cache = KVCache.for_model(cfg, b, max_model_len)
    kv = flat_kv(cache)
    ids = torch.randint(0, cfg.vocab_size, (b, T), generator=torch.Generator().manual_seed(T))
    pos = (torch.arange(T) + 100)[None].repeat(b, 1)
    if kv_len:
        keys = torch.arange(kv_len)
        dim = torch.export.Dim("kv_len", min=2, max=max_model_len)
        no_kv = (None,) * len(kv)
        gm = export_flat(VerifyProgram(model, max_model_len), (ids, pos, kv, keys),
                         (None, None, no_kv, {0: dim}))
        args, dyn = (ids, pos, *kv, keys), (None, None, *no_kv, {0: dim})
    else:
        gm = export_flat(VerifyProgram(model, max_model_len), (ids, pos, kv))
        args, dyn = (ids, pos, *kv), None
    note = VARIANTS[variant](gm)
    t0 = time.perf_counter()
    ep = torch.export.export(gm, args, dynamic_shapes=dyn, strict=False)
    tag = variant.replace("+", "_")
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(workdir / f"verify_b{b}_T{T}_{tag}.pt2"),
        inductor_configs={"aot_inductor.package_constants_in_so": False})
    runner = torch._inductor.aoti_load_package(path)
    consts = {**dict(gm.named_parameters(remove_duplicate=False)),
              **dict(gm.named_buffers(remove_duplicate=False))}
    bound = {f: consts[f] for f in runner.get_constant_fqns()}
    runner.load_constants(bound, check_full_update=True, user_managed=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in bound.values()}
    return runner, args, note, sum(storages.values()) / 2**20, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-len", type=int, default=0, help="0: attend over the whole cache (static)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    names = ["baseline"] + [v for v in a.variants if v != "baseline"]
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    lm = load_model(a.spec)
    model, cfg = lm.model, lm.config
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for T in a.tokens:
            variants, sizes = {}, {}
            for v in names:
                runner, args, note, mb, secs = compile_variant(model, cfg, a.max_model_len, a.batch, T, v,
                                                               Path(tmp), a.kv_len)
                variants[v], sizes[v] = (runner, args), mb
                print(f"T={T} {v}: {note}; constants {mb:.0f} MiB; export+compile+load {secs:.0f} s",
                      flush=True)
            outs = {v: r(*args)[0].clone() for v, (r, args) in variants.items()}
            diffs = {v: (outs[v] - outs["baseline"]).abs().max().item() for v in names}
            for r, args in variants.values():
                for _ in range(a.warmup):
                    r(*args)
            samples = {v: [] for v in names}
            for i in range(a.repeats):
                k = i % len(names)
                for v in names[k:] + names[:k]:  # rotate the order every round
                    r, args = variants[v]
                    t0 = time.perf_counter()
                    for _ in range(a.inner):
                        r(*args)
                    samples[v].append((time.perf_counter() - t0) * 1e3 / a.inner)
            rows.append((T, samples, diffs, sizes))
            del variants, outs

    def q(xs, p):
        return statistics.quantiles(xs, n=10)[p] if len(xs) > 1 else xs[0]

    print(f"\nSmolLM2-135M VerifyProgram, AOTInductor, b={a.batch}, max_model_len={a.max_model_len}, "
          f"kv_len={a.kv_len or 'whole cache (static)'}, "
          f"{a.threads} thread(s); ms per call: median [p10, p90] and min of {a.repeats} samples "
          f"x {a.inner} calls, interleaved; speed-up = baseline / variant (medians); paired = "
          f"median over rounds of baseline / variant within the round")
    print(f"{'T':>3}  {'variant':<20} {'median [p10, p90]':>24}  {'min':>6}  {'speed-up':>8}  "
          f"{'paired':>7}  {'max|dlogits|':>12}  {'consts MiB':>10}")
    for T, s, diffs, sizes in rows:
        mb = statistics.median(s["baseline"])
        for v in names:
            m = statistics.median(s[v])
            paired = statistics.median(b / x for b, x in zip(s["baseline"], s[v]))
            cell = f"{m:7.2f} [{q(s[v], 0):6.2f}, {q(s[v], 8):6.2f}]"
            print(f"{T:>3}  {v:<20} {cell:>24}  {min(s[v]):6.2f}  {mb / m:7.3f}x  {paired:6.3f}x  "
                  f"{diffs[v]:12.2e}  {sizes[v]:10.0f}")


if __name__ == "__main__":
    main()
