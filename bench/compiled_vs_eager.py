"""Compiled programs vs the eager path, in one process: tokens/s and time to first token.

    python bench/compiled_vs_eager.py examples/smollm2-ngram.yaml --artifact build/ \\
        --dataset-path ../shared/data/spec_bench_questions.jsonl --num-prompts 12 --max-tokens 128

Four runs per prompt, interleaved (the order rotates with the prompt so drift on a
shared machine hits every variant alike), greedy, batch 1:

    eager, no speculation | eager, speculative | compiled, no speculation | compiled, speculative

All four must give the same tokens (checked). Reported: mean tokens/s of each (tokens
over the request's wall time, prefill included, as ``specc bench``) and the ratios
compiled / eager (non-spec and spec) and spec / non-spec (eager and compiled); then the
time to first token of a fresh process-level start from the artifact (open + first
token) against compiling from the yaml (the artifact's recorded compile seconds, or a
measured ``compile_artifact`` with ``--compile``). ``--json OUT`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="model.yaml")
    ap.add_argument("--artifact", help="artifact folder from `specc compile` (default: compile into a temp folder)")
    ap.add_argument("--dataset", default="spec_bench", help="spec_bench | mt_bench | FILE.jsonl")
    ap.add_argument("--dataset-path", help="question.jsonl for spec_bench / mt_bench")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    import torch

    from specc import SamplingParams, Session
    from specc.compiler import compile_artifact
    from specc.config import load_config
    from specc.datasets import load_dataset

    torch.set_num_threads(args.threads)
    ds = load_dataset(args.dataset, args.dataset_path, num_prompts=args.num_prompts)
    cfg = load_config(args.config)

    compile_s = None
    art = args.artifact
    if art is None:
        import tempfile

        art = str(Path(tempfile.mkdtemp(prefix="specc-bench-")) / "build")
        t0 = time.perf_counter()
        compile_artifact(cfg, art)
        compile_s = time.perf_counter() - t0
    manifest = json.loads((Path(art) / "manifest.json").read_text())
    per_program = {p["name"]: p["compile_seconds"] for p in manifest["programs"]}
    if compile_s is None:
        compile_s = sum(per_program.values())

    # time to first token from the artifact: open (no tracing, no compiling) + one token
    t0 = time.perf_counter()
    compiled = Session(art, verbose=False)
    open_s = time.perf_counter() - t0
    first = compiled.generate(ds.prompts[0].text, SamplingParams(temperature=0, max_tokens=1), chat=ds.prompts[0].chat)
    ttft_artifact = open_s + first[0].metrics.time_to_first_token
    eager = Session(load_config(args.config, overrides={"enforce_eager": True}), verbose=False)

    variants = [("eager", eager, False), ("eager", eager, True), ("compiled", compiled, False), ("compiled", compiled, True)]
    names = [f"{m}, {'speculative' if s else 'no speculation'}" for m, _, s in variants]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for _, sess, spec in variants:  # warm-up
        sess.generate(ds.prompts[0].text, SamplingParams(temperature=0, max_tokens=8), chat=ds.prompts[0].chat,
                      use_speculation=spec)
    speeds = {n: [] for n in names}
    mismatches = 0
    for i, p in enumerate(ds.prompts):
        order = list(range(4))[i % 4:] + list(range(4))[: i % 4]
        tokens = {}
        for j in order:
            _, sess, spec = variants[j]
            out = sess.generate(p.text, params, chat=p.chat, use_speculation=spec)[0]
            m = out.metrics
            speeds[names[j]].append(len(out.token_ids) / m.total_time)
            tokens[j] = out.token_ids
        mismatches += len({tuple(t) for t in tokens.values()}) != 1
        print(f"[{i + 1}/{len(ds.prompts)}] " + "  ".join(f"{names[j]} {speeds[names[j]][-1]:.1f}" for j in range(4)),
              file=sys.stderr)

    mean = {n: statistics.fmean(v) for n, v in speeds.items()}
    e0, e1, c0, c1 = (mean[n] for n in names)
    report = {
        "tokens_per_second": mean,
        "compiled_over_eager_nonspec": c0 / e0,
        "compiled_over_eager_spec": c1 / e1,
        "spec_over_nonspec_eager": e1 / e0,
        "spec_over_nonspec_compiled": c1 / c0,
        "compiled_spec_over_eager_nonspec": c1 / e0,
        "greedy_mismatches": mismatches,
        "prompts": len(ds.prompts),
        "max_tokens": args.max_tokens,
        "compile_seconds_total": compile_s,
        "compile_seconds_per_program": per_program,
        "open_artifact_seconds": open_s,
        "ttft_from_artifact_seconds": ttft_artifact,
        "ttft_compiling_from_yaml_seconds": compile_s + ttft_artifact,
        "mean_acceptance_length_compiled": compiled.metrics.mean_acceptance_length,
        "mean_acceptance_length_eager": eager.metrics.mean_acceptance_length,
    }
    print(f"\n{len(ds.prompts)} prompts x {args.max_tokens} tokens, greedy, batch 1, {args.threads} thread(s)")
    for n in names:
        print(f"  {n:<28} {mean[n]:7.1f} tok/s")
    print(f"  compiled / eager: no speculation {c0 / e0:.2f}x, speculative {c1 / e1:.2f}x")
    print(f"  speculative / no speculation: eager {e1 / e0:.2f}x, compiled {c1 / c0:.2f}x; "
          f"compiled spec / eager non-spec {c1 / e0:.2f}x")
    print(f"  greedy outputs: {len(ds.prompts) - mismatches}/{len(ds.prompts)} identical across the four runs")
    print(f"  time to first token: from the artifact {ttft_artifact:.2f}s (open {open_s:.2f}s); "
          f"compiling from the yaml {compile_s:.0f}s + that")
    print("  compile seconds per program: " + ", ".join(f"{k} {v:.0f}" for k, v in per_program.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
