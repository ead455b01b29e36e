"""Real-model check of the compiled EAGLE path: SmolLM2-135M-Instruct + an EAGLE head,
compiled with one batch bucket, against the eager path, greedy.

    python bench/eagle_compiled_check.py --artifact /tmp/eagle_art [--head HEAD_DIR]

Without ``--head`` a random "echo" head (``tests/eagle_checkpoints.py``) is written
beside the artifact. Compiles the artifact unless it exists (prints per-program
seconds), opens it, then generates two chat prompts three ways (eager non-speculative,
eager EAGLE, compiled EAGLE, compiled non-speculative): prints whether every output
equals the non-speculative greedy one, the acceptance per position and tokens/s. One
torch thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    from specc import SamplingParams, Session
    from specc.compiler import compile_artifact

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True, help="artifact folder (built if missing)")
    ap.add_argument("--head", type=Path, help="EAGLE head folder (default: a random echo head)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    head = args.head or _echo_head(args.artifact.parent / (args.artifact.name + "-echo-head"))
    cfg = dict(target="smollm2-135m-instruct", max_model_len=512, max_num_seqs=1, batch_buckets=[1],
               speculative_config=dict(method="eagle", model=str(head), num_speculative_tokens=args.k))
    if not (args.artifact / "manifest.json").exists():
        t0 = time.perf_counter()
        compile_artifact(cfg, args.artifact, progress=False)
        print(f"compile: {time.perf_counter() - t0:.0f} s")
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    print("compile seconds:", {p["name"]: p["compile_seconds"] for p in manifest["programs"]})
    t0 = time.perf_counter()
    compiled = Session(str(args.artifact), verbose=False)
    print(f"open: {time.perf_counter() - t0:.1f} s")
    eager = Session({**cfg, "enforce_eager": True}, verbose=False)
    prompts = ["Write a short poem about the sea.", "What is the capital of France? Explain briefly."]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    ref = [o.token_ids for o in eager.generate(prompts, params, chat=True, use_speculation=False)]
    runs = {}
    for name, session, spec in (("eager eagle", eager, True), ("compiled eagle", compiled, True),
                                ("compiled decode", compiled, False)):
        t0 = time.perf_counter()
        outs = session.generate(prompts, params, chat=True, use_speculation=spec)
        runs[name] = (outs, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        print(f"{name}: == non-speculative greedy {[o.token_ids for o in outs] == ref}, "
              f"{runs[name][1]:.1f} tok/s"
              + (f", accepted per position {[o.metrics.spec.accepted_per_position for o in outs]}" if spec else ""))
    return 0 if all([o.token_ids for o in outs] == ref for outs, _ in runs.values()) else 1


def _echo_head(folder: Path) -> Path:
    from transformers import AutoConfig

    from eagle_checkpoints import write_echo_eagle_checkpoint
    from specc.models.llama import ModelConfig
    from specc.models.loader import resolve_hf_folder

    if not (folder / "config.json").exists():
        config = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_hf_folder("smollm2-135m-instruct")))
        write_echo_eagle_checkpoint(folder, config)
    return folder


if __name__ == "__main__":
    sys.exit(main())
