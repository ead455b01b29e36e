"""The ``specc`` command line on tiny random-weight models (``specc.cli.main`` in-process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specc.cli import main

PROMPT = "The quick brown fox"


def _yaml(tmp_path, target, name="model.yaml", extra="") -> str:
    path = tmp_path / name
    path.write_text(
        f"target: {target}\nmax_model_len: 128\nmax_num_seqs: 4\nbatch_buckets: [1, 2, 4]\nenforce_eager: true\n"
        f"sampling:\n  temperature: 0.0\n  max_tokens: 8\n{extra}"
    )
    return str(path)


@pytest.fixture(scope="module")
def plain_yaml(tiny_llama_dir, tmp_path_factory):
    return _yaml(tmp_path_factory.mktemp("cli"), tiny_llama_dir)


@pytest.fixture(scope="module")
def ngram_yaml(tiny_llama_dir, tmp_path_factory):
    extra = ("speculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n"
             "  prompt_lookup_min: 1\n  prompt_lookup_max: 2\n")
    return _yaml(tmp_path_factory.mktemp("cli"), tiny_llama_dir, extra=extra)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """What Session gives for the CLI's prompts (greedy, 8 tokens)."""
    from specc import SamplingParams, Session

    s = Session({"target": str(tiny_llama_dir), "max_model_len": 128, "enforce_eager": True}, verbose=False)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    return {p: s.generate(p, sp)[0] for p in (PROMPT, "Second prompt")}


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "usage: specc" in out
    assert main([]) == 0  # no command: help, success
    assert "generate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--prompt", "--chat", "--json", "--max-tokens", "--no-baseline"):
        assert flag in out


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "specc.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "generate" in r.stdout


def test_generate_json_plain(plain_yaml, reference, capsys):
    rc = main(["generate", plain_yaml, "--prompt", PROMPT, "--prompt", "Second prompt", "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    objs = _json_lines(cap.out)  # stdout holds only the JSON lines (progress goes to stderr)
    assert len(objs) == 2
    for obj, p in zip(objs, (PROMPT, "Second prompt")):
        ref = reference[p]
        assert obj["text"] == ref.text and obj["token_ids"] == ref.token_ids
        assert obj["finish_reason"] == ref.finish_reason and obj["error"] is None
        m = obj["metrics"]
        assert m["num_generation_tokens"] == len(obj["token_ids"]) == 8
        assert m["time_to_first_token"] > 0 and m["tokens_per_second"] > 0
        assert "baseline" not in obj  # no speculation: no baseline run


def test_generate_json_speculative_has_counters_and_baseline(ngram_yaml, reference, capsys):
    rc = main(["generate", ngram_yaml, "--prompt", PROMPT, "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    (obj,) = _json_lines(cap.out)
    assert obj["token_ids"] == reference[PROMPT].token_ids  # speculation is lossless
    spec = obj["metrics"]["spec"]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                "mean_acceptance_length", "acceptance_rate"):
        assert key in spec
    assert spec["mean_acceptance_length"] >= 1.0
    base = obj["baseline"]
    assert base["outputs_equal"] == [True]
    assert base["baseline_tokens_per_second"] > 0 and base["speculative_tokens_per_second"] > 0
    assert base["speedup"] > 0
    rc = main(["generate", ngram_yaml, "--prompt", PROMPT, "--json", "--no-baseline"])
    (obj,) = _json_lines(capsys.readouterr().out)
    assert rc == 0 and "baseline" not in obj


def test_streaming_text_mode_prints_the_text(plain_yaml, reference, capsys):
    rc = main(["generate", plain_yaml, "--prompt", PROMPT])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith(reference[PROMPT].text)
    assert f"[{reference[PROMPT].finish_reason}] 8 tokens" in out and "tok/s" in out


def test_batch_text_mode_and_speculative_summary(ngram_yaml, reference, capsys):
    rc = main(["generate", ngram_yaml, "--prompt", PROMPT, "--prompt", "Second prompt"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"--- request 0 ---\n{reference[PROMPT].text}\n" in out
    assert f"--- request 1 ---\n{reference['Second prompt'].text}\n" in out
    assert "speculative: method ngram" in out and "mean acceptance length" in out
    assert "outputs identical" in out


def test_overrides_and_per_request_error(plain_yaml, capsys):
    rc = main(["generate", plain_yaml, "--prompt", PROMPT, "--json", "--max-tokens", "3",
               "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "4"])
    (obj,) = _json_lines(capsys.readouterr().out)
    assert rc == 0 and len(obj["token_ids"]) == 3
    rc = main(["generate", plain_yaml, "--prompt", PROMPT, "--json", "--max-tokens", "3",
               "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "4"])
    assert _json_lines(capsys.readouterr().out)[0]["token_ids"] == obj["token_ids"]  # seeded
    rc = main(["generate", plain_yaml, "--prompt", PROMPT, "--json", "--temperature", "-1"])
    (obj,) = _json_lines(capsys.readouterr().out)
    assert rc == 1 and obj["finish_reason"] == "error" and "temperature = -1" in obj["error"]
    rc = main(["generate", plain_yaml, "--prompt", PROMPT, "--top-p", "0"])
    cap = capsys.readouterr()
    assert rc == 1 and "[request 0] error: invalid SamplingParams: top_p = 0" in cap.err


def test_no_speed_up_line_when_every_request_failed(ngram_yaml, capsys):
    """All requests rejected: no baseline run and no "speed-up 0.00x ... outputs identical"."""
    rc = main(["generate", ngram_yaml, "--prompt", "", "--max-tokens", "0"])
    cap = capsys.readouterr()
    assert rc == 1 and "[request 0] error: invalid SamplingParams: max_tokens = 0" in cap.err
    assert "speed-up" not in cap.out and "speculative:" not in cap.out
    rc = main(["generate", ngram_yaml, "--prompt", "", "--json"])
    (obj,) = _json_lines(capsys.readouterr().out)
    assert rc == 1 and obj["finish_reason"] == "error" and "baseline" not in obj


def test_bad_config_exits_2(tmp_path, tiny_llama_dir, capsys):
    rc = main(["generate", str(tmp_path / "missing.yaml"), "--prompt", "x"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert cap.err.startswith("specc: error: ") and "config file not found" in cap.err

    bad_field = _yaml(tmp_path, tiny_llama_dir, "typo.yaml", extra="speculative_cofnig: null\n")
    rc = main(["generate", bad_field, "--prompt", "x"])
    cap = capsys.readouterr()
    assert rc == 2 and "typo.yaml: unknown field 'speculative_cofnig'" in cap.err
    assert "did you mean 'speculative_config'" in cap.err

    bad_value = _yaml(tmp_path, tiny_llama_dir, "value.yaml",
                      extra="speculative_config:\n  method: ngram\n  num_speculative_tokens: -1\n")
    rc = main(["generate", bad_value, "--prompt", "x", "--json"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and "num_speculative_tokens = -1" in cap.err

    no_model = _yaml(tmp_path, tmp_path / "no_such_folder", "target.yaml")
    rc = main(["generate", no_model, "--prompt", "x"])
    cap = capsys.readouterr()
    assert rc == 2 and "does not exist" in cap.err and "Traceback" not in cap.err
