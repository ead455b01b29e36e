"""The compiled EAGLE path: ``spec_step`` runs the head's catch-up, its k chain steps, the
verify and accept/reject as one program; ``prefill`` also runs the head's prompt pass.

One artifact for the module: the tiny Llama (2 layers) with a random "echo" EAGLE head
(:func:`eagle_checkpoints.write_echo_eagle_checkpoint`: its drafts are accepted at times,
at both positions, so catch-ups over several pairs run; written per module, so one test
can change its weights), k = 2, buckets {1, 2},
max_num_seqs 2: ``prefill``, ``decode_b{1,2}`` and ``spec_step_b{1,2}``, the head's KV
cache and feature buffer as program state. Checked:

* greedy output equals non-speculative greedy and the eager EAGLE session token for
  token, with the same acceptance counts per position (so the in-program drafts are the
  eager head's), for one row, two rows, and five requests through two slots (admitted as
  others finish: slot moves, batches that change composition and bucket);
* seeded sampled requests give the eager EAGLE session's tokens, alone and batched;
* padding rows are inert (no real KV, head KV or feature entry written, outputs -1 / 0);
* the artifact opens without tracing or compiling; the head's weights are part of what it
  is checked against (another head: refused as stale; another compile-cache key);
* EAGLE-3 compiles from the same code (bucket {1}): greedy equals the eager EAGLE-3 session.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle_checkpoints import write_echo_eagle_checkpoint
from helpers import drafter_spec, forbid_compiling, greedy, make_session, spec_counts
from specc import SamplingParams, Session
from specc.artifact import ArtifactError
from specc.compiler import compile_artifact
from specc.runtime.drafters.in_graph import InGraphDrafter
from specc.runtime.replay import CompiledEngine
from test_compiled import _assert_same, _params, pool  # noqa: F401  (pool is a fixture)

K = 2
BUCKETS = [1, 2]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory):
    """An echo EAGLE head for the tiny Llama (a test rewrites its weights, then restores them)."""
    from transformers import AutoConfig

    from specc.models.llama import ModelConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_llama_dir))
    return write_echo_eagle_checkpoint(tmp_path_factory.mktemp("head") / "echo", config)


def _config(target, head, method="eagle", buckets=BUCKETS, **spec) -> dict:
    return dict(target=str(target), max_model_len=MAX_MODEL_LEN, max_num_seqs=len(buckets) and max(buckets),
                batch_buckets=buckets, speculative_config=drafter_spec(method, K, head, **spec))


@pytest.fixture(scope="module")
def artifact(tiny_llama_dir, head_dir, tmp_path_factory):
    return compile_artifact(_config(tiny_llama_dir, head_dir), tmp_path_factory.mktemp("art_eagle") / "build",
                            progress=False)


@pytest.fixture(scope="module")
def compiled(artifact) -> Session:
    return Session(str(artifact), verbose=False)


@pytest.fixture(scope="module")
def eager(tiny_llama_dir, head_dir) -> Session:
    return make_session(tiny_llama_dir, drafter_spec("eagle", K, head_dir), max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=2, batch_buckets=BUCKETS)


# ------------------------------------------------------------------------------ the artifact
def test_manifest_plans_eagle_programs(artifact, head_dir):
    from specc.artifact import draft_hash

    m = json.loads((artifact / "manifest.json").read_text())
    assert m["draft_hash"] == draft_hash(head_dir)
    by_kind = {}
    for p in m["programs"]:
        by_kind.setdefault(p["kind"], []).append(p)
    assert [p["name"] for p in by_kind["spec_step"]] == [f"spec_step_b{b}" for b in BUCKETS]
    for p in by_kind["spec_step"] + by_kind["prefill"]:
        shapes = {i["name"]: i["shape"] for i in p["inputs"]}
        assert p["drafter"] == "eagle" and shapes["features"] == [p["batch"], MAX_MODEL_LEN + 1, 64]
        assert {"head_kv_0", "head_kv_1"} <= set(shapes) and "head_kv_2" not in shapes
    for p in by_kind["spec_step"]:
        shapes = {i["name"]: i["shape"] for i in p["inputs"]}
        assert shapes["input_ids"] == [p["batch"], 1] and shapes["pair_ids"] == [p["batch"], K + 1]
        assert shapes["pair_positions"] == [p["batch"], K + 1] and "num_rows" in shapes
    assert all("drafter" not in p for p in by_kind["decode"])


def test_opening_does_not_trace_or_compile(artifact, monkeypatch, pool):  # noqa: F811
    forbid_compiling(monkeypatch)
    s = Session(str(artifact), verbose=False)
    assert isinstance(s.engine, CompiledEngine) and isinstance(s.proposer, InGraphDrafter)
    assert s.proposer.state is s.draft_state is s.engine.draft_state is s.baseline_engine.draft_state
    assert s.programs.drafts_in_graph and s.programs.k == K
    out = s.generate([pool[0][0]], greedy(5))[0]
    assert out.finish_reason == "length" and out.metrics.spec.num_drafts > 0


# ------------------------------------------------------------------------------ compiled == eager
@pytest.mark.parametrize("rows", [[0], [2, 4], [0, 1, 2, 3, 5]])
def test_greedy_equals_eager(rows, compiled, eager, pool):  # noqa: F811
    """Bucket 1, bucket 2 (rows finish at different steps: 2 -> 1), and five requests
    through two slots (admitted as others finish; the last slot's request moves into the
    freed one). Same tokens as non-speculative decoding, and the same drafts accepted per
    position as the eager EAGLE proposer."""
    prompts, params = [pool[i][0] for i in rows], [_params(pool[i][1] + 6) for i in rows]
    outs = compiled.generate(prompts, params)
    eager_outs = eager.generate(prompts, params)
    _assert_same(outs, eager_outs)
    refs = [eager.generate([p], q, use_speculation=False)[0] for p, q in zip(prompts, params)]
    _assert_same(outs, refs)
    assert spec_counts(outs) == spec_counts(eager_outs)
    assert sum(o.metrics.spec.num_drafts for o in outs) > 0
    if len(rows) > 1:  # drafts accepted at both positions: catch-ups of 2 and 3 pairs ran
        assert all(sum(o.metrics.spec.accepted_per_position[i] for o in outs) > 0 for i in range(K))


def test_baseline_on_compiled_programs(compiled, eager, pool):  # noqa: F811
    """use_speculation=False on an EAGLE artifact: its prefill (with the head's prompt
    pass) and decode programs give the eager non-speculative tokens."""
    prompts, params = [pool[2][0], pool[4][0]], [_params(pool[2][1]), _params(pool[4][1])]
    _assert_same(compiled.generate(prompts, params, use_speculation=False),
                 eager.generate(prompts, params, use_speculation=False))


SAMPLED = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=12),
           SamplingParams(temperature=1.0, seed=11, max_tokens=12, logprobs=2)]


def test_seeded_sampling_equals_eager(compiled, eager, pool):  # noqa: F811
    """Sampled drafts come from uniforms[:, :k] of the same per-request stream on both
    paths, so seeded requests give the eager tokens, alone (bucket 1) and batched with a
    greedy neighbour (bucket 2)."""
    for p, params in zip([pool[0][0], pool[2][0]], SAMPLED):
        alone = compiled.generate([p], params)[0]
        assert alone.token_ids == eager.generate([p], params)[0].token_ids
    batch, bparams = [pool[4][0], pool[1][0], pool[3][0]], [SAMPLED[1], greedy(6), SAMPLED[0]]
    outs = compiled.generate(batch, bparams)
    eager_outs = eager.generate(batch, bparams)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager_outs]
    for lp, rl in zip(outs[0].logprobs, eager_outs[0].logprobs):
        assert lp.token_id == rl.token_id and abs(lp.logprob - rl.logprob) < 1e-4


# ------------------------------------------------------------------------------ padding rows
def test_padded_rows_are_inert(compiled):
    """spec_step_b2 with 1 real row: row 1 carries garbage ids and real-looking positions
    and pairs, yet writes no KV, head-KV or feature entry but the trash position, and
    returns -1 / 0; row 0 gives what spec_step_b1 gives for it."""
    progs, S = compiled.programs, MAX_MODEL_LEN
    state = {n: torch.randn(2, *shape[1:]) for n, (shape, _) in progs.state_signature.items()}
    state.update({f"kv_{i}": torch.randn(2, *t.shape[1:])
                  for i, t in enumerate(x for pair in zip(compiled.kv_cache.k, compiled.kv_cache.v) for x in pair)})
    one = {n: t[:1].clone() for n, t in state.items()}
    before = {n: t.clone() for n, t in state.items()}
    start = 20
    pos = torch.arange(start, start + K + 1).repeat(2, 1)
    values = dict(input_ids=torch.tensor([[5], [10 ** 9]]), positions=pos, key_positions=torch.arange(64),
                  num_draft_tokens=torch.full((2,), K), uniforms=torch.rand(2, 2 * K + 1),
                  temperature=torch.tensor([0.0, 1.0]), top_k=torch.zeros(2, dtype=torch.long), top_p=torch.ones(2),
                  pair_ids=torch.tensor([[7, 0, 0], [-1, 10 ** 9, 3]]),
                  pair_positions=torch.tensor([[start - 1, S, S], [start - 1, start, S]]), num_rows=torch.tensor(1))

    def run(prog, st, rows):
        return prog.runner(*[st[n] if n in st else values[n] if n in ("num_rows", "key_positions")
                             else values[n][:rows] for n in prog.inputs])

    out2, out1 = run(progs.spec_step[2], state, 2), run(progs.spec_step[1], one, 1)
    assert (out2[0][1:] == -1).all() and (out2[1][1:] == 0).all()
    assert torch.equal(out2[0][:1], out1[0]) and torch.equal(out2[1][:1], out1[1])
    for n, t in state.items():
        pos_dim = 1 if n == "features" else 2
        real = t[1:].narrow(pos_dim, 0, S)
        assert torch.equal(real, before[n][1:].narrow(pos_dim, 0, S)), n  # padding row: only the trash position
        assert not torch.equal(t[:1].narrow(pos_dim, start, 1), before[n][:1].narrow(pos_dim, start, 1)), n


# ------------------------------------------------------------------------------ the head is checked
def test_another_head_is_refused(artifact, head_dir, tiny_llama_dir):
    """The head's weights are part of the artifact's identity: changed weights in its
    folder make the artifact stale, and a config naming another head gets another
    compile-cache key."""
    from specc.artifact import compiled_cache_key, draft_hash
    from specc.config import load_config

    weights = head_dir / "model.safetensors"
    saved = weights.read_bytes()
    from safetensors.torch import load_file, save_file

    sd = load_file(str(weights))
    sd["fc.weight"] = sd["fc.weight"] + 0.01
    try:
        save_file(sd, str(weights))
        with pytest.raises(ArtifactError, match="another EAGLE head"):
            Session(str(artifact), verbose=False)
    finally:
        weights.write_bytes(saved)
    cfg = load_config(_config(tiny_llama_dir, head_dir)).to_dict()
    other = draft_hash(tiny_llama_dir)  # any other folder's hash stands for another head
    assert compiled_cache_key(cfg, "w", "m", draft_hash(head_dir)) != compiled_cache_key(cfg, "w", "m", other)
    assert compiled_cache_key(cfg, "w", "m", draft_hash(head_dir)) != compiled_cache_key(cfg, "w", "m")


# ------------------------------------------------------------------------------ EAGLE-3
@pytest.mark.slow  # a second artifact (~2 min); EAGLE-3 shares EagleStepProgram with EAGLE, tested above
def test_eagle3_compiled_equals_eager(tiny_llama_dir, tiny_eagle_heads, tmp_path, pool):  # noqa: F811
    """The same programs with an EAGLE-3 head (three fused target layers, its own reduced
    vocabulary): greedy output and acceptance counts equal the eager EAGLE-3 session's."""
    head = tiny_eagle_heads["eagle3"]
    art = compile_artifact(_config(tiny_llama_dir, head, "eagle3", buckets=[1]), tmp_path / "e3", progress=False)
    s = Session(str(art), verbose=False)
    eager3 = make_session(tiny_llama_dir, drafter_spec("eagle3", K, head), max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=1, batch_buckets=[1])
    prompts, params = [pool[0][0], pool[2][0]], [_params(10), _params(8)]
    outs, eager_outs = s.generate(prompts, params), eager3.generate(prompts, params)
    _assert_same(outs, eager_outs)
    assert spec_counts(outs) == spec_counts(eager_outs)
    assert sum(o.metrics.spec.num_drafts for o in outs) > 0


