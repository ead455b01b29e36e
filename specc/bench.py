"""``specc bench``: speed-up of speculative decoding over specc's own non-speculative
decoding, on the same prompts, in one process (Spec-Bench's protocol and table).

Protocol (Xia et al. 2024, Spec-Bench): batch 1, greedy, one prompt at a time. After a
warm-up, each prompt runs with the config's speculative method and without speculation
(``Session.generate(use_speculation=False)``: same weights, cache and sampling code), in
alternating order (even prompts speculative first, odd prompts baseline first) so slow
drift of the machine hits both alike. Then, when asked, transformers' ``generate``
baselines (:mod:`specc.hf_baselines`) run on the same token ids.

Numbers, per category and overall:

* speed of a run: generated tokens / wall time from the request's arrival to its finish
  (prefill included); a method's speed is the mean over prompts, and its speed-up the
  ratio of that mean to the non-speculative one (Spec-Bench's ``speed.py``);
* mean accepted tokens (MAT, Spec-Bench's "#Mean Accepted Tokens"): tokens emitted per
  target forward after prefill, pooled over every step of every prompt (steps that had no
  draft count as 1);
* vLLM's counters: acceptance rate (accepted / draft tokens) and mean acceptance length
  (1 + accepted / drafts, over steps that carried drafts);
* greedy check: every speculative output must equal the non-speculative output token for
  token; mismatches are counted and reported;
* memory: the process's peak RSS after the specc runs (before any transformers model is
  loaded) and at the end, and the bytes of the KV caches (target, and a separate
  drafter's); on CUDA the peak allocated device memory.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field

from specc.datasets import DISPLAY_NAMES, BenchPrompt, Dataset
from specc.outputs import SpecMetrics
from specc.sampling_params import SamplingParams

BASE, SPEC = "base", "spec"
WARMUP_TOKENS = 16


@dataclass
class Run:
    """One generation of one prompt by one method."""

    token_ids: list[int]
    time: float  # s, arrival → finish (prefill included)
    num_steps: int  # target forwards after prefill
    step_tokens: int  # tokens those forwards emitted (= len(token_ids) - 1 unless none)
    ttft: float | None = None  # s (specc runs)
    tokens_per_step: list[int] = field(default_factory=list)  # specc: per step, prefill first
    spec: SpecMetrics | None = None  # specc speculative runs

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def speed(self) -> float:
        return self.num_tokens / self.time if self.time > 0 else 0.0

    def to_dict(self) -> dict:
        d = dict(num_tokens=self.num_tokens, time=self.time, tokens_per_second=self.speed,
                 num_steps=self.num_steps, step_tokens=self.step_tokens, ttft=self.ttft)
        if self.spec is not None:
            d["spec"] = self.spec.to_dict()
        return d


@dataclass
class PromptResult:
    prompt: BenchPrompt
    prompt_token_ids: list[int] = field(default_factory=list)
    runs: dict[str, Run] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Method:
    key: str  # "base", "spec", "hf", "hf-prompt-lookup", "hf-assisted"
    label: str
    reason: str | None = None  # set: not applicable, never ran


@dataclass
class BenchResult:
    dataset: str
    max_tokens: int
    methods: list[Method]
    prompts: list[PromptResult]
    memory: dict
    environment: dict

    @property
    def ok_prompts(self) -> list[PromptResult]:
        return [p for p in self.prompts if p.error is None]


# ---------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------


def run_bench(
    session,
    dataset: Dataset,
    *,
    max_tokens: int,
    baselines: list[str] = (),
    warmup: bool = True,
    progress: bool | None = None,
) -> BenchResult:
    """Run the benchmark (module docstring) and return every run's numbers.

    Args:
        session: a :class:`specc.Session`; without a ``speculative_config`` only the
            non-speculative and transformers rows run.
        progress: tqdm bars on stderr (None: only on a terminal).
    """
    from tqdm.auto import tqdm

    has_spec = session.proposer is not None
    methods = [Method(BASE, "specc, no speculation")]
    if has_spec:
        methods.append(Method(SPEC, f"specc {_method_label(session.config)}"))
    results = [PromptResult(p) for p in dataset.prompts]
    if not results:
        raise ValueError("the dataset selection holds no prompt")

    if warmup:
        _warm_up(session, dataset.prompts[0], has_spec)
    bar = tqdm(results, desc="specc", unit="prompt", disable=_disable(progress), file=sys.stderr)
    for i, pr in enumerate(bar):
        modes = [True, False] if has_spec else [False]
        for use_spec in modes if i % 2 == 0 else modes[::-1]:
            _run_specc(session, pr, max_tokens, use_spec)
            if pr.error:
                break
    memory = _memory(session)

    if baselines:
        from specc import hf_baselines

        hf = hf_baselines.build(list(baselines), session)
        methods += [Method(b.name, b.label, b.reason) for b in hf]
        live = [b for b in hf if b.reason is None]
        ok = [pr for pr in results if pr.error is None]
        if live and ok and warmup:
            for b in live:
                _run_hf(session, b, ok[0], WARMUP_TOKENS, record=False)
        bar = tqdm(ok, desc="transformers", unit="prompt", disable=_disable(progress), file=sys.stderr)
        for i, pr in enumerate(bar):
            shift = i % len(live) if live else 0
            for b in live[shift:] + live[:shift]:
                _run_hf(session, b, pr, max_tokens)
        memory["peak_rss_bytes_end"] = _peak_rss()

    return BenchResult(dataset.name, max_tokens, methods, results, memory, _environment(session))


def _run_specc(session, pr: PromptResult, max_tokens: int, use_spec: bool) -> None:
    p = pr.prompt
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(p.stop) or None)
    o = session.generate([p.text], params, chat=p.chat, use_speculation=use_spec)[0]
    if o.error:
        pr.error = o.error
        return
    m = o.metrics
    pr.prompt_token_ids = o.prompt_token_ids
    pr.runs[SPEC if use_spec else BASE] = Run(
        token_ids=list(o.token_ids), time=m.total_time, num_steps=len(m.tokens_per_step) - 1,
        step_tokens=sum(m.tokens_per_step[1:]), ttft=m.time_to_first_token,
        tokens_per_step=list(m.tokens_per_step), spec=m.spec if use_spec else None,
    )


def _run_hf(session, baseline, pr: PromptResult, max_tokens: int, record: bool = True) -> None:
    r = baseline.generate(pr.prompt_token_ids, max_tokens, session.eos_token_ids, pr.prompt.stop, session.tokenizer)
    if record:
        n = len(r.token_ids)
        pr.runs[baseline.name] = Run(token_ids=r.token_ids, time=r.time, num_steps=max(r.forwards - 1, 0),
                                     step_tokens=max(n - 1, 0))


def _warm_up(session, prompt: BenchPrompt, has_spec: bool) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS)
    for use_spec in ([True, False] if has_spec else [False]):
        session.generate([prompt.text], params, chat=prompt.chat, use_speculation=use_spec)
    if has_spec:  # the warm-up's counters are not part of the session's totals
        session.metrics = SpecMetrics()


def _disable(progress: bool | None) -> bool | None:
    return None if progress is None else not progress


def _method_label(cfg) -> str:
    spec = cfg.speculative_config
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        label = f"ngram {spec.prompt_lookup_min}-{spec.prompt_lookup_max} k={k}"
    elif spec.method == "draft_model" and spec.is_early_exit:
        label = f"early-exit {spec.num_draft_layers}L k={k}"
    else:
        label = f"{spec.method} k={k}"
    return label + (" tree" if spec.tree_field else "")


# ---------------------------------------------------------------------------------------
# memory and environment
# ---------------------------------------------------------------------------------------


def _peak_rss() -> int | None:
    """The process's peak resident set size in bytes (None where unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def _memory(session) -> dict:
    import torch

    d = {"peak_rss_bytes": _peak_rss(), "kv_cache_bytes": session.kv_cache.nbytes, "drafter_kv_cache_bytes": 0}
    cache = getattr(session.proposer, "cache", None)
    if cache is not None and cache is not session.kv_cache and not getattr(session.proposer, "shares_target_cache", False):
        d["drafter_kv_cache_bytes"] = cache.nbytes
    if session.config.device == "cuda" and torch.cuda.is_available():
        d["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return d


def _environment(session) -> dict:
    import torch
    import transformers

    return {
        "config": session.config.to_dict(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_average": _load_average(),
        "machine": platform.machine(), "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# ---------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------


def summarize(result: BenchResult) -> dict:
    """Per method, per category and overall: speed, speed-up, MAT, counters, mismatches."""
    ok = result.ok_prompts
    cats = list(dict.fromkeys(p.prompt.category for p in ok))
    methods = {}
    for m in result.methods:
        entry: dict = {"label": m.label}
        if m.reason:
            entry["not_applicable"] = m.reason
        else:
            entry["categories"] = {c: _stats(result, m.key, [p for p in ok if p.prompt.category == c]) for c in cats}
            entry["overall"] = _stats(result, m.key, ok)
        methods[m.key] = entry
    return {
        "dataset": result.dataset, "max_tokens": result.max_tokens, "num_prompts": len(ok),
        "skipped": [{"id": p.prompt.id, "error": p.error} for p in result.prompts if p.error],
        "categories": cats, "methods": methods, "memory": result.memory, "environment": result.environment,
    }


def _stats(result: BenchResult, key: str, prompts: list[PromptResult]) -> dict:
    runs = [(p, p.runs[key]) for p in prompts if key in p.runs]
    bases = [p.runs[BASE] for p, _ in runs]
    if not runs:
        return {"n": 0}
    speed = sum(r.speed for _, r in runs) / len(runs)
    base_speed = sum(b.speed for b in bases) / len(bases)
    steps = sum(r.num_steps for _, r in runs)
    d = {
        "n": len(runs),
        "tokens": sum(r.num_tokens for _, r in runs),
        "time": sum(r.time for _, r in runs),
        "tokens_per_second": speed,
        "speedup": speed / base_speed if base_speed else 0.0,
        "mean_accepted_tokens": sum(r.step_tokens for _, r in runs) / steps if steps else 1.0,
        "mismatches": sum(r.token_ids != b.token_ids for (_, r), b in zip(runs, bases)),
    }
    decode = [(r.num_tokens - 1) / (r.time - r.ttft) for _, r in runs if r.ttft is not None and r.time > r.ttft and r.num_tokens > 1]
    if len(decode) == len(runs):
        d["decode_tokens_per_second"] = sum(decode) / len(decode)
    specs = [r.spec for _, r in runs if r.spec is not None]
    if specs:
        hist: dict[int, int] = {}
        for _, r in runs:
            for t in r.tokens_per_step[1:]:
                hist[t] = hist.get(t, 0) + 1
        d["tokens_per_step_hist"] = dict(sorted(hist.items()))
        total = SpecMetrics()
        for s in specs:
            total.add(s)
        d["spec"] = total.to_dict()
        d["draft_step_fraction"] = total.num_drafts / steps if steps else 0.0
    return d


def format_report(summary: dict) -> str:
    """The Spec-Bench table and the lines beside it, as printed by ``specc bench``."""
    cats = summary["categories"]
    methods = summary["methods"]
    names = [DISPLAY_NAMES.get(c, c) for c in cats]
    label_w = max(len(m["label"]) for m in methods.values()) + 2
    widths = [max(len(n), 6) for n in names]
    lines = [
        f"{summary['dataset']}: {summary['num_prompts']} prompts, <= {summary['max_tokens']} new tokens, "
        "greedy, batch 1",
        "",
        "Speed-up over specc without speculation (mean tok/s per prompt; Spec-Bench's protocol)",
    ]
    head = "".join(f"{n:>{w + 2}}" for n, w in zip(names, widths))
    lines.append(f"{'':<{label_w}}{head}  {'Overall':>8} {'tok/s':>7} {'MAT':>5}")
    for m in methods.values():
        if "not_applicable" in m:
            lines.append(f"{m['label']:<{label_w}}{m['not_applicable']}")
            continue
        cells = "".join(
            f"{_x(m['categories'][c].get('speedup')):>{w + 2}}" for c, w in zip(cats, widths)
        )
        o = m["overall"]
        lines.append(
            f"{m['label']:<{label_w}}{cells}  {_x(o.get('speedup')):>8} "
            f"{o.get('tokens_per_second', 0):>7.1f} {o.get('mean_accepted_tokens', 1):>5.2f}"
        )
    spec_rows = [m for k, m in methods.items() if k not in (BASE, "hf") and "not_applicable" not in m]
    if spec_rows:
        lines += ["", "Mean accepted tokens (tokens per target forward after prefill)"]
        lines.append(f"{'':<{label_w}}{head}  {'Overall':>8}")
        for m in spec_rows:
            cells = "".join(
                f"{m['categories'][c].get('mean_accepted_tokens', 0):>{w + 2}.2f}" for c, w in zip(cats, widths)
            )
            lines.append(f"{m['label']:<{label_w}}{cells}  {m['overall'].get('mean_accepted_tokens', 0):>8.2f}")
    lines.append("")
    n = summary["num_prompts"]
    for key, m in methods.items():
        if key == BASE or "not_applicable" in m:
            continue
        o = m["overall"]
        if key == SPEC:
            s = o.get("spec", {})
            lines.append(
                f"{m['label']}: acceptance rate {s.get('acceptance_rate', 0):.2f}, mean acceptance length "
                f"{s.get('mean_acceptance_length', 1):.2f} (1 + accepted/drafts), drafts on "
                f"{o.get('draft_step_fraction', 0):.0%} of steps"
            )
            verdict = "all equal" if o["mismatches"] == 0 else f"{o['mismatches']} MISMATCH(ES)"
            lines.append(f"greedy check, specc speculative vs non-speculative: {n - o['mismatches']}/{n} equal ({verdict})")
        else:
            lines.append(
                f"{m['label']}: output equals specc's non-speculative output on {o['n'] - o['mismatches']}/{o['n']} "
                "prompts (float rounding may flip near-ties)"
            )
    mem = summary["memory"]
    parts = []
    if mem.get("peak_rss_bytes"):
        parts.append(f"peak RSS {_bytes(mem['peak_rss_bytes'])} (specc runs)")
    if mem.get("peak_rss_bytes_end"):
        parts.append(f"{_bytes(mem['peak_rss_bytes_end'])} with transformers models")
    kv = f"KV cache {_bytes(mem['kv_cache_bytes'])}"
    if mem.get("drafter_kv_cache_bytes"):
        kv += f" + drafter {_bytes(mem['drafter_kv_cache_bytes'])}"
    parts.append(kv)
    if mem.get("cuda_max_allocated_bytes"):
        parts.append(f"CUDA peak allocated {_bytes(mem['cuda_max_allocated_bytes'])}")
    lines.append("memory: " + ", ".join(parts))
    env = summary["environment"]
    load, cpus = env.get("load_average"), env.get("cpu_count")
    lines.append(f"machine: {env['machine']}, {cpus} CPUs, torch {env['torch']} with {env['threads']} threads"
                 + (f", load average {load:.1f} at the end" if load is not None else ""))
    if load is not None and cpus and load > cpus + 0.5:
        hint = "; with several torch threads each it is much slower: try --threads 1" if env["threads"] > 1 else ""
        lines.append(f"WARNING: the machine is busy (load {load:.1f} on {cpus} CPUs): other processes compete "
                     f"for the cores, timings are noisy{hint}")
    for s in summary["skipped"]:
        lines.append(f"skipped prompt {s['id']}: {s['error']}")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def to_json(result: BenchResult, summary: dict) -> dict:
    """Everything ``--json OUT`` writes: the summary plus every run of every prompt."""
    return {
        **summary,
        "prompts": [
            {
                "id": p.prompt.id, "category": p.prompt.category, "num_prompt_tokens": len(p.prompt_token_ids),
                "error": p.error, "runs": {k: r.to_dict() for k, r in p.runs.items()},
                "equal_to_base": {k: r.token_ids == p.runs[BASE].token_ids for k, r in p.runs.items()
                                  if k != BASE and BASE in p.runs},
            }
            for p in result.prompts
        ],
    }
