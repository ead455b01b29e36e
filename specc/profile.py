"""``specc profile``: where a speculative step's time goes, and what speed-up the
acceptance rates and measured costs predict, beside the measured one.

1. A short benchmark (:func:`specc.bench.run_bench`, no profiler attached): per-category
   speed-up, acceptance counters and tokens per step.
2. A traced pass over the first few prompts, speculative and non-speculative, under
   ``torch.profiler``: the engine's ``specc.*`` ranges (:mod:`specc.runtime.tracing`)
   give the time per stage; Chrome / Perfetto traces are written to the output folder
   (open in https://ui.perfetto.dev or chrome://tracing). The profiler records every
   aten op, which slows both passes a little; the stage ratios are what matter.
3. The cost model of Leviathan et al. 2023 ("Fast Inference from Transformers via
   Speculative Decoding", eq. 1 and Theorem 3.8): with per-token acceptance rate α and k
   draft tokens, a step yields E = (1 - α^(k+1)) / (1 - α) tokens in expectation, and the
   wall-time speed-up is E / (k·c + 1) where c = the drafter's cost per draft token / a
   target decode step. The paper assumes verifying k+1 tokens costs one decode step; on a
   CPU it costs r = T_verify(k+1) / T_decode > 1 (MKL's matmul with k+1 rows), so specc
   also prints E / (k·c + r), and a variant that counts steps without drafts (n-gram
   lookups that found nothing) at their own cost.
4. PNG plots (matplotlib): acceptance per draft position, tokens-per-step histogram,
   speed-up per category; and ``profile.json`` with every number.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from specc.bench import BASE, SPEC, format_report, run_bench, summarize
from specc.datasets import DISPLAY_NAMES, Dataset
from specc.sampling_params import SamplingParams

STAGES = [  # (key, label)
    ("prefill", "prefill (prompt forward, first token)"),
    ("draft", "draft (proposer)"),
    ("verify", "verify (target forward)"),
    ("accept", "accept/reject (+ read-back)"),
    ("bookkeeping", "bookkeeping, stop checks"),
    ("detokenize", "detokenize"),
    ("step_other", "other host work in steps"),
    ("outside", "outside steps (scheduling, python)"),
]


def run_profile(
    session,
    dataset: Dataset,
    *,
    max_tokens: int,
    out_dir: str | Path,
    num_traced: int = 2,
    progress: bool | None = None,
) -> dict:
    """Benchmark, trace, model and plot (module docstring); returns the summary dict
    also written to ``out_dir/profile.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bench = summarize(run_bench(session, dataset, max_tokens=max_tokens, progress=progress))
    has_spec = session.proposer is not None
    traced = dataset.prompts[:max(1, num_traced)]
    passes = _traced_passes(session, traced, max_tokens, [SPEC, BASE] if has_spec else [BASE], out)
    summary = {"bench": bench, "traced_prompts": [p.id for p in traced], "stages": passes}
    if has_spec:
        summary["cost_model"] = cost_model(bench, passes, session.proposer.num_speculative_tokens)
    summary["plots"] = _plots(bench, out, has_spec, session)
    summary["traces"] = [str(out / f"trace_{m}.json") for m in passes]
    (out / "profile.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


# ---------------------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------------------


def _traced_passes(session, prompts, max_tokens: int, modes: list[str], out: Path) -> dict:
    """Run each prompt in each mode under its own torch.profiler session (modes in
    alternating order per prompt, like the benchmark, so machine drift hits both); sum
    the per-stage times per mode. The first prompt's traces are written as
    ``trace_<mode>.json``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if session.config.device == "cuda" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    from specc.outputs import SpecMetrics

    saved = session.metrics  # generate() adds into session.metrics in place: count into a scratch one
    session.metrics = SpecMetrics()
    totals: dict[str, dict] = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(p.stop) or None)
        for mode in modes if i % 2 == 0 else modes[::-1]:
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                out_ = session.generate([p.text], params, chat=p.chat, use_speculation=(mode == SPEC))[0]
                wall = time.perf_counter() - t0
            if i == 0:
                prof.export_chrome_trace(str(out / f"trace_{mode}.json"))
            st = stage_times(prof.events(), wall, len(out_.token_ids))
            totals[mode] = _add_stages(totals[mode], st) if mode in totals else st
    session.metrics = saved  # traced runs stay out of the session's totals
    return {m: totals[m] for m in modes}


def _add_stages(a: dict, b: dict) -> dict:
    out = {k: a[k] + b[k] for k in ("wall_s", "tokens", "steps", "draft_calls")}
    out["stages_s"] = {k: a["stages_s"][k] + b["stages_s"][k] for k in a["stages_s"]}
    widths = {}
    for src in (a["verify_by_width"], b["verify_by_width"]):
        for w, (n, t) in src.items():
            widths.setdefault(w, [0, 0.0])
            widths[w][0] += n
            widths[w][1] += t
    out["verify_by_width"] = dict(sorted(widths.items()))
    return out


def stage_times(events, wall_s: float, tokens: int) -> dict:
    """Per-stage seconds from the ``specc.*`` ranges of a profiler's events.

    ``verify_by_width[T]`` = ``[count, seconds]`` of target forwards over T tokens per row.
    Nested ranges are split: detokenize is taken out of prefill and bookkeeping; the
    step's uncovered rest is ``step_other``; the wall time outside prefill and steps is
    ``outside``.
    """
    total = dict.fromkeys(["prefill", "step", "draft", "verify", "accept", "bookkeeping", "detokenize"], 0.0)
    count = dict.fromkeys(total, 0)
    detok_in = {"prefill": 0.0, "bookkeeping": 0.0}
    by_width: dict[int, list] = {}
    for e in events:
        name = e.name
        if not name.startswith("specc."):
            continue
        s = (e.time_range.end - e.time_range.start) / 1e6
        key = name[len("specc."):]
        if key.startswith(("verify[", "verify_tree[")):  # a chain's or a token tree's verify
            width = int(key[key.index("[") + 1:-1])
            by_width.setdefault(width, [0, 0.0])
            by_width[width][0] += 1
            by_width[width][1] += s
            key = "verify"
        if key not in total:
            continue
        total[key] += s
        count[key] += 1
        if key == "detokenize":
            parent = e.cpu_parent
            while parent is not None and parent.name not in ("specc.prefill", "specc.bookkeeping"):
                parent = parent.cpu_parent
            if parent is not None:
                detok_in[parent.name[len("specc."):]] += s
    stages = {
        "prefill": total["prefill"] - detok_in["prefill"],
        "draft": total["draft"],
        "verify": total["verify"],
        "accept": total["accept"],
        "bookkeeping": total["bookkeeping"] - detok_in["bookkeeping"],
        "detokenize": total["detokenize"],
        "step_other": total["step"] - total["draft"] - total["verify"] - total["accept"] - total["bookkeeping"],
        "outside": wall_s - total["prefill"] - total["step"],
    }
    return {
        "wall_s": wall_s, "tokens": tokens, "steps": count["step"], "draft_calls": count["draft"],
        "stages_s": stages, "verify_by_width": {w: by_width[w] for w in sorted(by_width)},
    }


# ---------------------------------------------------------------------------------------
# cost model (Leviathan et al. 2023)
# ---------------------------------------------------------------------------------------


def expected_tokens(alpha: float, k: int) -> float:
    """E = (1 - α^(k+1)) / (1 - α): expected tokens per step (Leviathan et al. eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def fit_alpha(mean_acceptance_length: float, k: int) -> float:
    """The α for which :func:`expected_tokens` equals the measured mean acceptance length
    (bisection; E is increasing in α on [0, 1])."""
    target = min(max(mean_acceptance_length, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def cost_model(bench: dict, passes: dict, k: int) -> dict:
    """Predicted speed-ups from the measured acceptance and stage costs.

    * T_decode: mean target forward of the non-speculative pass (1 token per row);
    * r = T_verify(k+1) / T_decode (the widest verify seen if none had k+1 tokens);
    * c = mean draft time per step / (k · T_decode);
    * α fitted so that E(α, k) = the measured mean acceptance length (steps with drafts);
    * f = share of steps that carried drafts.

    Predictions: ``paper`` E / (k·c + 1); ``measured_verify`` E / (k·c + r);
    ``with_empty_steps`` (f·E + 1 − f) / (d + f·r + (1 − f)·r1), d = mean draft time per
    step / T_decode, r1 = a 1-token verify in the speculative pass / T_decode.
    """
    spec, base = passes[SPEC], passes[BASE]
    widths_b = base["verify_by_width"]
    n_dec = sum(v[0] for v in widths_b.values())
    t_decode = sum(v[1] for v in widths_b.values()) / n_dec if n_dec else 0.0
    widths = {int(w): v for w, v in spec["verify_by_width"].items()}
    drafted = {w: v for w, v in widths.items() if w > 1}
    steps = sum(v[0] for v in widths.values())
    if not t_decode or not steps:
        return {"error": "no decode or verify steps were traced"}
    w_full = k + 1 if (k + 1) in drafted else (max(drafted) if drafted else 1)
    t_verify = widths[w_full][1] / widths[w_full][0] if w_full in widths else t_decode
    r = t_verify / t_decode
    r1 = widths[1][1] / widths[1][0] / t_decode if 1 in widths else 1.0
    d = spec["stages_s"]["draft"] / steps / t_decode
    c = d / k
    o = bench["methods"][SPEC]["overall"]
    L = o.get("spec", {}).get("mean_acceptance_length", 1.0)
    f = o.get("draft_step_fraction", 0.0)
    alpha = fit_alpha(L, k)
    E = expected_tokens(alpha, k)
    base_o = bench["methods"][BASE]["overall"]
    measured_decode = None
    if o.get("decode_tokens_per_second") and base_o.get("decode_tokens_per_second"):
        measured_decode = o["decode_tokens_per_second"] / base_o["decode_tokens_per_second"]
    return {
        "k": k, "alpha": alpha, "mean_acceptance_length": L, "expected_tokens": E,
        "draft_step_fraction": f, "c": c, "d": d, "r": r, "r_width": w_full, "r1": r1,
        "t_decode_ms": t_decode * 1e3, "t_verify_ms": t_verify * 1e3,
        "verify_cost_by_width": {w: (v[1] / v[0]) / t_decode for w, v in sorted(widths.items())},
        "predicted": {
            "paper": E / (k * c + 1),
            "measured_verify": E / (k * c + r),
            "with_empty_steps": (f * E + 1 - f) / (d + f * r + (1 - f) * r1),
        },
        "measured": {"end_to_end": o.get("speedup"), "decode_only": measured_decode},
    }


# ---------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------


def _plots(bench: dict, out: Path, has_spec: bool, session) -> list[str]:
    from matplotlib.figure import Figure

    paths = []
    cats = bench["categories"]
    methods = bench["methods"]
    if has_spec:
        s = methods[SPEC]["overall"].get("spec", {})
        k = session.proposer.num_speculative_tokens
        per_pos = s.get("accepted_per_position") or [0] * k
        drafts = s.get("num_drafts", 0)
        rates = [a / drafts if drafts else 0.0 for a in per_pos]
        alpha = fit_alpha(s.get("mean_acceptance_length", 1.0), k)
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        xs = list(range(1, len(rates) + 1))
        ax.bar(xs, rates, label="measured: accepted at position i / drafts")
        ax.plot(xs, [alpha**i for i in xs], "o--", color="C1", label=f"i.i.d. model α^i, α={alpha:.2f}")
        ax.set(xlabel="draft position i", ylabel="acceptance", ylim=(0, 1), xticks=xs,
               title=f"Acceptance per draft position ({methods[SPEC]['label']})")
        ax.legend()
        paths.append(_save(fig, out / "acceptance_per_position.png"))

        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        hist = methods[SPEC]["overall"].get("tokens_per_step_hist") or {}
        xs = list(range(1, k + 2))
        counts = [hist.get(x, 0) for x in xs]
        ax.bar(xs, counts)
        nonzero = [c for c in counts if c]
        if nonzero and max(nonzero) > 20 * min(nonzero):
            ax.set_yscale("log")
        ax.set(xlabel="tokens emitted per target forward", ylabel="steps", xticks=xs,
               title=f"Tokens per step (MAT {methods[SPEC]['overall'].get('mean_accepted_tokens', 1):.2f})")
        paths.append(_save(fig, out / "tokens_per_step.png"))

    rows = [(key, m) for key, m in methods.items() if key != BASE and "not_applicable" not in m]
    if rows:
        fig = Figure(figsize=(max(6, 1.3 * (len(cats) + 1)), 4))
        ax = fig.subplots()
        names = [DISPLAY_NAMES.get(c, c) for c in cats] + ["Overall"]
        width = 0.8 / len(rows)
        for j, (key, m) in enumerate(rows):
            vals = [m["categories"][c].get("speedup", 0) for c in cats] + [m["overall"].get("speedup", 0)]
            ax.bar([i + j * width for i in range(len(names))], vals, width, label=m["label"])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(names))], names)
        ax.set(ylabel="speed-up over specc without speculation", title="Speed-up per category")
        ax.legend()
        paths.append(_save(fig, out / "speedup_per_category.png"))
    return paths


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------


def format_profile(summary: dict) -> str:
    """The text ``specc profile`` prints."""
    lines = [format_report(summary["bench"]), ""]
    lines.append(f"Time per stage (traced runs of prompts {', '.join(summary['traced_prompts'])}; "
                 "torch.profiler overhead included)")
    modes = list(summary["stages"])
    head = "".join(f"{'ms (' + m + ')':>16}{'%':>6}" for m in modes)
    lines.append(f"{'stage':<38}{head}")
    for key, label in STAGES:
        cells = ""
        for m in modes:
            st = summary["stages"][m]
            v = st["stages_s"][key]
            cells += f"{v * 1e3:>16.1f}{100 * v / st['wall_s'] if st['wall_s'] else 0:>5.0f}%"
        lines.append(f"{label:<38}{cells}")
    cells = "".join(f"{summary['stages'][m]['wall_s'] * 1e3:>16.1f}{'':>6}" for m in modes)
    lines.append(f"{'total wall':<38}{cells}")
    for m in modes:
        st = summary["stages"][m]
        per = ", ".join(f"{w} tok: {v[0]} x {v[1] / v[0] * 1e3:.1f} ms" for w, v in st["verify_by_width"].items())
        lines.append(f"{m}: {st['tokens']} tokens in {st['steps']} steps; target forwards by width: {per}")
    cm = summary.get("cost_model")
    if cm and "error" not in cm:
        p, meas = cm["predicted"], cm["measured"]
        lines += [
            "",
            "Predicted vs measured speed-up (Leviathan et al. 2023, eq. 1: E = (1 - α^(k+1)) / (1 - α))",
            f"  α = {cm['alpha']:.3f} (fits E = measured mean acceptance length {cm['mean_acceptance_length']:.2f}, k = {cm['k']})",
            f"  c = drafter cost per token / decode step = {cm['c']:.3f};  T_decode = {cm['t_decode_ms']:.1f} ms",
            f"  r = verify({cm['r_width']} tokens) / decode = {cm['r']:.2f}  (by width: "
            + ", ".join(f"{w}: {v:.2f}" for w, v in cm["verify_cost_by_width"].items()) + ")",
            f"  d = draft time per step / decode = {cm['d']:.3f};  r1 = 1-token verify in the speculative runs / decode = {cm['r1']:.2f}",
            f"  predicted, paper (verify = 1 decode step):   E / (k·c + 1) = {p['paper']:.2f}x",
            f"  predicted, measured verify cost:             E / (k·c + r) = {p['measured_verify']:.2f}x",
            f"  predicted, + steps without drafts (f = {cm['draft_step_fraction']:.2f}):  "
            f"(f·E + 1 - f) / (d + f·r + (1 - f)·r1) = {p['with_empty_steps']:.2f}x",
            f"  measured: decode only {_fx(meas['decode_only'])}, end to end (prefill included) {_fx(meas['end_to_end'])}",
        ]
    lines += ["", "wrote: " + ", ".join(summary["traces"] + summary["plots"])]
    return "\n".join(lines)


def _fx(v) -> str:
    return "-" if v is None else f"{v:.2f}x"
