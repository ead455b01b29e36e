"""The ``specc`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEMO_PROMPT = "Explain in three sentences why the sky is blue."


def main(argv: list[str] | None = None) -> int:
    from specc.compiler import LINEAR_PASSES  # imports torch: the parser needs the lowering names

    parser = argparse.ArgumentParser(
        prog="specc",
        description="specc: compiler-first speculative decoding for LLMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    c = sub.add_parser(
        "compile", help="build every program for every batch bucket into an artifact folder",
        description="Traces the target with torch.export, runs specc's FX passes and lowers each program "
        "(prefill, decode, spec_step per batch bucket) with AOTInductor into DIR (written atomically). "
        "Open it with `specc generate DIR` or Session(DIR). See docs/compile.md.",
    )
    c.add_argument("config", help="model.yaml (see examples/)")
    c.add_argument("-o", "--output", required=True, metavar="DIR", help="artifact folder (an earlier artifact is replaced)")
    c.add_argument("--threads", type=int, metavar="N", help="torch CPU threads while compiling")
    c.add_argument("--linear-passes", default="auto", choices=("auto", *LINEAR_PASSES),
                   help="how linear layers are lowered (default auto: specc's few-row kernel on CPUs "
                   "that build it, MKL/oneDNN GEMMs elsewhere; docs/compile.md)")
    c.set_defaults(func=_compile)
    g = sub.add_parser("generate", help="generate text from a model.yaml or an artifact (streams to the terminal)")
    g.add_argument("config", help="model.yaml (see examples/) or an artifact folder from `specc compile`")
    g.add_argument("--enforce-eager", action="store_true", help="run the eager reference path (no compilation)")
    g.add_argument("--prompt", action="append", help=f"prompt text; repeat for a batch (default: {DEMO_PROMPT!r})")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompts")
    g.add_argument("--max-tokens", type=int, help="override sampling.max_tokens")
    g.add_argument("--temperature", type=float, help="override sampling.temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, help="override sampling.top_p")
    g.add_argument("--top-k", type=int, help="override sampling.top_k")
    g.add_argument("--seed", type=int, help="per-request seed")
    g.add_argument("--json", action="store_true", help="print one JSON object per request instead of text")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's); 1 avoids thread oversubscription on a busy machine")
    g.add_argument(
        "--no-baseline", action="store_true",
        help="with speculation: skip the non-speculative run used to report the speed-up",
    )
    g.set_defaults(func=_generate)
    _add_perf_commands(sub)
    _add_extract_command(sub)
    _add_train_command(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError; OSError: files, folders
        print(f"specc: error: {e}", file=sys.stderr)
        return 2


def _open_session(config: str, enforce_eager: bool):
    """Session on a yaml or an artifact folder; ``enforce_eager`` overrides the yaml."""
    from specc import Session
    from specc.config import load_config

    if enforce_eager:
        if Path(config).is_dir():
            raise ValueError(f"--enforce-eager: {config} is a folder; the eager path runs from a model.yaml "
                             "(an artifact folder always runs compiled)")
        return Session(load_config(config, overrides={"enforce_eager": True}))
    return Session(config)


def _compile(args) -> int:
    from specc.compiler import compile_artifact

    _set_threads(args.threads)
    t0 = time.perf_counter()
    out = compile_artifact(args.config, args.output, linear_passes=args.linear_passes)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"specc: wrote {out} ({size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f}s; "
          f"run it: specc generate {args.output} --prompt ...")
    return 0


def _set_threads(n: int | None) -> None:
    if n is not None:
        import torch

        if n < 1:
            raise ValueError(f"--threads {n}: must be >= 1")
        torch.set_num_threads(n)


def _generate(args) -> int:
    from specc import SamplingParams

    _set_threads(args.threads)
    session = _open_session(args.config, args.enforce_eager)
    overrides = {
        k: v
        for k, v in dict(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed,
        ).items()
        if v is not None
    }
    params = SamplingParams.from_defaults(session.config.sampling, **overrides)
    prompts = args.prompt or [DEMO_PROMPT]
    streaming = not args.json and len(prompts) == 1
    on_text = (lambda i, t: (sys.stdout.write(t), sys.stdout.flush())) if streaming else None

    t0 = time.perf_counter()
    outputs = session.generate(prompts, params, chat=args.chat, on_text=on_text)
    spec_time = time.perf_counter() - t0
    baseline = None
    ran = any(o.finish_reason != "error" for o in outputs)  # no speed-up to report when every request failed
    if session.proposer is not None and not args.no_baseline and ran:
        t0 = time.perf_counter()
        base_out = session.generate(prompts, params, chat=args.chat, use_speculation=False)
        base_time = time.perf_counter() - t0
        n_spec = sum(len(o.token_ids) for o in outputs)
        n_base = sum(len(o.token_ids) for o in base_out)
        baseline = {
            "baseline_tokens_per_second": n_base / base_time,
            "speculative_tokens_per_second": n_spec / spec_time,
            "speedup": (n_spec / spec_time) / (n_base / base_time) if n_base else 0.0,
            "outputs_equal": [a.token_ids == b.token_ids for a, b in zip(outputs, base_out)],
        }

    if args.json:
        for o in outputs:
            d = o.to_dict()
            if baseline is not None:
                d["baseline"] = baseline
            print(json.dumps(d))
        return 0 if all(o.finish_reason != "error" for o in outputs) else 1

    for i, o in enumerate(outputs):
        if o.error:
            print(f"[request {i}] error: {o.error}", file=sys.stderr)
            continue
        if not streaming:
            print(f"--- request {i} ---\n{o.text}")
        m = o.metrics
        print(
            f"\n[{o.finish_reason}] {m.num_generation_tokens} tokens, "
            f"TTFT {m.time_to_first_token * 1000:.0f} ms, {m.tokens_per_second:.1f} tok/s"
        )
    if session.proposer is not None and ran:
        s = session.metrics
        print(
            f"speculative: method {session.config.speculative_config.method}, "
            f"drafts {s.num_drafts}, draft tokens {s.num_draft_tokens}, accepted {s.num_accepted_tokens}, "
            f"acceptance rate {s.acceptance_rate:.2f}, mean acceptance length {s.mean_acceptance_length:.2f}"
        )
        if baseline is not None:
            same = "identical" if all(baseline["outputs_equal"]) else "DIFFERENT"
            same = same if params.is_greedy else "sampled, not compared"
            print(
                f"speed-up over non-speculative decoding (same run): {baseline['speedup']:.2f}x "
                f"({baseline['speculative_tokens_per_second']:.1f} vs "
                f"{baseline['baseline_tokens_per_second']:.1f} tok/s; outputs {same})"
            )
    return 0 if all(o.finish_reason != "error" for o in outputs) else 1


# -- performance sessions: specc bench / specc profile (docs/bench.md) ---------------------
QUICK_MAX_TOKENS = 64
QUICK_MIN_PROMPTS = 4


def _add_perf_commands(sub) -> None:
    b = sub.add_parser(
        "bench", help="speed-up of speculative over non-speculative decoding (Spec-Bench table)",
        description="Runs the config with and without speculation on the same prompts (greedy, batch 1, "
        "interleaved, after a warm-up) and prints Spec-Bench's table: speed-up and mean accepted tokens per "
        "category, greedy-equality check, memory. See docs/bench.md.",
    )
    _dataset_args(b, required=True)
    b.add_argument("--max-tokens", type=int, metavar="N", help="new tokens per prompt (default: the config's sampling.max_tokens)")
    b.add_argument(
        "--baselines", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=[],
        metavar="hf,hf-prompt-lookup,hf-assisted", help="also time transformers' generate on the same prompts",
    )
    b.add_argument("--json", metavar="OUT", help="write the summary and every run to this JSON file")
    b.add_argument("--quick", action="store_true",
                   help=f"one prompt per category (at least {QUICK_MIN_PROMPTS}), {QUICK_MAX_TOKENS} tokens each")
    b.set_defaults(func=_bench)

    p = sub.add_parser(
        "profile", help="time per stage (torch.profiler trace), plots, predicted vs measured speed-up",
        description="A short benchmark, then a traced pass: per-stage times, a Chrome/Perfetto trace, PNG "
        "plots and the speed-up Leviathan et al.'s formula predicts from the measured acceptance and costs. "
        "See docs/bench.md.",
    )
    _dataset_args(p, required=True)
    p.add_argument("--max-tokens", type=int, default=QUICK_MAX_TOKENS, metavar="N", help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--out", default="specc-profile", metavar="DIR", help="folder for traces, plots, profile.json (default: %(default)s)")
    p.add_argument("--traced-prompts", type=int, default=2, metavar="N", help="prompts run under the profiler (default: %(default)s)")
    p.set_defaults(func=_profile, quick=True)


def _dataset_args(p, required: bool) -> None:
    p.add_argument("config", help="model.yaml (see examples/) or an artifact folder from `specc compile`")
    p.add_argument("--enforce-eager", action="store_true", help="run the eager reference path (no compilation)")
    p.add_argument("--dataset", required=required, metavar="spec_bench|mt_bench|humaneval|FILE.jsonl",
                   help="prompt set (docs/bench.md: JSONL fields)")
    p.add_argument("--dataset-path", metavar="FILE.jsonl", help="the question.jsonl for --dataset spec_bench / mt_bench")
    p.add_argument("--categories", nargs="+", metavar="CAT", help="only these categories")
    p.add_argument("--num-prompts", type=int, metavar="N",
                   help="prompts in all, taken round-robin over the categories (default: all; profile: one per category)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: yes, except for humaneval)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's); 1 avoids thread oversubscription on a busy machine")


def _load_bench_inputs(args):
    from specc.datasets import load_dataset, select

    # argument checks before the model loads
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    if getattr(args, "baselines", None):
        from specc.hf_baselines import NAMES

        unknown = [n for n in args.baselines if n not in NAMES]
        if unknown:
            raise ValueError(f"--baselines: unknown {', '.join(unknown)} (choose from {', '.join(NAMES)})")
    json_out = getattr(args, "json", None)  # bench: written at the end, so check its folder now
    if json_out and not (folder := Path(json_out).expanduser().absolute().parent).is_dir():
        raise ValueError(f"--json {json_out}: the folder {folder} does not exist")
    out_dir = getattr(args, "out", None)  # profile
    if out_dir is not None and Path(out_dir).expanduser().exists() and not Path(out_dir).expanduser().is_dir():
        raise ValueError(f"--out {out_dir}: is a file; give a folder for the traces, plots and profile.json")
    if getattr(args, "traced_prompts", 1) < 1:
        raise ValueError(f"--traced-prompts {args.traced_prompts}: must be >= 1")
    ds = load_dataset(args.dataset, args.dataset_path, categories=args.categories,
                      num_prompts=args.num_prompts, chat=args.chat)
    if args.quick and args.num_prompts is None:
        ds.prompts = select(ds.prompts, None, max(len(ds.categories), QUICK_MIN_PROMPTS))
    _set_threads(args.threads)
    session = _open_session(args.config, args.enforce_eager)
    if args.max_tokens is not None:
        max_tokens = args.max_tokens
    else:
        max_tokens = QUICK_MAX_TOKENS if args.quick else session.config.sampling.max_tokens
    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}: must be >= 1")
    return session, ds, max_tokens


def _bench(args) -> int:
    from specc.bench import format_report, run_bench, summarize, to_json

    session, ds, max_tokens = _load_bench_inputs(args)
    result = run_bench(session, ds, max_tokens=max_tokens, baselines=args.baselines)
    summary = summarize(result)
    print(format_report(summary))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(to_json(result, summary), f, indent=2)
        print(f"wrote {args.json}")
    spec = summary["methods"].get("spec")
    return 1 if spec and spec["overall"].get("mismatches") else 0


def _profile(args) -> int:
    from specc.profile import format_profile, run_profile

    session, ds, max_tokens = _load_bench_inputs(args)
    summary = run_profile(session, ds, max_tokens=max_tokens, out_dir=args.out, num_traced=args.traced_prompts)
    print(format_profile(summary))
    return 0


# -- specc extract: hidden states for training drafters (docs/speculative.md) -----------------
def _add_extract_command(sub) -> None:
    e = sub.add_parser(
        "extract", help="save target hidden states of chosen layers for prompts + greedy outputs (EAGLE data)",
        description="Runs the target (eager, greedy, no drafter) on each prompt, then records the hidden states "
        "of --layers for prompt + output tokens into safetensors shards in DIR (written atomically) with an "
        "index.json. See docs/speculative.md, 'specc extract'.",
    )
    e.add_argument("config", help="model.yaml (its target is used; speculative_config is ignored)")
    e.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                   help='JSON lines with a "prompt" string or a "turns" list (first turn used)')
    e.add_argument("--layers", required=True, type=_int_list, metavar="2,15,27",
                   help="hidden-state indices: 0 = embeddings, i = output of decoder layer i-1 (before the final norm)")
    e.add_argument("--out", required=True, metavar="DIR", help="output folder (an earlier extract is replaced)")
    e.add_argument("--max-tokens", type=int, metavar="N",
                   help="new tokens per prompt (default: the config's sampling.max_tokens; 0 = prompts only)")
    e.add_argument("--num-prompts", type=int, metavar="N", help="only the first N prompts (round-robin over categories)")
    e.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help='apply the chat template (default: yes, unless a line says "chat": false)')
    e.add_argument("--tokens-per-shard", type=int, default=8192, metavar="N", help="tokens per shard file (default: %(default)s)")
    e.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    e.set_defaults(func=_extract)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 2,15,27") from None


def _extract(args) -> int:
    from specc.datasets import read_jsonl, select
    from specc.extract import extract_hidden_states

    prompts = select(read_jsonl(args.prompts), None, args.num_prompts)
    if args.chat is not None:
        for p in prompts:
            p.chat = args.chat
    _set_threads(args.threads)
    out = extract_hidden_states(args.config, prompts, args.layers, args.out, max_tokens=args.max_tokens,
                                tokens_per_shard=args.tokens_per_shard)
    index = json.loads((out / "index.json").read_text())
    print(f"specc: wrote {out}: {index['num_sequences']} sequences, {index['num_tokens']} tokens, "
          f"layers {index['layers']}, {len(index['shards'])} shard(s)")
    return 0


# -- specc train: EAGLE / EAGLE-3 heads by self-distillation (docs/speculative.md) -------------
def _add_train_command(sub) -> None:
    from specc.train import DEFAULT_OUT, TrainSettings

    d = TrainSettings()
    t = sub.add_parser(
        "train", help="train an EAGLE / EAGLE-3 draft head on the target's own answers (self-distillation)",
        description="Makes training prompts (the target writes its own questions, or --prompts FILE), filtered "
        "against --exclude evaluation sets; records the target's greedy answers and hidden states in DIR/data; "
        "trains the head with resumable checkpoints; writes the head (config.json + model.safetensors), "
        "metrics.jsonl and loss.png into DIR. See docs/speculative.md, 'Training a head'.",
    )
    t.add_argument("--method", choices=["eagle", "eagle3"], default=d.method, help="head kind (default: %(default)s)")
    t.add_argument("--target", required=True, metavar="CONFIG", help="model.yaml of the target (speculative_config ignored)")
    t.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help="output folder, empty unless --resume (default: %(default)s, what examples/smollm2-eagle.yaml reads)")
    t.add_argument("--prompts", default=d.prompts, metavar="self|FILE.jsonl",
                   help='training prompts: "self" = the target writes its own questions (default), or JSON lines '
                   'with a "prompt" string or "turns" list')
    t.add_argument("--exclude", action="append", default=[], metavar="FILE.jsonl",
                   help="evaluation prompts the training prompts must not overlap (repeatable), e.g. Spec-Bench's "
                   "question.jsonl")
    t.add_argument("--num-prompts", type=int, default=d.num_prompts, metavar="N", help="training prompts (default: %(default)s)")
    t.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help="greedy answer tokens per prompt (default: %(default)s)")
    t.add_argument("--epochs", type=int, default=d.epochs, metavar="N", help="passes over the data (default: %(default)s)")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    t.add_argument("--batch-size", type=int, default=d.batch_size, metavar="N", help="sequences per step (default: %(default)s)")
    t.add_argument("--max-steps", type=int, metavar="N", help="stop after N steps in all (smoke runs; the schedule still spans --epochs)")
    t.add_argument("--warmup-steps", type=int, metavar="N", help="linear warm-up steps (default: 3%% of the schedule)")
    t.add_argument("--seed", type=int, default=d.seed, help="seed of prompts, initial weights, order, noise (default: %(default)s)")
    t.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size, metavar="N",
                   help="EAGLE-3 draft vocabulary (most frequent answer tokens; default: %(default)s)")
    t.add_argument("--layer-ids", type=_int_list, metavar="2,15,27", help="EAGLE-3 target layers (default: 2, L//2, L-3)")
    t.add_argument("--save-every", type=int, default=d.save_every, metavar="N", help="checkpoint every N steps (default: %(default)s)")
    t.add_argument("--resume", action="store_true", help="continue in DIR: reuse its data and its newest checkpoint")
    t.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=_train)


def _train(args) -> int:
    from specc.train import TrainSettings, train

    settings = TrainSettings(
        method=args.method, prompts=args.prompts, exclude=list(args.exclude), num_prompts=args.num_prompts,
        max_tokens=args.max_tokens, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
        max_steps=args.max_steps, warmup_steps=args.warmup_steps, seed=args.seed,
        draft_vocab_size=args.draft_vocab_size, layer_ids=args.layer_ids, save_every=args.save_every)
    if not args.exclude:
        print("specc: note: no --exclude: the training prompts are not checked against any evaluation set "
              "(give the benchmark's question.jsonl to keep its numbers honest)", file=sys.stderr)
    _set_threads(args.threads)
    result = train(args.target, args.out, settings, resume=args.resume, progress=not args.no_progress)
    final = result["final"] or {}
    print(f"specc: wrote {result['head']} ({settings.method} head) after {result['steps']}/{result['total_steps']} "
          f"steps; loss {final.get('loss', float('nan')):.4f}, top-1 agreement {final.get('acc', float('nan')):.2f}; "
          f"metrics.jsonl, loss.png, checkpoints/ beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
