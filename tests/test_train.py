"""``specc train`` (specc/train.py, specc/train_data.py, specc/train_checkpoint.py) on the
tiny random Llama: smoke run writes a loadable head + PNG + checkpoints, resume equals an
uninterrupted run, the loss falls on a tiny set, greedy output with the trained head equals
non-speculative greedy, the evaluation-overlap filter, the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import drafter_spec, greedy, make_session
from specc.cli import main
from specc.models.eagle_checkpoint import load_eagle_head
from specc.train import TrainSettings, train
from specc.train_data import EvalFilter, draft_vocabulary, load_sequences, overlaps, self_generated_prompts

PROMPTS = [{"id": f"p{i}", "prompt": text} for i, text in enumerate([
    "Hello there, how are you today?", "Write one line about the sea.", "Name three colours.",
    "What is two plus two?", "Tell me a short joke.", "Describe a cat in five words."])]
EVAL = [{"question_id": 1, "category": "writing", "turns": ["Write one line about the sea.", "Now the sky."]}]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("train_in")
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    (d / "eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in EVAL))
    (d / "model.yaml").write_text(f"target: {tiny_llama_dir}\nmax_model_len: 256\nmax_num_seqs: 4\n")
    return d


def _settings(files, **kw) -> TrainSettings:
    base = dict(prompts=str(files / "prompts.jsonl"), exclude=[str(files / "eval.jsonl")], num_prompts=6,
                max_tokens=12, epochs=2, batch_size=2, lr=3e-3, save_every=2, seed=3)
    return TrainSettings(**{**base, **kw})


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_smoke_run_writes_loadable_head(files, tmp_path, base, method):
    out = tmp_path / method
    extra = dict(layer_ids=[0, 1], draft_vocab_size=300) if method == "eagle3" else {}
    res = train(files / "model.yaml", out, _settings(files, method=method, max_steps=3, **extra), progress=False)
    assert res["steps"] == 3 and res["total_steps"] == 6  # 5 prompts kept (one overlaps EVAL), batches of 2
    head = load_eagle_head(out, base.target.model, method=method)
    assert head.method == method
    assert (out / "loss.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["tokens"] > 0 for r in rows)
    ids = [json.loads(line)["id"] for line in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert ids == ["p0", "p2", "p3", "p4", "p5"]  # p1 is an evaluation prompt
    if method == "eagle3":
        assert head.hidden_layers == (0, 1) and head.draft_vocab_size == 300
        seqs, _ = load_sequences(out / "data" / "hidden_states")
        answers = torch.cat([s.token_ids[s.prompt_length:] for s in seqs])
        assert bool(head.t2d[answers].all())  # every answer token is in the draft vocabulary
    # greedy with the trained head equals non-speculative greedy
    spec = make_session(base.target.folder, drafter_spec(method, 3, out))
    prompts = ["Hello there", "Name three colours.", [14090] * 8]
    got = spec.generate(prompts, greedy(20))
    want = base.generate(prompts, greedy(20), use_speculation=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_resume_equals_uninterrupted(files, tmp_path):
    s = _settings(files, epochs=2)
    full = train(files / "model.yaml", tmp_path / "a", s, progress=False)
    res = train(files / "model.yaml", tmp_path / "b", _settings(files, epochs=2, max_steps=3), progress=False)
    assert res["steps"] == 3
    again = train(files / "model.yaml", tmp_path / "b", s, resume=True, progress=False)
    assert again["steps"] == full["steps"] == 6
    a, b = (_head_tensors(tmp_path / x) for x in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[{k: v for k, v in json.loads(line).items() if k != "time"}
             for line in (tmp_path / x / "metrics.jsonl").read_text().splitlines()] for x in "ab"]
    assert rows[0] == rows[1]
    # the data was not regenerated, and other settings are refused on resume
    with pytest.raises(ValueError, match="other settings.*lr"):
        train(files / "model.yaml", tmp_path / "b", _settings(files, lr=1e-2), resume=True, progress=False)


def _head_tensors(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def test_loss_decreases_on_tiny_set(files, tmp_path):
    res = train(files / "model.yaml", tmp_path / "o", _settings(files, num_prompts=2, batch_size=2, epochs=40,
                                                                 lr=3e-3, save_every=100), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert res["steps"] == 40
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"] and rows[-1]["acc"] > rows[0]["acc"]


def test_errors(files, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty; pass --resume"):
        train(files / "model.yaml", tmp_path / "busy", _settings(files), progress=False)
    with pytest.raises(ValueError, match="--batch-size 0"):
        train(files / "model.yaml", tmp_path / "n", _settings(files, batch_size=0), progress=False)
    with pytest.raises(ValueError, match="--prompts .*no such file"):
        train(files / "model.yaml", tmp_path / "n", _settings(files, prompts=str(tmp_path / "none.jsonl")),
              progress=False)
    (tmp_path / "bad.yaml").write_text(f"target: {tmp_path / 'nowhere'}\n")
    with pytest.raises(ValueError, match="target"):
        train(tmp_path / "bad.yaml", tmp_path / "n2", _settings(files), progress=False)


def test_overlap_filter():
    ev = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
          "experiences and must-see attractions.", "What is 2+2?"]
    f = EvalFilter(ev)
    assert f.overlaps("compose an ENGAGING travel blog post about a recent trip to Hawaii!")  # 8-word run
    assert f.overlaps("what is 2 + 2")            # short prompt: normalized equality
    assert f.overlaps("Quick question: what is 2+2? Thanks")  # containment
    assert not f.overlaps("Write a travel blog post about Japan.")
    assert not f.overlaps("What is 2+3?")
    assert overlaps("what is 2+2", ev) and not overlaps("", ev)


def test_self_generated_prompts(files, base):
    flt = EvalFilter(["Write one line about the sea."])
    got = self_generated_prompts(base, 3, seed=5, max_tokens=16, exclude=flt, max_attempts=400)
    again = self_generated_prompts(base, 3, seed=5, max_tokens=16, exclude=flt, max_attempts=400)
    assert [p.text for p in got] == [p.text for p in again]  # seeded
    assert len({p.text for p in got}) == 3 and all(p.chat for p in got)
    with pytest.raises(ValueError, match="usable questions"):
        self_generated_prompts(base, 50, seed=5, max_tokens=4, max_attempts=4)


def test_draft_vocabulary():
    from specc.train_data import Sequence
    seqs = [Sequence(torch.tensor([9, 9, 5, 5, 5, 7]), torch.zeros(6, 1, 2), 2)]
    d2t, t2d = draft_vocabulary(seqs, 3, 10)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [0, 5, 7] and t2d.nonzero().flatten().tolist() == [0, 5, 7]


def test_cli_end_to_end(files, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["train", "--target", str(files / "model.yaml"), "--out", str(out), "--prompts",
            str(files / "prompts.jsonl"), "--num-prompts", "3", "--max-tokens", "6", "--batch-size", "2",
            "--epochs", "2", "--no-progress"]
    assert main(argv + ["--max-steps", "2"]) == 0
    assert "after 2/4 steps" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "loss.png").is_file()
    assert main(argv) == 2 and "not empty; pass --resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0  # runs on to the end of the schedule
    assert "after 4/4 steps" in capsys.readouterr().out


def test_head_layers():
    from specc.train import head_layers
    assert head_layers("eagle", 30) == ([30], [])
    assert head_layers("eagle3", 30) == ([2, 15, 27, 30], [2, 15, 27])  # vLLM's default + L for the targets
    assert head_layers("eagle3", 2, [2, 0, 1]) == ([0, 1, 2], [0, 1, 2])  # L among them: not twice
    with pytest.raises(ValueError, match="distinct ids in"):
        head_layers("eagle3", 2, [0, 0, 1])
