"""The fused draft-then-verify program: a compiled early-exit session against the eager one.

One artifact for the module: the tiny Llama (2 layers) with an early-exit drafter of
``num_draft_layers: 1``, k = 3, buckets {1, 2, 4}: ``prefill``, ``decode_b{1,2,4}`` and
``spec_step_b{1,2,4}``, each ``spec_step`` drafting inside the program
(:class:`specc.runtime.programs.EarlyExitStepProgram` + accept/reject with the drafter's q
+ bucket padding). Checked:

* greedy output equals non-speculative greedy and the eager early-exit session token
  for token, with the same acceptance counts (so the in-program drafts are the eager
  drafter's), for live batches of every bucket and a padded one (3 -> 4);
* seeded sampled requests give the eager early-exit session's tokens (the drafter's
  uniforms are the same columns of the same per-request stream), alone and batched;
* padding rows are inert (no real KV entry written, outputs -1 / 0);
* the artifact opens without tracing or compiling, with the in-graph stand-in proposer;
  host proposers and separate draft models are refused with a message.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import drafter_spec, forbid_compiling, greedy, make_session, spec_counts
from specc import SamplingParams, Session
from specc.compiler import check_compilable, compile_artifact
from specc.config import ConfigError, load_config
from specc.runtime.drafters.in_graph import InGraphDrafter
from specc.runtime.replay import CompiledEngine, cache_slots
from test_compiled import _assert_same, _params, pool  # noqa: F401  (pool is a fixture)

K = 3
BUCKETS = [1, 2, 4]
MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def artifact(tiny_llama_dir, tmp_path_factory):
    cfg = dict(target=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=4, batch_buckets=BUCKETS,
               speculative_config=drafter_spec("early_exit", K))
    return compile_artifact(cfg, tmp_path_factory.mktemp("art_ee") / "build", progress=False)


@pytest.fixture(scope="module")
def compiled(artifact) -> Session:
    return Session(str(artifact), verbose=False)


@pytest.fixture(scope="module")
def eager(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, drafter_spec("early_exit", K), max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=4, batch_buckets=BUCKETS)


@pytest.fixture(scope="module")
def reference(eager, pool):  # noqa: F811
    """Each request alone on the eager path without speculation."""
    return [eager.generate([p], _params(m), use_speculation=False)[0] for p, m in pool]


# ------------------------------------------------------------------------------ the artifact
def test_manifest_plans_fused_spec_steps(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    steps = [p for p in m["programs"] if p["kind"] == "spec_step"]
    assert [p["name"] for p in steps] == [f"spec_step_b{b}" for b in BUCKETS]
    for p in steps:
        shapes = {i["name"]: i["shape"] for i in p["inputs"]}
        assert p["draft_layers"] == 1 and p["tokens"] == K + 1
        assert shapes["input_ids"] == [p["batch"], 1] and shapes["positions"] == [p["batch"], K + 1]
        assert shapes["uniforms"] == [p["batch"], 2 * K + 1] and "num_rows" in shapes


def test_opening_does_not_trace_or_compile(artifact, monkeypatch, pool):  # noqa: F811
    forbid_compiling(monkeypatch)
    s = Session(str(artifact), verbose=False)
    assert isinstance(s.engine, CompiledEngine) and isinstance(s.proposer, InGraphDrafter)
    assert s.programs.drafts_in_graph and s.programs.k == K
    out = s.generate([pool[0][0]], greedy(5))[0]
    assert out.finish_reason == "length" and out.metrics.spec.num_drafts > 0


# ------------------------------------------------------------------------------ compiled == eager
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_greedy_equals_eager_in_every_bucket(n, compiled, eager, pool, reference):  # noqa: F811
    """n live rows: bucket n, or a padded one (3 -> 4); rows finish at different steps, so
    the batch crosses buckets on the way down. Same tokens as non-speculative decoding,
    and the same drafts accepted as the eager early-exit drafter."""
    prompts, params = [p for p, _ in pool[:n]], [_params(m) for _, m in pool[:n]]
    outs = compiled.generate(prompts, params)
    _assert_same(outs, reference[:n])
    eager_outs = eager.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager_outs]
    assert spec_counts(outs) == spec_counts(eager_outs)
    assert sum(o.metrics.spec.num_drafts for o in outs) > 0


def test_drafts_are_accepted(compiled, eager, pool):  # noqa: F811
    """The whole pool batched: some early-exit drafts are accepted (the tiny model's first
    layer agrees with both at times), so acceptance paths are exercised, and the counts
    per position are the eager drafter's."""
    prompts, params = [p for p, _ in pool[:4]], [greedy(24) for _ in pool[:4]]
    outs = compiled.generate(prompts, params)
    eager_outs = eager.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager_outs]
    assert spec_counts(outs) == spec_counts(eager_outs)
    assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0


