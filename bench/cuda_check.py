"""The CUDA path on a GPU, in one command (< 8 minutes on an H200):

    python bench/cuda_check.py --json $OUT/cuda_check.json

Installs nothing and uses whatever torch is installed (a CUDA build is needed; its
``torch.version.cuda`` is printed). Phases, each timed; a failing phase is recorded
(error and traceback tail) and the next one runs:

1. ``triton``: ``pytest -q tests/test_rejection_sampler_triton.py
   tests/test_tree_attention_triton.py`` (the Triton kernels against their torch
   references) and ``tests/test_cuda_graphs.py`` (capture vs direct call);
2. ``tiny``: a tiny random Llama artifact for cuda (buckets 1 and 4, n-gram k = 4):
   greedy tokens compiled (CUDA graphs) vs eager on a few prompts;
3. ``smollm2-<dtype>`` for float32 and bfloat16: the SmolLM2-135M artifact for cuda
   (buckets 1 and 4, n-gram k = 4, max_model_len 1024): compile seconds, greedy equality
   compiled (graphed) vs eager and compiled without graphs (``SPECC_CUDA_GRAPHS=0``),
   replay time of ``decode_b1`` / ``spec_step_b1`` with and without CUDA graphs, and
   tokens/s compiled vs eager with n-gram drafting (batch 1, greedy).

Prints one line per phase and a compact summary; ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Rewrite this sentence three times: the quick brown fox jumps over the lazy dog.",
    "List the numbers from one to twenty in words, separated by commas.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "Summarize: The cat sat on the mat. The cat sat on the mat again. Then the cat slept on the mat.",
]
K, BUCKETS, MAX_MODEL_LEN = 4, [1, 4], 1024
PHASES = ("triton", "tiny", "smollm2-float32", "smollm2-bfloat16")  # in priority order
DEVICE = "cuda"  # "cpu" with --dry-run-cpu: the tiny phase on a CPU, graphs replaced by direct calls


START = time.perf_counter()
DEADLINE_S = 450.0  # no phase starts after this (--deadline): the run fits one 10-minute device call


def _set_globals(deadline_s: float, device: str) -> None:
    global DEADLINE_S, DEVICE
    DEADLINE_S, DEVICE = deadline_s, device


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _phase(results: dict, name: str, fn, *args) -> None:
    if time.perf_counter() - START > DEADLINE_S:
        results[name] = {"ok": True, "skipped": f"past the {DEADLINE_S:.0f} s deadline; rerun with --only {name}",
                         "seconds": 0}
        print(f"[{name}] skipped (deadline)", flush=True)
        return
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn(*args)}
    except Exception as e:  # record and go on: one failing phase must not hide the others
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                         "traceback": traceback.format_exc()[-4000:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"[{name}] {json.dumps({k: v for k, v in results[name].items() if k != 'traceback'})[:1500]}",
          flush=True)


def _pytest() -> dict:
    tests = [t for t in ("tests/test_rejection_sampler_triton.py", "tests/test_tree_attention_triton.py",
                         "tests/test_cuda_graphs.py") if (ROOT / t).exists()]
    # the CPU session test of test_cuda_graphs.py ran on the CPU already: skip its compile here
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-k", "not graphed_session", *tests], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    if p.returncode:
        raise RuntimeError("pytest failed:\n" + "\n".join(tail))
    return {"tests": tests, "summary": tail[-1]}


def _config(target: str, dtype: str) -> dict:
    return dict(target=target, dtype=dtype, device=DEVICE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                batch_buckets=BUCKETS, speculative_config=dict(method="ngram", num_speculative_tokens=K,
                                                               prompt_lookup_min=2, prompt_lookup_max=4))


def _generate(session, prompts, max_tokens, speculation=True):
    from specc import SamplingParams

    _sync()
    t0 = time.perf_counter()
    outs = [session.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             use_speculation=speculation)[0] for p in prompts]
    _sync()
    dt = time.perf_counter() - t0
    tokens = [list(o.token_ids) for o in outs]
    return tokens, sum(map(len, tokens)) / dt


def _replay_ms(programs, session, name: str, graphs: bool, repeats: int = 50) -> float:
    """Median ms of one step program at kv_len 256: graph replay, or a direct runner call."""
    import torch

    from specc.compiler import step_example_inputs
    from specc.runtime.cuda_graphs import GraphedProgram, call_directly, capture_cuda_graph
    from specc.runtime.programs import flat_kv

    prog = next(p for p in [*programs.decode.values(), *programs.spec_step.values()] if p.name == name)
    trash = session.kv_cache.trash_pos
    example = {"input_ids": torch.zeros(prog.batch, prog.tokens, dtype=torch.long),
               "positions": torch.full((prog.batch, prog.tokens), trash),
               **step_example_inputs(prog.batch, prog.tokens - 1, "cpu")}
    kv = tuple(t[:prog.batch] for t in flat_kv(session.kv_cache))
    cuda_graph = graphs and DEVICE == "cuda"
    g = GraphedProgram(prog.runner, prog.inputs, kv, example, [min(256, session.kv_cache.max_model_len)],
                       capture_cuda_graph if cuda_graph else call_directly,
                       torch.cuda.graph_pool_handle() if cuda_graph else None)
    g.capture_all()
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        g(example, 2)
        _sync()
        times.append(time.perf_counter() - t0)
    return round(1e3 * sorted(times)[len(times) // 2], 3)


def _model(target: str, dtype: str, out: Path, max_tokens: int, timing: bool) -> dict:
    from specc import Session
    from specc.compiler import compile_artifact

    cfg = _config(target, dtype)
    t0 = time.perf_counter()
    art = compile_artifact(cfg, out, progress=False)
    compile_s = time.perf_counter() - t0
    manifest = json.loads((art / "manifest.json").read_text())
    t0 = time.perf_counter()
    compiled = Session(str(art), verbose=False)
    open_s = time.perf_counter() - t0  # includes capturing every graph
    eager = Session(dict(cfg, enforce_eager=True), verbose=False)
    r = {"compile_s": round(compile_s, 1), "open_and_capture_s": round(open_s, 2),
         "graphs": len(compiled.engine.graphs.graphs) * len(compiled.engine.graphs.kv_buckets),
         "device_kind": manifest["environment"]["device_kind"],
         "compile_s_per_program": {p["name"]: p["compile_seconds"] for p in manifest["programs"]}}
    _generate(compiled, PROMPTS[:1], 8)  # warm-up (first cuBLAS / allocator use)
    _generate(eager, PROMPTS[:1], 8)
    c_tok, c_tps = _generate(compiled, PROMPTS, max_tokens)
    e_tok, e_tps = _generate(eager, PROMPTS, max_tokens)
    c_base, c_base_tps = _generate(compiled, PROMPTS, max_tokens, speculation=False)
    e_base, e_base_tps = _generate(eager, PROMPTS, max_tokens, speculation=False)
    r["greedy_equal_compiled_vs_eager"] = f"{sum(a == b for a, b in zip(c_tok, e_tok))}/{len(PROMPTS)}"
    r["greedy_equal_spec_vs_nonspec_compiled"] = f"{sum(a == b for a, b in zip(c_tok, c_base))}/{len(PROMPTS)}"
    r["tok_s"] = {"compiled_ngram": round(c_tps, 1), "eager_ngram": round(e_tps, 1),
                  "compiled_nonspec": round(c_base_tps, 1), "eager_nonspec": round(e_base_tps, 1)}
    r["compiled_vs_eager_ngram"] = round(c_tps / e_tps, 2)
    r["compiled_vs_eager_nonspec"] = round(c_base_tps / e_base_tps, 2)
    os.environ["SPECC_CUDA_GRAPHS"] = "0"
    try:
        direct = Session(str(art), verbose=False)
        d_tok, d_tps = _generate(direct, PROMPTS, max_tokens)
    finally:
        os.environ.pop("SPECC_CUDA_GRAPHS")
    r["greedy_equal_graphed_vs_direct"] = f"{sum(a == b for a, b in zip(c_tok, d_tok))}/{len(PROMPTS)}"
    r["tok_s"]["compiled_ngram_no_graphs"] = round(d_tps, 1)
    if timing:
        r["replay_ms"] = {}
        for name in ("decode_b1", "spec_step_b1"):
            with_g = _replay_ms(compiled.programs, compiled, name, True)
            without = _replay_ms(compiled.programs, compiled, name, False)
            r["replay_ms"][name] = {"graph": with_g, "direct": without, "speedup": round(without / with_g, 2)}
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="OUT", help="write every number here")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip", nargs="*", default=[], help="phases to skip: " + " ".join(PHASES))
    ap.add_argument("--only", nargs="*", help="run only these phases")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="seconds after which no further phase starts (recorded as skipped)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="check this script on a CPU: the tiny phase only, CUDA graphs replaced by direct calls")
    args = ap.parse_args(argv)
    _set_globals(args.deadline, "cpu" if args.dry_run_cpu else "cuda")
    if args.dry_run_cpu:
        import specc.runtime.replay as replay

        replay.use_cuda_graphs = lambda device: True  # the graphed path, "replayed" by direct calls
        args.only = ["tiny"]
        run = ["tiny"]
    run = [p for p in PHASES if p not in args.skip and (args.only is None or p in args.only)]

    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    print(f"[env] {env}", flush=True)
    results: dict = {"env": env}
    if not torch.cuda.is_available() and DEVICE == "cuda":
        print("no CUDA device: this script needs a GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="specc-cuda-"))
    if "triton" in run:
        _phase(results, "triton", _pytest)
    if "tiny" in run:
        def tiny() -> dict:
            from transformers import AutoTokenizer

            sys.path.insert(0, str(ROOT / "tests"))
            from helpers import build_tiny_model
            from specc.models.loader import resolve_hf_folder

            tok = AutoTokenizer.from_pretrained(resolve_hf_folder("smollm2-135m-instruct"))
            folder = build_tiny_model("llama", tok, tmp / "tiny_llama")
            return _model(str(folder), "float32", tmp / "tiny_art", 32, timing=DEVICE == "cpu")
        _phase(results, "tiny", tiny)
    for dtype in ("float32", "bfloat16"):
        name = f"smollm2-{dtype}"
        if name in run:
            _phase(results, name, _model, "smollm2-135m-instruct", dtype, tmp / name, args.max_tokens, True)

    print("\n== summary ==")
    for name, r in results.items():
        if name == "env":
            continue
        if "skipped" in r:
            print(f"{name}: {r['skipped']}")
            continue
        if not r["ok"]:
            print(f"{name}: FAILED ({r['seconds']} s): {r['error'][:300]}")
            continue
        keys = ("summary", "compile_s", "open_and_capture_s", "graphs", "greedy_equal_compiled_vs_eager",
                "greedy_equal_graphed_vs_direct", "compiled_vs_eager_ngram", "compiled_vs_eager_nonspec",
                "tok_s", "replay_ms")
        print(f"{name} ({r['seconds']} s): " + "; ".join(f"{k}={r[k]}" for k in keys if k in r))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok", True) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
