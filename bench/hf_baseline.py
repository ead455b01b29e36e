"""specc eager decoding vs transformers ``generate`` on the real SmolLM2-135M (fp32).

Same chat prompt(s), greedy, the same number of new tokens for every system:

* ``specc``: :class:`specc.Session` with ``examples/smollm2.yaml`` (no speculation);
* ``HF generate``: ``AutoModelForCausalLM`` on the same converted HF folder,
  ``do_sample=False``, fed specc's prompt ids, ``max_new_tokens`` = specc's output
  length and ``min_new_tokens`` too (one less when specc stopped on an end token, so
  that end token may still come last), so both generate the same count;
* ``specc ngram`` / ``specc early-exit``: ``examples/smollm2-ngram.yaml`` and
  ``examples/smollm2-early-exit.yaml`` (speculative; lossless, so greedy ids must match).

Everything runs in one process, after a warm-up, interleaved (the order rotates every
repeat), one prompt at a time (batch 1); each row's tokens/s is the median over the
repeats of (tokens generated over all prompts / wall time). On a shared, noisy CPU only
the ratios measured within one run mean much. Torch runs with ``--threads`` (default 1):
on an oversubscribed machine 2+ intra-op threads spin against other processes and run
up to 10x slower, erratically.

Repeats stop early once ``--budget-s`` seconds of measurement have passed (at least one
repeat always runs), so the script fits a fixed time slot on a slow machine.

Usage: python bench/hf_baseline.py [--repeats 5] [--budget-s 120] [--max-tokens 128]
       [--prompts 2] [--threads 1] [--json OUT]
Exit status 1 if some greedy output differs from specc's non-speculative one.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TARGET = "smollm2-135m-instruct"
PROMPTS = [
    "Summarize in two sentences: The James Webb Space Telescope is a space telescope designed "
    "to conduct infrared astronomy. Its high-resolution instruments let it view objects too "
    "old, distant, or faint for the Hubble Space Telescope.",
    "Explain in simple words how a bicycle works.",
]
SPEC_CONFIGS = {
    "specc ngram": ROOT / "examples" / "smollm2-ngram.yaml",
    "specc early-exit": ROOT / "examples" / "smollm2-early-exit.yaml",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop repeating after this many seconds")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    import transformers

    from specc import SamplingParams, Session
    from specc.models.loader import resolve_hf_folder

    t0 = time.perf_counter()
    plain = Session(ROOT / "examples" / "smollm2.yaml", verbose=False)
    assert plain.config.target == TARGET and plain.config.dtype == "float32"
    spec_sessions = {name: Session(path, verbose=False) for name, path in SPEC_CONFIGS.items()}
    folder = resolve_hf_folder(TARGET)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = plain.tokenizer
    print(f"loaded in {time.perf_counter() - t0:.1f}s; model {TARGET} ({folder}), fp32, torch "
          f"{torch.__version__}, transformers {transformers.__version__}, "
          f"threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}")

    convs = [[{"role": "user", "content": p}] for p in PROMPTS[: args.prompts]]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompt_ids = [plain.tokenize(c) for c in convs]

    def run_specc(session, i, use_speculation=True):
        t = time.perf_counter()
        (out,) = session.generate([prompt_ids[i]], greedy, use_speculation=use_speculation)
        return time.perf_counter() - t, out

    # reference run: specc's output length per prompt fixes everyone's token count
    ref = [run_specc(plain, i)[1] for i in range(len(convs))]
    counts = [len(o.token_ids) for o in ref]
    stopped_on_eos = [o.finish_reason == "stop" for o in ref]

    @torch.no_grad()
    def run_hf(i):
        ids = torch.tensor([prompt_ids[i]])
        n = counts[i]
        t = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n - 1 if stopped_on_eos[i] else n,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        return time.perf_counter() - t, out[0, len(prompt_ids[i]):].tolist()

    systems = {
        "specc": lambda i: run_specc(plain, i),
        "HF generate": run_hf,
        **{name: (lambda i, s=s: run_specc(s, i)) for name, s in spec_sessions.items()},
    }

    # warm-up: a short generation per system (first calls allocate and fill caches);
    # specc's reference run above already warmed the plain session
    short = SamplingParams(temperature=0.0, max_tokens=12)
    for s in spec_sessions.values():
        s.generate([prompt_ids[0]], short)
    with torch.no_grad():
        w = torch.tensor([prompt_ids[0]])
        hf.generate(w, attention_mask=torch.ones_like(w), do_sample=False, max_new_tokens=12,
                    pad_token_id=tok.eos_token_id)

    times: dict[str, list[float]] = {name: [] for name in systems}  # per repeat, all prompts
    tokens: dict[str, list[int]] = {name: [] for name in systems}
    last_ids: dict[str, list[list[int]]] = {}
    acc: dict[str, list[float]] = {name: [] for name in spec_sessions}
    names = list(systems)
    t_bench = time.perf_counter()
    repeats = 0
    for rep in range(args.repeats):
        if rep and time.perf_counter() - t_bench > args.budget_s:
            break
        repeats += 1
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            total_t, total_n, ids_per_prompt, drafts, accepted = 0.0, 0, [], 0, 0
            for i in range(len(convs)):
                dt, out = systems[name](i)
                ids = out if isinstance(out, list) else out.token_ids
                if not isinstance(out, list):
                    drafts += out.metrics.spec.num_drafts
                    accepted += out.metrics.spec.num_accepted_tokens
                total_t += dt
                total_n += len(ids)
                ids_per_prompt.append(ids)
            times[name].append(total_t)
            tokens[name].append(total_n)
            last_ids[name] = ids_per_prompt
            if name in acc:
                acc[name].append(1.0 + accepted / drafts if drafts else 1.0)
    bench_s = time.perf_counter() - t_bench

    tps = {name: [n / t for n, t in zip(tokens[name], times[name])] for name in names}
    med = {name: statistics.median(v) for name, v in tps.items()}
    base_ids = [o.token_ids for o in ref]
    rows = []
    for name in names:
        row = {
            "system": name,
            "tokens_per_second_median": med[name],
            "tokens_per_second_all": tps[name],
            "tokens_per_run": tokens[name][0],
            "vs_hf_generate": med[name] / med["HF generate"],
            "vs_specc": med[name] / med["specc"],
            "ids_equal_specc": last_ids[name] == base_ids,
            "mean_acceptance_length": statistics.mean(acc[name]) if name in acc else None,
        }
        rows.append(row)
    paired = statistics.median(
        (tokens["specc"][r] / times["specc"][r]) / (tokens["HF generate"][r] / times["HF generate"][r])
        for r in range(repeats)
    )

    print(f"\n{len(convs)} chat prompt(s) (prompt tokens {[len(p) for p in prompt_ids]}), greedy, "
          f"new tokens {counts} (max {args.max_tokens}; end token: {stopped_on_eos}), "
          f"{repeats} interleaved repeats after warm-up ({bench_s:.0f}s), threads {torch.get_num_threads()}")
    header = f"| {'system':<17} | {'tok/s (median)':>14} | {'min..max':>13} | {'vs HF generate':>14} | " \
             f"{'vs specc':>8} | {'mean acc. len':>13} | {'ids == specc':>12} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        lo, hi = min(r["tokens_per_second_all"]), max(r["tokens_per_second_all"])
        mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"| {r['system']:<17} | {r['tokens_per_second_median']:>14.1f} | {lo:>6.1f}..{hi:<6.1f}"
              f"| {r['vs_hf_generate']:>13.2f}x | {r['vs_specc']:>7.2f}x | {mal:>13} | "
              f"{str(r['ids_equal_specc']):>12} |")
    hf_same = last_ids["HF generate"] == base_ids
    print(f"specc / HF generate tokens/s: {med['specc'] / med['HF generate']:.2f} (ratio of medians), "
          f"{paired:.2f} (median of per-repeat ratios); greedy token ids identical to HF generate: {hf_same}")
    if not hf_same:
        for i, (a, b) in enumerate(zip(base_ids, last_ids["HF generate"])):
            if a != b:
                j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"  prompt {i}: first difference at token {j} (lengths {len(a)}/{len(b)})")

    if args.json:
        record = {
            "model": TARGET, "dtype": "float32", "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "prompts": [c[0]["content"] for c in convs], "prompt_tokens": [len(p) for p in prompt_ids],
            "new_tokens": counts, "max_tokens": args.max_tokens, "repeats": repeats,
            "specc_over_hf_paired_median": paired, "ids_equal_hf": hf_same, "rows": rows,
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    ok = hf_same and all(r["ids_equal_specc"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