# ------------------------------------------------------------------------------ catch-up pairs
def test_catch_up_pairs_fixed_width():
    """A compiled step's catch-up is k + 1 pairs wide: rows with fewer pending pairs are
    padded at the trash position, a row further behind (one that will draft no more)
    keeps its last k + 1; ``done`` advances to ``num_computed``; slot0 offsets the slots."""
    from types import SimpleNamespace

    from specc.models.kv_cache import KVCache
    from specc.runtime.drafters.eagle import EagleState

    state = EagleState(KVCache(1, 3, 1, 16, 4), 8)
    state.done = [5, 1, 2]
    reqs = [SimpleNamespace(num_computed=n, all_token_ids=list(range(100, 112))) for n in (2, 10)]
    ids, pos, last = state.catch_up_pairs(reqs, slot0=1, width=3)
    assert pos.tolist() == [[1, 16, 16], [7, 8, 9]] and last.tolist() == [0, 2]
    assert ids[0, :1].tolist() == [102] and ids[1].tolist() == [108, 109, 110]
    assert state.done == [5, 2, 10]
    state.done = [0, 1, 2]
    ids, pos, last = state.catch_up_pairs(reqs, slot0=1)  # eager: as wide as the most behind row
    assert pos.shape == (2, 8) and last.tolist() == [0, 7]
