"""Compiled programs (specc compile → artifact → Session(DIR)) against the eager path.

One artifact for the whole module: the tiny Llama, n-gram k = 4, buckets {1, 2, 4, 8}
(every program kind and every bucket: prefill, decode_b{1,2,4,8},
spec_step_b{1,2,4,8}). Checked:

* greedy output equals the eager non-speculative output token for token (logprobs to
  1e-4), for live batches of every bucket and between buckets (C5 in compiled mode), with
  requests admitted mid-generation (C4 in compiled mode), and for a batch larger than the
  largest bucket (split into groups);
* the artifact opens without tracing or compiling; truncated, modified and stale
  artifacts are refused with a message naming the problem; writing is atomic.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import drafter_spec, forbid_compiling, greedy, make_session
from specc import SamplingParams, Session
from specc.artifact import ArtifactError, open_artifact, program_config_diff, write_artifact
from specc.compiler import compile_artifact, plan_programs
from specc.config import load_config
from specc.runtime.replay import CompiledEngine, cache_slots, prefill_chunks

K = 4
BUCKETS = [1, 2, 4, 8]
MAX_MODEL_LEN = 160


def _config(model_dir) -> dict:
    return dict(target=str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=8, batch_buckets=BUCKETS,
                speculative_config=drafter_spec("ngram", K))


@pytest.fixture(scope="module")
def artifact(tiny_llama_dir, tmp_path_factory):
    return compile_artifact(_config(tiny_llama_dir), tmp_path_factory.mktemp("art") / "build", progress=False)


@pytest.fixture(scope="module")
def compiled(artifact) -> Session:
    return Session(str(artifact), verbose=False)


@pytest.fixture(scope="module")
def eager(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, drafter_spec("ngram", K), max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                        batch_buckets=BUCKETS)


@pytest.fixture(scope="module")
def pool(tiny_llama_dir):
    """Eight (prompt ids, max_tokens): lengths 1..90 (one and several prefill chunks),
    repetitive text so n-gram drafts are accepted, different max_tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok.encode(("One fish, two fish, red fish, blue fish. This one has a little star. "
                      "This one has a little car. Say, what a lot of fish there are. ") * 4)
    lengths = [17, 1, 60, 5, 90, 33, 9, 40]
    max_tokens = [10, 3, 12, 6, 9, 2, 11, 7]
    starts = [0, 7, 3, 40, 1, 21, 55, 12]
    return [(ids[s:s + n], m) for s, n, m in zip(starts, lengths, max_tokens)]


def _params(m: int) -> SamplingParams:
    return greedy(m, logprobs=2)


@pytest.fixture(scope="module")
def reference(eager, pool):
    """Each request alone on the eager path without speculation."""
    return [eager.generate([p], _params(m), use_speculation=False)[0] for p, m in pool]


def _assert_same(outs, refs):
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref.token_ids, i
        assert out.finish_reason == ref.finish_reason
        assert len(out.logprobs) == len(out.token_ids)
        for lp, rl in zip(out.logprobs, ref.logprobs):
            assert lp.token_id == rl.token_id and abs(lp.logprob - rl.logprob) < 1e-4
            assert [t for t, _ in lp.top] == [t for t, _ in rl.top]


