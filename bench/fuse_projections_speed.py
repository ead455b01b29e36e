"""Speed of AOTInductor-compiled VerifyProgram with and without ``fuse_projections``.

On the real SmolLM2-135M (fp32, 30 layers), batch 1, a KV cache of max_model_len 1024,
ONE torch thread: for each T in ``--tokens`` (default 1 and 5, i.e. ``decode[1]`` and a
4-draft ``spec_step[1]``) the program is exported flat, optionally fused, and compiled
with AOTInductor the way specc packages programs (constants not in the .so, bound at
load with ``user_managed=True``). The variants are then timed interleaved (the order
alternates every round, so drift on a shared machine hits both alike): each sample is
the mean of ``--inner`` calls, the table shows the median (and p10/p90) of ``--repeats``
samples in ms per call (and the min, and the median of the per-round ratios
unfused/fused: robust to a machine shared with other jobs), after ``--warmup`` calls
of each.

Also checks that fused and unfused programs agree (max |dlogits|).

Usage: python bench/fuse_projections_speed.py [--tokens 1 5] [--repeats 60] [--inner 3]
Four AOTInductor compiles of the real model (~50 s each on a 2-core box).
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
from specc.passes.signature import export_flat
from specc.runtime.programs import VerifyProgram, flat_kv


def compile_variant(model, cfg, max_model_len: int, T: int, fuse: bool, workdir: Path):
    """(runner, args, n_groups, compile_s): the AOTI-compiled VerifyProgram[b=1, T]."""
    cache = KVCache.for_model(cfg, 1, max_model_len)
    kv = flat_kv(cache)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
    pos = (torch.arange(T) + 100)[None]
    gm = export_flat(VerifyProgram(model, max_model_len), (ids, pos, kv))
    groups = fuse_projections(gm) if fuse else 0
    t0 = time.perf_counter()
    ep = torch.export.export(gm, (ids, pos, *kv), strict=False)
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(workdir / f"verify_T{T}_{'fused' if fuse else 'plain'}.pt2"),
        inductor_configs={"aot_inductor.package_constants_in_so": False})
    runner = torch._inductor.aoti_load_package(path)
    consts = {**dict(gm.named_parameters(remove_duplicate=False)),
              **dict(gm.named_buffers(remove_duplicate=False))}
    runner.load_constants({f: consts[f] for f in runner.get_constant_fqns()},
                          check_full_update=True, user_managed=True)
    return runner, (ids, pos, *kv), groups, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    lm = load_model(a.spec)
    model, cfg = lm.model, lm.config
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for T in a.tokens:
            variants = {}
            for fuse in (False, True):
                runner, args, groups, secs = compile_variant(model, cfg, a.max_model_len, T, fuse, Path(tmp))
                variants[fuse] = (runner, args)
                print(f"T={T} {'fused' if fuse else 'plain'}: {groups} groups fused, "
                      f"export+compile+load {secs:.0f} s", flush=True)
            outs = {f: r(*args)[0].clone() for f, (r, args) in variants.items()}
            diff = (outs[True] - outs[False]).abs().max().item()
            for f, (r, args) in variants.items():
                for _ in range(a.warmup):
                    r(*args)
            samples = {False: [], True: []}
            for i in range(a.repeats):
                for f in ((False, True) if i % 2 == 0 else (True, False)):
                    r, args = variants[f]
                    t0 = time.perf_counter()
                    for _ in range(a.inner):
                        r(*args)
                    samples[f].append((time.perf_counter() - t0) * 1e3 / a.inner)
            rows.append((T, samples, diff))
            del variants

    def q(xs, p):
        return statistics.quantiles(xs, n=10)[p] if len(xs) > 1 else xs[0]

    print(f"\nSmolLM2-135M VerifyProgram, AOTInductor, b=1, max_model_len={a.max_model_len}, "
          f"{a.threads} thread(s); ms per call: median [p10, p90] and min of {a.repeats} "
          f"samples x {a.inner} calls, interleaved; paired = median over rounds of "
          f"unfused/fused from adjacent samples")
    print(f"{'T':>3}  {'unfused':>22}  {'min':>6}  {'fused':>22}  {'min':>6}  "
          f"{'speed-up':>8}  {'paired':>7}  {'max|dlogits|':>12}")
    for T, s, diff in rows:
        mu, mf = statistics.median(s[False]), statistics.median(s[True])
        paired = statistics.median(u / f for u, f in zip(s[False], s[True]))
        cell = lambda xs, m: f"{m:7.2f} [{q(xs, 0):6.2f}, {q(xs, 8):6.2f}]"
        print(f"{T:>3}  {cell(s[False], mu):>22}  {min(s[False]):6.2f}  {cell(s[True], mf):>22}  "
              f"{min(s[True]):6.2f}  {mu / mf:7.3f}x  {paired:6.3f}x  {diff:12.2e}")


if __name__ == "__main__":
    main()
