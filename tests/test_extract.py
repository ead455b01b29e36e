"""``specc extract`` (specc/extract.py): shard contents, hidden states equal to a direct
forward (specc's model and Hugging Face transformers), atomic output, CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import greedy
from specc.cli import main
from specc.datasets import read_jsonl
from specc.extract import extract_hidden_states
from specc.models.kv_cache import KVCache

LINES = [
    {"id": "a", "prompt": "Hello there, how are you?"},
    {"question_id": 7, "category": "writing", "turns": ["Write one line about the sea.", "And the sky?"]},
    {"id": "raw", "prompt": "1 2 3 4", "chat": False},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("extract_in")
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LINES))
    (d / "model.yaml").write_text(f"target: {tiny_llama_dir}\nmax_model_len: 256\nmax_num_seqs: 2\n"
                                  "speculative_config:\n  method: ngram\n")
    return d


def _shards(out):
    index = json.loads((out / "index.json").read_text())
    return index, [load_file(str(out / s["file"])) for s in index["shards"]]


def test_extract_shapes_and_values(files, tmp_path, base):
    out = extract_hidden_states(files / "model.yaml", read_jsonl(files / "prompts.jsonl"), [2, 0, 1],
                                tmp_path / "hs", max_tokens=6, tokens_per_shard=40, progress=False)
    index, shards = _shards(out)
    assert index["format"] == "specc-hidden-states" and index["layers"] == [2, 0, 1]
    assert index["hidden_size"] == 64 and index["dtype"] == "float32" and index["num_sequences"] == 3
    assert [i for s in index["shards"] for i in s["ids"]] == ["a", "7", "raw"]
    assert len(shards) >= 2  # 40-token shards: the sequences are split over files
    model = base.target.model
    seqs = []
    for meta, sh in zip(index["shards"], shards):
        n = meta["num_tokens"]
        assert sh["hidden_states"].shape == (n, 3, 64) and sh["hidden_states"].dtype == torch.float32
        assert sh["token_ids"].shape == (n,) and sh["token_ids"].dtype == torch.int64
        assert sh["offsets"][0] == 0 and sh["offsets"][-1] == n and len(sh["offsets"]) == meta["num_sequences"] + 1
        for j in range(meta["num_sequences"]):
            a, b = sh["offsets"][j], sh["offsets"][j + 1]
            seqs.append((sh["token_ids"][a:b], sh["hidden_states"][a:b], int(sh["prompt_lengths"][j])))
    assert sum(len(t) for t, _, _ in seqs) == index["num_tokens"]

    prompts = read_jsonl(files / "prompts.jsonl")
    for p, (tokens, hidden, n_prompt) in zip(prompts, seqs):
        ids = base.tokenize(p.text, chat=p.chat)
        out_ids = base.generate([ids], greedy(6), use_speculation=False)[0].token_ids
        assert tokens.tolist() == ids + out_ids and n_prompt == len(ids)
        # a direct, unchunked forward of specc's model
        direct = model(tokens[None], torch.arange(len(tokens))[None], KVCache.for_model(model.config, 1, len(tokens)),
                       hidden_layers=(0, 1, 2)).hidden_states
        for j, layer in enumerate([2, 0, 1]):
            assert torch.allclose(hidden[:, j], direct[layer][0], atol=1e-5)
    # and Hugging Face transformers (its hidden_states[i] for i < L are pre-norm, as ours)
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(base.target.folder).eval()
    tokens, hidden, _ = seqs[1]
    with torch.no_grad():
        ref = hf(tokens[None], output_hidden_states=True).hidden_states
    assert torch.allclose(hidden[:, 1], ref[0][0], atol=1e-5) and torch.allclose(hidden[:, 2], ref[1][0], atol=1e-4)


def test_prompts_only_and_errors(files, tmp_path):
    prompts = read_jsonl(files / "prompts.jsonl")
    out = extract_hidden_states(files / "model.yaml", prompts, [1], tmp_path / "p", max_tokens=0, progress=False)
    index, shards = _shards(out)
    assert (shards[0]["prompt_lengths"] == shards[0]["offsets"].diff()).all()  # no generated tokens
    with pytest.raises(ValueError, match=r"\[3\] outside \[0, 2\]"):
        extract_hidden_states(files / "model.yaml", prompts, [0, 3], tmp_path / "q", progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a specc extract folder"):
        extract_hidden_states(files / "model.yaml", prompts, [1], tmp_path / "busy", progress=False)
    assert not (tmp_path / "q").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_extract_end_to_end(files, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["extract", str(files / "model.yaml"), "--prompts", str(files / "prompts.jsonl"), "--layers", "0,2",
            "--out", str(out), "--max-tokens", "3", "--num-prompts", "2"]
    assert main(argv) == 0
    assert "2 sequences" in capsys.readouterr().out
    index, shards = _shards(out)
    assert index["layers"] == [0, 2] and shards[0]["hidden_states"].shape[1:] == (2, 64)
    assert main(argv) == 0  # an earlier extract is replaced
    with pytest.raises(SystemExit):  # argparse: "--layers '0,x': expected comma-separated integers"
        main(argv[:4] + ["--layers", "0,x", "--out", str(tmp_path / "bad")])
    assert "expected comma-separated integers" in capsys.readouterr().err
    rc = main(["extract", str(files / "model.yaml"), "--prompts", str(files / "prompts.jsonl"), "--layers", "9",
               "--out", str(tmp_path / "bad")])
    assert rc == 2 and "outside [0, 2]" in capsys.readouterr().err