# ------------------------------------------------------------------------------ the artifact
def test_manifest_lists_every_program_and_file(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    names = {p["name"] for p in m["programs"]}
    assert names == {"prefill", *(f"decode_b{b}" for b in BUCKETS),
                     *(f"spec_step_b{b}" for b in BUCKETS)}
    assert [p["name"] for p in m["programs"]] == [p["name"] for p in plan_programs(load_config(m["config"]))]
    for p in m["programs"]:
        assert (artifact / p["file"]).is_file() and p["compile_seconds"] > 0
        assert p["inputs"][0]["name"] == "input_ids"
    step = next(p for p in m["programs"] if p["name"] == "spec_step_b4")
    shapes = {i["name"]: i["shape"] for i in step["inputs"]}
    assert shapes["input_ids"] == [4, K + 1] and shapes["uniforms"] == [4, 2 * K + 1]
    assert set(m["files"]) >= {"weights.safetensors", "model/config.json", *(p["file"] for p in m["programs"])}
    assert m["environment"]["torch"] == torch.__version__
    assert not list(artifact.parent.glob(".build.tmp-*"))  # the temp folder was renamed


def test_opening_does_not_trace_or_compile(artifact, monkeypatch, pool):
    forbid_compiling(monkeypatch)
    s = Session(str(artifact), verbose=False)
    assert s.compiled and isinstance(s.engine, CompiledEngine)
    assert s.generate([pool[0][0]], greedy(3))[0].finish_reason == "length"


# ------------------------------------------------------------------------------ compiled == eager
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_greedy_equals_eager_in_every_bucket(n, compiled, pool, reference):
    """n live rows: bucket n, or a padded bucket between (3 → 4, 5 → 8); rows finish at
    different steps, so the batch also crosses buckets on the way down (C5)."""
    reqs = pool[:n]
    outs = compiled.generate([p for p, _ in reqs], [_params(m) for _, m in reqs])
    _assert_same(outs, reference[:n])
    if n >= 3:
        assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0


def test_suffix_drafter_on_the_same_programs(artifact, pool, reference):
    """A host drafter's tokens are spec_step inputs: the suffix drafter runs on the
    programs built for ngram, every bucket, and gives the eager output."""
    from specc.runtime.drafters.suffix import SuffixDrafter

    s = Session(str(artifact), proposer=SuffixDrafter(K), verbose=False)
    outs = s.generate([p for p, _ in pool], [_params(m) for _, m in pool])
    _assert_same(outs, reference)
    assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0
    assert s.proposer.num_live == 0 and len(s.proposer.global_tree) == len(pool)


def test_hidden_state_drafter_refused(compiled):
    """A proposer that needs target hidden states (EAGLE) cannot run on programs that do
    not return them: refused when the engine is built, not silently starved."""
    from specc.runtime.drafters.ngram import NgramDrafter

    class WantsHidden(NgramDrafter):
        hidden_layers = (1,)

    cache = compiled._allocate_cache(cache_slots(2, BUCKETS), None)
    with pytest.raises(ValueError, match="hidden states.*enforce_eager"):
        CompiledEngine(compiled.programs, cache, compiled._detokenize, WantsHidden(K, 1, 4), 2)


def test_non_speculative_programs_equal_eager(compiled, pool, reference):
    outs = compiled.generate([p for p, _ in pool], [_params(m) for _, m in pool], use_speculation=False)
    _assert_same(outs, reference)
    assert all(o.metrics.spec.num_drafts == 0 for o in outs)


def test_admitted_mid_generation_and_split_batches(compiled, pool, reference):
    """C4 in compiled mode: 2 slots, 8 requests admitted as slots free (some finish at
    once); then a live batch wider than the largest bucket, split into groups."""
    def engine_with(max_num_seqs):
        cache = compiled._allocate_cache(cache_slots(max_num_seqs, BUCKETS), None)
        return CompiledEngine(compiled.programs, cache, compiled._detokenize, compiled.proposer, max_num_seqs)

    old = compiled.engine
    try:
        compiled.engine = engine_with(2)
        _assert_same(compiled.generate([p for p, _ in pool], [_params(m) for _, m in pool]), reference)
        compiled.engine = engine_with(11)  # groups of 8 + 3 (padded to 4)
        reqs = (pool + pool)[:11]
        outs = compiled.generate([p for p, _ in reqs], [_params(m) for _, m in reqs])
        _assert_same(outs, (reference + reference)[:11])
    finally:
        compiled.engine = old


def test_seeded_sampling_is_reproducible(compiled, pool):
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=8),
              SamplingParams(temperature=1.0, seed=11, max_tokens=8)]
    prompts = [pool[0][0], pool[2][0]]
    a = compiled.generate(prompts, params)
    b = compiled.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 8 for o in a)


def test_seeded_request_identical_alone_and_batched(compiled):
    """C7 in compiled mode (temperature 2.0, k = 4), twelve seeds: alone (bucket 1) and
    batched with unseeded sampled neighbours (bucket 4), the seeded request's tokens are
    identical and its logprobs equal to 1e-4. Not bitwise: the batched call attends over
    the longest row's keys (kv_len) and runs another bucket's GEMMs, which round
    differently (~1e-6)."""
    from test_case_c07_seeds import OTHERS, PROMPT, SEEDED, _unseeded

    for seed in range(12):
        params = SamplingParams(**dict(SEEDED, seed=seed))
        alone = compiled.generate(PROMPT, params)[0]
        outs = compiled.generate([OTHERS[0], PROMPT, OTHERS[1], OTHERS[2]],
                                 [_unseeded(0), params, _unseeded(1), _unseeded(2)])
        assert outs[1].token_ids == alone.token_ids, seed
        assert [lp.logprob for lp in outs[1].logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs],
                                                                       abs=1e-4)


# ------------------------------------------------------------------------------ refused artifacts
def _copy(artifact, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(artifact, dst)
    return dst


def test_truncated_or_modified_artifact_is_refused(artifact, tmp_path):
    art = _copy(artifact, tmp_path)
    prog = art / "programs" / "decode_b1.pt2"
    data = prog.read_bytes()
    prog.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=r"programs/decode_b1.pt2 has \d+ bytes, the manifest says \d+ \(truncated\?\)"):
        open_artifact(art)
    prog.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        open_artifact(art)
    prog.write_bytes(data)
    (art / "manifest.json").write_text('{"format": 1, "progr')
    with pytest.raises(ArtifactError, match="unreadable manifest"):
        open_artifact(art)
    (art / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="no manifest.json: not a specc artifact"):
        Session(str(art), verbose=False)


