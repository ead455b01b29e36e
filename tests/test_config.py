"""specc.config: schema, validation rules, error messages, loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specc.config import (
    SPECULATIVE_METHODS,
    ConfigError,
    SamplingDefaults,
    SpeccConfig,
    SpeculativeConfig,
    load_config,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def err(data, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data, **kw)
    msg = str(info.value)
    assert "errors.pydantic.dev" not in msg
    assert "Value error," not in msg
    assert msg.count("\n") + 1 == len(info.value.errors)
    return msg


def spec(**kw) -> dict:
    return {"target": "smollm2-135m-instruct", "speculative_config": kw}


# ------------------------------------------------------------------ defaults / basics


def test_defaults():
    cfg = load_config({"target": "smollm2-135m-instruct"})
    assert cfg.target == "smollm2-135m-instruct"
    assert cfg.dtype == "float32"
    assert cfg.device == "cpu"
    assert cfg.max_model_len == 2048
    assert cfg.max_num_seqs == 8
    assert cfg.batch_buckets == [1, 2, 4, 8]
    assert cfg.speculative_config is None
    assert cfg.sampling == SamplingDefaults()
    assert cfg.sampling.temperature == 0.0
    assert cfg.sampling.top_p == 1.0
    assert cfg.sampling.top_k == 0
    assert cfg.sampling.max_tokens == 128
    assert cfg.sampling.seed is None
    assert cfg.seed == 0


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_model_alias_for_target():
    cfg = load_config({"model": "smollm2-135m-instruct"})
    assert cfg.target == "smollm2-135m-instruct"
    assert cfg.to_dict()["target"] == "smollm2-135m-instruct"
    assert "model" not in cfg.to_dict()
    assert SpeccConfig(model="x").target == "x"
    assert SpeccConfig(target="x").target == "x"


def test_target_and_model_both_rejected():
    msg = err({"target": "a", "model": "b"})
    assert "model = 'b'" in msg and "not both" in msg


def test_target_missing():
    msg = err({"dtype": "float32"})
    assert "target: required field missing" in msg and "'model'" in msg


def test_target_empty():
    assert "target = '  '" in err({"target": "  "})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_dtype(dtype):
    torch = pytest.importorskip("torch")
    cfg = load_config({"target": "x", "dtype": dtype})
    assert cfg.torch_dtype == getattr(torch, dtype)


def test_bad_dtype_lists_allowed():
    msg = err({"target": "x", "dtype": "fp8"})
    assert "dtype = 'fp8'" in msg
    for d in ("float32", "bfloat16", "float16"):
        assert d in msg


def test_bad_device_lists_allowed():
    msg = err({"target": "x", "device": "tpu"})
    assert "device = 'tpu'" in msg and "'cpu'" in msg and "'cuda'" in msg and "'npu'" in msg


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_devices(device):
    assert load_config({"target": "x", "device": device}).device == device


def test_max_model_len_bounds():
    assert load_config({"target": "x", "max_model_len": 16}).max_model_len == 16
    assert "max_model_len = 15: must be >= 16" in err({"target": "x", "max_model_len": 15})


def test_max_num_seqs_bounds():
    assert load_config({"target": "x", "max_num_seqs": 1}).max_num_seqs == 1
    assert "max_num_seqs = 0: must be >= 1" in err({"target": "x", "max_num_seqs": 0})


def test_int_fields_reject_bools_and_strings():
    assert "max_num_seqs = true" in err({"target": "x", "max_num_seqs": True})
    assert "max_model_len = 'lots': must be an integer" in err(
        {"target": "x", "max_model_len": "lots"}
    )
    assert "seed = 1.5: must be an integer" in err({"target": "x", "seed": 1.5})


def test_session_seed():
    assert load_config({"target": "x", "seed": 1234}).seed == 1234


# ------------------------------------------------------------------ batch buckets


@pytest.mark.parametrize("buckets", [[1], [3], [1, 2, 4, 8, 16], [2, 3, 5]])
def test_buckets_ok(buckets):
    assert load_config({"target": "x", "batch_buckets": buckets}).batch_buckets == buckets


@pytest.mark.parametrize(
    "buckets, needle",
    [
        ([], "at least one"),
        ([1, 4, 2], "strictly increasing (4 then 2)"),
        ([1, 2, 2], "strictly increasing (2 then 2)"),
        ([0, 1], "must be >= 1"),
        ([-2], "must be >= 1"),
    ],
)
def test_buckets_bad(buckets, needle):
    msg = err({"target": "x", "batch_buckets": buckets})
    assert "batch_buckets" in msg and needle in msg


def test_buckets_not_a_list():
    assert "batch_buckets = 4: must be a list" in err({"target": "x", "batch_buckets": 4})


def test_bucket_for():
    cfg = load_config({"target": "x", "batch_buckets": [1, 2, 4, 8]})
    assert [cfg.bucket_for(b) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert cfg.bucket_for(20) == 8  # larger batches are split by the caller
    assert cfg.max_batch_bucket == 8
    with pytest.raises(ValueError):
        cfg.bucket_for(0)


# ------------------------------------------------------------------ sampling defaults


def test_sampling_section():
    cfg = load_config(
        {
            "target": "x",
            "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_tokens": 5, "seed": 3},
        }
    )
    assert cfg.sampling == SamplingDefaults(temperature=0.7, top_p=0.9, top_k=50, max_tokens=5, seed=3)


@pytest.mark.parametrize("top_k", [-1, 0, 1, 40])
def test_sampling_top_k_ok(top_k):
    assert SamplingDefaults(top_k=top_k).top_k == top_k


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("temperature", -0.1, "sampling.temperature = -0.1: must be >= 0"),
        ("temperature", float("inf"), "sampling.temperature = inf: must be a finite number"),
        ("top_p", 0, "sampling.top_p = 0: must be > 0"),
        ("top_p", 1.5, "sampling.top_p = 1.5: must be <= 1"),
        ("top_k", -2, "sampling.top_k = -2: must be >= -1"),
        ("top_k", 2.5, "sampling.top_k = 2.5: must be an integer"),
        ("max_tokens", 0, "sampling.max_tokens = 0: must be >= 1"),
        ("seed", "abc", "sampling.seed = 'abc'"),
        ("temprature", 1.0, "sampling: unknown field 'temprature'"),
    ],
)
def test_sampling_bad(field, value, needle):
    assert needle in err({"target": "x", "sampling": {field: value}})


# ------------------------------------------------------------------ speculative_config


def test_methods_registry():
    assert set(SPECULATIVE_METHODS) == {"ngram", "draft_model", "suffix", "eagle", "eagle3"}


def test_ngram_defaults_follow_vllm():
    sc = load_config(spec(method="ngram")).speculative_config
    assert sc.method == "ngram"
    assert sc.num_speculative_tokens == 4
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == (5, 5)
    assert sc.model is None and sc.num_draft_layers is None
    assert not sc.is_early_exit


def test_ngram_one_bound_copies_the_other():
    sc = load_config(spec(method="ngram", prompt_lookup_max=3)).speculative_config
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == (3, 3)
    sc = load_config(spec(method="ngram", prompt_lookup_min=7)).speculative_config
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == (7, 7)


def test_ngram_explicit_bounds():
    sc = load_config(spec(method="ngram", prompt_lookup_min=1, prompt_lookup_max=4)).speculative_config
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == (1, 4)


def test_ngram_max_below_min():
    msg = err(spec(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2))
    assert "speculative_config.prompt_lookup_max = 2" in msg
    assert "prompt_lookup_min (4)" in msg


@pytest.mark.parametrize("field", ["prompt_lookup_min", "prompt_lookup_max"])
def test_ngram_lookup_ge_1(field):
    assert f"speculative_config.{field} = 0: must be >= 1" in err(spec(method="ngram", **{field: 0}))


def test_ngram_propose_tree():
    assert load_config(spec(method="ngram")).speculative_config.ngram_propose_tree is False
    sc = load_config(spec(method="ngram", ngram_propose_tree=True)).speculative_config
    assert sc.ngram_propose_tree is True and sc.tree_field == "ngram_propose_tree"
    assert load_config(spec(method="suffix")).speculative_config.ngram_propose_tree is None
    assert "speculative_config.ngram_propose_tree = 'maybe'" in err(spec(method="ngram", ngram_propose_tree="maybe"))
    msg = err(spec(method="suffix", ngram_propose_tree=True))
    assert "speculative_config.ngram_propose_tree = true: not allowed with method 'suffix' (only with 'ngram')" in msg


@pytest.mark.parametrize("k", [1, 4, 16])
def test_num_speculative_tokens_ok(k):
    assert load_config(spec(method="ngram", num_speculative_tokens=k)).speculative_config.num_speculative_tokens == k


@pytest.mark.parametrize("k, needle", [(-1, "must be >= 1"), (0, "must be >= 1"), (17, "must be <= 16")])
def test_num_speculative_tokens_bad(k, needle):
    msg = err(spec(method="ngram", num_speculative_tokens=k))
    assert f"speculative_config.num_speculative_tokens = {k}: {needle}" in msg


def test_ngram_rejects_model():
    msg = err(spec(method="ngram", model="drafter"))
    assert "speculative_config.model = 'drafter'" in msg and "'ngram'" in msg


def test_ngram_rejects_num_draft_layers():
    msg = err(spec(method="ngram", num_draft_layers=4))
    assert "speculative_config.num_draft_layers = 4" in msg and "'ngram'" in msg


def test_draft_model_separate():
    sc = load_config(spec(method="draft_model", model="some/drafter")).speculative_config
    assert sc.model == "some/drafter"
    assert sc.num_draft_layers is None and not sc.is_early_exit
    assert sc.prompt_lookup_min is None and sc.prompt_lookup_max is None


def test_draft_model_early_exit():
    sc = load_config(spec(method="draft_model", num_draft_layers=8)).speculative_config
    assert sc.num_draft_layers == 8 and sc.model is None and sc.is_early_exit


def test_draft_model_needs_one_of():
    msg = err(spec(method="draft_model"))
    assert "speculative_config" in msg and "neither" in msg
    assert "'model'" in msg and "'num_draft_layers'" in msg


def test_draft_model_not_both():
    msg = err(spec(method="draft_model", model="d", num_draft_layers=3))
    assert "speculative_config" in msg and "both" in msg


def test_draft_model_rejects_prompt_lookup():
    msg = err(spec(method="draft_model", num_draft_layers=3, prompt_lookup_max=3))
    assert "speculative_config.prompt_lookup_max = 3" in msg and "'draft_model'" in msg


def test_num_draft_layers_ge_1():
    assert "speculative_config.num_draft_layers = 0: must be >= 1" in err(
        spec(method="draft_model", num_draft_layers=0)
    )


def test_check_against_target():
    sc = SpeculativeConfig(method="draft_model", num_draft_layers=8)
    sc.check_against_target(30)
    sc.check_against_target(9)
    for n in (8, 4):
        with pytest.raises(ConfigError) as info:
            sc.check_against_target(n)
        msg = str(info.value)
        assert "speculative_config.num_draft_layers = 8" in msg and f"{n} layers" in msg
    # other methods have nothing to check against the target
    SpeculativeConfig(method="ngram").check_against_target(1)
    SpeculativeConfig(method="draft_model", model="d").check_against_target(1)


def test_bad_method_lists_allowed_methods():
    msg = err(spec(method="medusa"))
    assert "speculative_config.method = 'medusa'" in msg
    for m in SPECULATIVE_METHODS:
        assert f"'{m}'" in msg


def test_method_required():
    assert "speculative_config.method: required field missing" in err(spec())


def test_speculative_config_null():
    assert load_config({"target": "x", "speculative_config": None}).speculative_config is None


def test_speculative_config_not_a_mapping():
    msg = err({"target": "x", "speculative_config": "ngram"})
    assert "speculative_config = 'ngram': must be a mapping" in msg


# ------------------------------------------------------------------ unknown fields


def test_unknown_top_level_field():
    msg = err({"target": "x", "speculative_cofnig": {"method": "ngram"}})
    assert "unknown field 'speculative_cofnig'" in msg
    assert "allowed:" in msg and "speculative_config" in msg and "batch_buckets" in msg
    assert "did you mean 'speculative_config'" in msg


def test_unknown_nested_field():
    msg = err(spec(method="ngram", num_tokens=3))
    assert "speculative_config: unknown field 'num_tokens'" in msg
    assert "num_speculative_tokens" in msg


def test_several_errors_one_line_each():
    with pytest.raises(ConfigError) as info:
        load_config({"target": "x", "dtype": "fp8", "max_num_seqs": 0, "bogus": 1})
    lines = info.value.errors
    assert len(lines) == 3
    assert any(line.startswith("dtype = 'fp8'") for line in lines)
    assert any(line.startswith("max_num_seqs = 0") for line in lines)
    assert any("unknown field 'bogus'" in line for line in lines)


# ------------------------------------------------------------------ yaml loading


def write(tmp_path: Path, text: str, name: str = "model.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_error_names_file(tmp_path):
    p = write(tmp_path, "target: x\nspeculative_config:\n  method: ngram\n  num_speculative_tokens: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(info.value) == f"{p}: speculative_config.num_speculative_tokens = -1: must be >= 1"
    assert info.value.source == str(p)


def test_yaml_str_path(tmp_path):
    p = write(tmp_path, "model: x\n")
    assert load_config(str(p)).target == "x"


def test_missing_file(tmp_path):
    msg = err(tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "not found" in msg


def test_directory(tmp_path):
    assert "directory" in err(tmp_path)


def test_yaml_syntax_error_has_line(tmp_path):
    p = write(tmp_path, "target: x\ndtype: [float32\nseed: 1\n")
    msg = err(p)
    assert "YAML syntax error" in msg and "line " in msg and str(p) in msg


def test_yaml_empty(tmp_path):
    assert "empty" in err(write(tmp_path, "# nothing\n"))


def test_yaml_not_a_mapping(tmp_path):
    assert "mapping" in err(write(tmp_path, "- a\n- b\n"))


def test_bad_source_type():
    with pytest.raises(ConfigError):
        load_config(42)  # type: ignore[arg-type]


def test_relative_paths_resolved_against_yaml_folder(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "configs"
    (cfg_dir / "weights" / "target").mkdir(parents=True)
    (cfg_dir / "drafter.gguf").write_bytes(b"")
    p = write(
        cfg_dir,
        "target: weights/target\nspeculative_config:\n  method: draft_model\n  model: drafter.gguf\n",
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(p)
    assert Path(cfg.target).is_absolute()
    assert Path(cfg.target) == (cfg_dir / "weights" / "target").resolve()
    assert Path(cfg.speculative_config.model) == (cfg_dir / "drafter.gguf").resolve()
    # also through the relative path of the yaml itself
    monkeypatch.chdir(tmp_path)
    assert Path(load_config("configs/model.yaml").target) == (cfg_dir / "weights" / "target").resolve()


def test_model_alias_path_resolved(tmp_path):
    (tmp_path / "w").mkdir()
    p = write(tmp_path, "model: w\n")
    assert Path(load_config(p).target) == (tmp_path / "w").resolve()


def test_embedded_names_and_missing_paths_unchanged(tmp_path):
    p = write(
        tmp_path,
        "target: smollm2-135m-instruct\nspeculative_config:\n  method: draft_model\n"
        "  model: not/here/drafter\n",
    )
    cfg = load_config(p)
    assert cfg.target == "smollm2-135m-instruct"
    assert cfg.speculative_config.model == "not/here/drafter"


def test_dict_paths_not_resolved_unless_base_dir(tmp_path):
    (tmp_path / "w").mkdir()
    assert load_config({"target": "w"}).target == "w"
    assert Path(load_config({"target": "w"}, base_dir=tmp_path).target) == (tmp_path / "w").resolve()


def test_absolute_path_unchanged(tmp_path):
    assert load_config({"target": str(tmp_path)}, base_dir="/").target == str(tmp_path)


# ------------------------------------------------------------------ dict / passthrough / overrides


def test_passthrough():
    cfg = SpeccConfig(target="x")
    assert load_config(cfg) is cfg


def test_dict_not_mutated():
    d = {"model": "x", "speculative_config": {"method": "ngram"}}
    before = json.dumps(d, sort_keys=True)
    load_config(d, overrides={"speculative_config.num_speculative_tokens": 2})
    assert json.dumps(d, sort_keys=True) == before


def test_overrides():
    cfg = load_config(
        EXAMPLES / "smollm2-ngram.yaml",
        overrides={"speculative_config.num_speculative_tokens": 2, "device": "cuda", "sampling.seed": 9},
    )
    assert cfg.speculative_config.num_speculative_tokens == 2
    assert cfg.device == "cuda" and cfg.sampling.seed == 9
    cfg = load_config({"model": "a"}, overrides={"target": "b"})
    assert cfg.target == "b"
    cfg = load_config(SpeccConfig(target="a"), overrides={"speculative_config.method": "ngram"})
    assert cfg.speculative_config.method == "ngram"
    assert "speculative_config.num_speculative_tokens = 0" in err(
        {"target": "a"}, overrides={"speculative_config.method": "ngram", "speculative_config.num_speculative_tokens": 0}
    )


def test_to_dict_roundtrip_json():
    for name in ("smollm2.yaml", "smollm2-ngram.yaml", "smollm2-early-exit.yaml"):
        cfg = load_config(EXAMPLES / name)
        d = cfg.to_dict()
        assert json.loads(json.dumps(d)) == d
        assert load_config(d) == cfg


# ------------------------------------------------------------------ examples


def test_example_smollm2():
    cfg = load_config(EXAMPLES / "smollm2.yaml")
    assert cfg.target == "smollm2-135m-instruct"
    assert cfg.speculative_config is None
    assert cfg.sampling.temperature == 0.0 and cfg.sampling.max_tokens == 128
    assert cfg.batch_buckets == [1, 2, 4, 8] and cfg.max_model_len == 2048


def test_example_ngram():
    sc = load_config(EXAMPLES / "smollm2-ngram.yaml").speculative_config
    assert sc.method == "ngram" and sc.num_speculative_tokens == 4
    assert 1 <= sc.prompt_lookup_min <= sc.prompt_lookup_max


def test_example_ngram_tree():
    cfg = load_config(EXAMPLES / "smollm2-ngram-tree.yaml")
    assert cfg.speculative_config.ngram_propose_tree and not cfg.enforce_eager  # compiles: tree_step


def test_example_early_exit():
    sc = load_config(EXAMPLES / "smollm2-early-exit.yaml").speculative_config
    assert sc.method == "draft_model" and sc.is_early_exit and sc.model is None
    sc.check_against_target(30)  # SmolLM2-135M has 30 layers


def test_example_eagle():
    cfg = load_config(EXAMPLES / "smollm2-eagle.yaml")
    sc = cfg.speculative_config
    assert sc.method == "eagle" and sc.model.endswith("heads/smollm2-eagle") and not cfg.enforce_eager


def test_examples_load_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for p in sorted(EXAMPLES.glob("*.yaml")):
        load_config(p)
