"""The ``specc`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEMO_PROMPT = "Explain in three sentences why the sky is blue."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specc",
        description="specc: compiler-first speculative decoding for LLMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser("generate", help="generate text from a model.yaml (streams to the terminal)")
    g.add_argument("config", help="model.yaml (see examples/)")
    g.add_argument("--prompt", action="append", help=f"prompt text; repeat for a batch (default: {DEMO_PROMPT!r})")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompts")
    g.add_argument("--max-tokens", type=int, help="override sampling.max_tokens")
    g.add_argument("--temperature", type=float, help="override sampling.temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, help="override sampling.top_p")
    g.add_argument("--top-k", type=int, help="override sampling.top_k")
    g.add_argument("--seed", type=int, help="per-request seed")
    g.add_argument("--json", action="store_true", help="print one JSON object per request instead of text")
    g.add_argument(
        "--no-baseline", action="store_true",
        help="with speculation: skip the non-speculative run used to report the speed-up",
    )
    g.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"specc: error: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from specc import SamplingParams, Session

    session = Session(args.config)
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
    if session.proposer is not None and not args.no_baseline:
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
    if session.proposer is not None:
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


if __name__ == "__main__":
    sys.exit(main())