SAMPLED = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=12),
           SamplingParams(temperature=1.0, seed=11, max_tokens=12),
           SamplingParams(temperature=0.6, top_p=0.8, seed=3, max_tokens=12, logprobs=2)]


def test_seeded_sampling_equals_eager(compiled, eager, pool):  # noqa: F811
    """Sampled drafts come from uniforms[:, :k] of the same per-request stream on both
    paths, so seeded requests give the eager tokens, alone (bucket 1) and batched (bucket
    4, with a greedy neighbour); reproducible across calls."""
    prompts = [pool[0][0], pool[2][0], pool[4][0]]
    for p, params in zip(prompts, SAMPLED):
        alone = compiled.generate([p], params)[0]
        assert alone.token_ids == eager.generate([p], params)[0].token_ids
        assert alone.token_ids == compiled.generate([p], params)[0].token_ids
    batch, bparams = prompts + [pool[1][0]], SAMPLED + [greedy(6)]
    outs = compiled.generate(batch, bparams)
    eager_outs = eager.generate(batch, bparams)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager_outs]
    assert all(len(o.token_ids) == 12 for o in outs[:3])
    for lp, rl in zip(outs[2].logprobs, eager_outs[2].logprobs):
        assert lp.token_id == rl.token_id and abs(lp.logprob - rl.logprob) < 1e-4


# ------------------------------------------------------------------------------ padding rows
def test_padded_rows_are_inert(compiled):
    """spec_step_b4 with 1 real row: rows 1..3 carry garbage ids and real-looking
    positions, yet write no cache entry but the trash position, and return -1 / 0; row 0
    gives what spec_step_b1 gives for it."""
    progs, S = compiled.programs, MAX_MODEL_LEN
    kv4 = [torch.randn(4, *t.shape[1:]) for t in compiled.kv_cache.k for _ in (0, 1)]
    kv1 = [t[:1].clone() for t in kv4]
    before = [t.clone() for t in kv4]
    start = 20
    pos = torch.arange(start, start + K + 1).repeat(4, 1)
    values = dict(input_ids=torch.tensor([[5], [-1], [10 ** 9], [7]]), positions=pos,
                  key_positions=torch.arange(64), num_draft_tokens=torch.full((4,), K),
                  uniforms=torch.rand(4, 2 * K + 1), temperature=torch.tensor([0.0, 1.0, 0.0, 0.5]),
                  top_k=torch.zeros(4, dtype=torch.long), top_p=torch.ones(4), num_rows=torch.tensor(1))

    def run(prog, kv, rows):
        it = iter(kv)
        return prog.runner(*[next(it) if n.startswith("kv_") else values[n] if n in ("num_rows", "key_positions")
                             else values[n][:rows] for n in prog.inputs])

    out4, out1 = run(progs.spec_step[4], kv4, 4), run(progs.spec_step[1], kv1, 1)
    assert (out4[0][1:] == -1).all() and (out4[1][1:] == 0).all()
    assert torch.equal(out4[0][:1], out1[0]) and torch.equal(out4[1][:1], out1[1])
    for t, t0 in zip(kv4, before):
        assert torch.equal(t[1:, :, :S], t0[1:, :, :S])  # padding rows: only the trash position changed
        assert not torch.equal(t[:1, :, start:start + K + 1], t0[:1, :, start:start + K + 1])


# ------------------------------------------------------------------------------ refused
def test_host_proposer_refused_on_fused_programs(compiled):
    from specc.runtime.drafters.ngram import NgramDrafter

    cache = compiled._allocate_cache(cache_slots(2, BUCKETS), None)
    with pytest.raises(ValueError, match="drafts inside the program"):
        CompiledEngine(compiled.programs, cache, compiled._detokenize, NgramDrafter(K, 1, 4), 2)


def test_separate_draft_model_not_compilable(tiny_llama_dir):
    check_compilable(load_config({"target": "x", "speculative_config": drafter_spec("early_exit", K)}))
    cfg = load_config({"target": "x", "speculative_config": drafter_spec("draft_model", K, tiny_llama_dir)})
    with pytest.raises(ConfigError, match="separate draft model.*enforce_eager"):
        check_compilable(cfg)


def test_num_draft_layers_is_a_program_field(tiny_llama_dir):
    """An artifact is built for one N: another N is a stale artifact; configs without
    early exit keep the program fields (and compile-cache keys) they had."""
    from specc.artifact import program_config, program_config_diff

    one = load_config({"target": "x", "speculative_config": drafter_spec("early_exit", K)}).to_dict()
    two = load_config({"target": "x", "speculative_config": drafter_spec("early_exit", K, num_draft_layers=2)})
    assert program_config_diff(one, two.to_dict())[0].startswith("speculative_config:")
    ngram = load_config({"target": "x", "speculative_config": drafter_spec("ngram", K)}).to_dict()
    assert program_config(ngram)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": K}