@pytest.mark.parametrize("key, value, message", [
    ("torch", "2.0.0", r"torch: built with '2.0.0', this process has"),
    ("device_kind", "cuda/NVIDIA H200/sm_90", r"device_kind: built with 'cuda/NVIDIA H200/sm_90'"),
    ("transformers", "4.0.0", r"transformers: built with '4.0.0'"),
    ("specc_source", "0" * 16, r"specc_source: built with '0000000000000000'"),  # passes / model code changed
])
def test_stale_environment_is_refused(artifact, tmp_path, key, value, message):
    art = _copy(artifact, tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m["environment"][key] = value
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=message) as e:
        Session(str(art), verbose=False)
    assert "rebuild it: specc compile" in str(e.value)


@pytest.mark.parametrize("key, what", [("weights_hash", "weights"), ("model_hash", "config / tokenizer files")])
def test_changed_source_model_is_refused(artifact, tmp_path, key, what):
    art = _copy(artifact, tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m[key] = "0" * 64
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=f"the target's {what} in .* changed since the artifact was built"):
        Session(str(art), verbose=False)


@pytest.mark.parametrize("text, message", [
    ("[]", "not a specc manifest"),
    ('{"format": 1}', "manifest lacks config, environment, programs"),
    ('{"format": 99, "programs": []}', "artifact format 99, this specc reads format 1"),
])
def test_malformed_manifest_is_refused(artifact, tmp_path, text, message):
    art = _copy(artifact, tmp_path)
    (art / "manifest.json").write_text(text)
    with pytest.raises(ArtifactError, match=message):
        open_artifact(art)


def test_program_config_diff_names_the_fields(tiny_llama_dir):
    built = load_config(_config(tiny_llama_dir)).to_dict()
    other = dict(built, max_model_len=320, batch_buckets=[1, 2],
                 speculative_config=dict(built["speculative_config"], num_speculative_tokens=2),
                 seed=5, sampling=dict(built["sampling"], temperature=0.5))
    diff = program_config_diff(built, other)
    assert any(d.startswith("max_model_len: artifact has 160, config has 320") for d in diff)
    assert any(d.startswith("batch_buckets:") for d in diff)
    assert any(d.startswith("speculative_config:") for d in diff)
    assert len(diff) == 3  # seed and sampling defaults are run-time settings


def test_config_compiles_on_first_use_then_reuses(tiny_llama_dir, artifact, tmp_path, monkeypatch):
    """enforce_eager: false (the default): the first Session compiles into specc's cache,
    the second opens the cached artifact."""
    import specc.compiler

    monkeypatch.setenv("SPECC_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_compile(cfg, out, progress=True, target=None):  # the module's artifact stands in
        calls.append(out)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(artifact, out)
        return out

    monkeypatch.setattr(specc.compiler, "compile_artifact", fake_compile)
    cfg = _config(tiny_llama_dir)
    for _ in range(2):
        s = Session(cfg, verbose=False)
        assert s.compiled
    assert len(calls) == 1 and calls[0].parent == tmp_path / "cache" / "compiled"
    (calls[0] / "programs" / "decode_b1.pt2").write_bytes(b"truncated")  # a damaged cache entry is rebuilt
    assert Session(cfg, verbose=False).compiled and len(calls) == 2
    with pytest.raises(Exception, match="enforce_eager: true"):  # a separate draft model: eager only
        Session(dict(cfg, speculative_config=drafter_spec("draft_model", 2, tiny_llama_dir)), verbose=False)


def test_write_is_atomic(tmp_path):
    def failing(tmp):
        (tmp / "half.bin").write_bytes(b"x" * 10)
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError):
        write_artifact(tmp_path / "out", failing)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="exists and is not a specc artifact"):
        write_artifact(tmp_path / "file", lambda tmp: {})
    other = tmp_path / "webext"  # another tool's folder that happens to hold a manifest.json
    (other / "src").mkdir(parents=True)
    (other / "manifest.json").write_text('{"manifest_version": 3}')
    with pytest.raises(ArtifactError, match="exists and is not a specc artifact"):
        write_artifact(other, lambda tmp: {})
    assert (other / "src").is_dir()


def test_cli_generate_from_artifact(artifact, capsys):
    from specc.cli import main

    rc = main(["generate", str(artifact), "--prompt", "One fish, two fish", "--max-tokens", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "speed-up over non-speculative decoding" in out.out


# ------------------------------------------------------------------------------ host-side helpers
def test_prefill_chunks_and_cache_slots():
    assert prefill_chunks(1, 256) == [(1, 2)]
    assert prefill_chunks(300, 256) == [(256, 256), (44, 44)]
    assert prefill_chunks(257, 256) == [(256, 256), (1, 2)]
    assert prefill_chunks(256, 256) == [(256, 256)]
    assert sum(r for r, _ in prefill_chunks(1000, 160)) == 1000
    assert cache_slots(8, [1, 2, 4, 8]) == 8
    assert cache_slots(6, [1, 2, 4, 8]) == 8
    assert cache_slots(11, [1, 2, 4, 8]) == 12
    assert cache_slots(3, [2]) == 4
