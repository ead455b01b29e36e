"""The compiled tree step (``tree_step_b{b}``) against the eager tree step.

One artifact for the module: the tiny Llama, suffix decoding with
``suffix_decoding_propose_tree``, k = 4, buckets {1, 4} (prefill, decode, spec_step and
tree_step for each bucket). Checked:

* one tree step, compiled (``CompiledEngine._verify_tree`` → ``tree_step_b4`` with 3 real
  rows and a padded one) equals the eager step (``Engine._verify_tree``): tokens, counts,
  accepted paths, logprobs (1e-4), and the whole cache afterwards (the accepted path's
  K/V compacted; the padded row's slot untouched but for the trash position), on trees
  whose accepted path leaves the first children, a row with padded nodes, greedy and
  sampled rows with top-k / top-p;
* a compiled suffix-tree session equals non-speculative greedy decoding, over batches of
  1-4 rows (buckets 1 and 4, padded rows), with branching trees proposed and accepted;
* seeded sampled requests give the eager tree session's tokens;
* the manifest lists the tree programs and their inputs; ``suffix_decoding_propose_tree``
  is a program field (an artifact built without tree programs is not reused for it).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from helpers import drafter_spec, greedy, make_session, patched
from specc import SamplingParams, Session
from specc.artifact import program_config_diff
from specc.compiler import compile_artifact
from specc.config import load_config
from specc.models.kv_cache import KVCache
from specc.passes.tree_mask import tree_attention_inputs
from specc.runtime.drafters.base import StepBatch
from specc.runtime.engine import Engine
from specc.runtime.replay import CompiledEngine
from specc.runtime.token_tree import TokenTree
from test_tree_speculation import BRANCHY, PROMPTS

K = 4
BUCKETS = [1, 4]
MAX_MODEL_LEN = 160
TREE_SPEC = drafter_spec("suffix", K, suffix_decoding_propose_tree=True)


def _config(model_dir) -> dict:
    return dict(target=str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=4, batch_buckets=BUCKETS,
                speculative_config=TREE_SPEC)


@pytest.fixture(scope="module")
def compiled(tiny_llama_dir, tmp_path_factory) -> Session:
    """The module's artifact (compiled once: 7 programs), opened."""
    out = tmp_path_factory.mktemp("art") / "build"
    return Session(str(compile_artifact(_config(tiny_llama_dir), out, progress=False)), verbose=False)


@pytest.fixture(scope="module")
def eager(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, TREE_SPEC, max_model_len=MAX_MODEL_LEN, batch_buckets=BUCKETS)


def test_manifest_lists_tree_programs(compiled, tiny_llama_dir):
    m = json.loads((compiled.artifact.root / "manifest.json").read_text())
    trees = {p["name"]: p for p in m["programs"] if p["kind"] == "tree_step"}
    assert set(trees) == {"tree_step_b1", "tree_step_b4"}
    shapes = {i["name"]: i["shape"] for i in trees["tree_step_b4"]["inputs"]}
    assert shapes["input_ids"] == [4, K + 1] and shapes["parents"] == [4, K] and shapes["start"] == [4]
    assert shapes["uniforms"] == [4, 2 * K + 1] and shapes["num_rows"] == []
    chains = dict(_config(tiny_llama_dir), speculative_config=drafter_spec("suffix", K))
    diff = program_config_diff(m["config"], load_config(chains).to_dict())
    assert len(diff) == 1 and "suffix_decoding_propose_tree" in diff[0]


# ------------------------------------------------------------------------------ one tree step
# per row: parents of nodes 1..4, nodes whose token is the target's argmax at their
# parent (the rest get another token), number of drafts, root position
TREES = [
    ([0, 0, 2, 2], {2, 4}, 4, 20),  # greedy path 2 -> 4: the second child, then the second child
    ([0, 1, 0, 3], {3, 4}, 4, 35),  # path 3 -> 4
    ([0, 0, 0, 0], {2}, 2, 7),      # nodes 3, 4 are padding
]
SCENARIOS = {
    "greedy": (torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3)),
    "sampled": (torch.tensor([1.0, 0.8, 1.3]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.9])),
}


def _random_cache(model, seed: int) -> KVCache:
    cache = KVCache.for_model(model.config, BUCKETS[-1], MAX_MODEL_LEN)
    g = torch.Generator().manual_seed(seed)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def _tree_batch(model, cache: KVCache):
    """(rows, drafts [3, K], parents [3, K], nd [3]) for :data:`TREES`: a matching node's
    token is the target's argmax at its parent along its path (computed node by node)."""
    rows = len(TREES)
    parents = torch.tensor([p for p, *_ in TREES])
    nd = torch.tensor([n for _, _, n, _ in TREES])
    start = torch.tensor([s for *_, s in TREES])
    ids = torch.randint(0, model.config.vocab_size, (rows, K + 1), generator=torch.Generator().manual_seed(1))
    for i in range(K):
        kv_len = int((start + nd).max()) + 1
        tree = tree_attention_inputs(parents, nd, start, kv_len, cache.trash_pos)
        scratch = KVCache.for_model(model.config, rows, MAX_MODEL_LEN)
        for t, src in zip((*scratch.k, *scratch.v), (*cache.k, *cache.v)):
            t.copy_(src[:rows])
        logits = model(ids, tree.positions, scratch, kv_len=kv_len, attn_mask=tree.mask,
                       cache_positions=tree.cache_positions).logits
        for b, (par, matches, _, _) in enumerate(TREES):
            best = int(logits[b, par[i]].argmax())
            ids[b, i + 1] = best if i + 1 in matches else (best + 1 + i) % model.config.vocab_size
    running = [SimpleNamespace(last_token=int(ids[b, 0]), num_computed=int(start[b])) for b in range(rows)]
    return running, ids[:, 1:], parents, nd


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tree_step_equals_eager(scenario, compiled, eager):
    model = eager.target.model
    eager_cache, compiled_cache = _random_cache(model, 3), _random_cache(model, 3)
    before = [t.clone() for t in compiled_cache.k]
    running, drafts, parents, nd = _tree_batch(model, eager_cache)
    temperature, top_k, top_p = SCENARIOS[scenario]
    batch = StepBatch(running, temperature, top_k, top_p, temperature <= 0)
    uniforms = torch.rand(len(running), 2 * K + 1, generator=torch.Generator().manual_seed(2))

    ref_engine = Engine(model, eager_cache, str, None, max_num_seqs=3)
    engine = CompiledEngine(compiled.programs, compiled_cache, str, None, max_num_seqs=3)
    ref_engine.k = engine.k = K
    with patched(CompiledEngine, "_run_group", _expect_bucket(CompiledEngine._run_group, compiled, 4)):
        got = engine._verify_tree(running, batch, drafts, parents, nd, None, uniforms)
    want = ref_engine._verify_tree(running, batch, drafts, parents, nd, None, uniforms)

    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]
    if scenario == "greedy":
        assert got[3] == [[2, 4], [3, 4], [2]]  # paths off the first children
    for b, a in enumerate(want[1]):
        for x, y in zip(got[2](b, a + 1, 5), want[2](b, a + 1, 5)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    trash = compiled_cache.trash_pos
    for x, y in zip((*compiled_cache.k, *compiled_cache.v), (*eager_cache.k, *eager_cache.v)):
        torch.testing.assert_close(x[:, :, :trash], y[:, :, :trash], atol=1e-5, rtol=1e-5)
    for x, y in zip(compiled_cache.k, before):  # the padded row (slot 3) wrote only at the trash position
        assert torch.equal(x[3, :, :trash], y[3, :, :trash])


def _expect_bucket(run_group, session, bucket):
    """``_run_group`` that asserts the tree_step of ``bucket`` runs."""
    def wrapped(self, reqs, *args):
        assert next(b for b in session.programs.buckets if b >= len(reqs)) == bucket
        return run_group(self, reqs, *args)

    return wrapped


# ------------------------------------------------------------------------------ sessions
def test_suffix_tree_session_greedy_equals_nonspec(compiled, eager):
    proposals, trees = [], []
    orig_propose, orig_tree = compiled.proposer.propose, compiled.engine._verify_tree

    def propose(batch, max_drafts, uniforms):
        p = orig_propose(batch, max_drafts, uniforms)
        proposals.append(p)
        return p

    def verify_tree(*args):
        out = orig_tree(*args)
        trees.append(out[3])
        return out

    prompts = PROMPTS + BRANCHY
    with patched(compiled.proposer, "propose", propose), patched(compiled.engine, "_verify_tree", verify_tree):
        outs = compiled.generate(prompts, greedy(48, logprobs=2))
    want = eager.generate(prompts, greedy(48, logprobs=2), use_speculation=False)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for o, w in zip(outs, want):
        assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
    branching = [p for p in proposals if p.parents is not None and any(
        not TokenTree(tuple(row[:n].tolist())).is_chain for row, n in zip(p.parents, p.num_draft_tokens))]
    assert branching and trees, "no branching tree was verified by tree_step"
    assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0


def test_seeded_sampling_equals_eager_trees(compiled, tiny_llama_dir):
    """Per-request drafts only (no global tree, whose content depends on what ran
    before), so both sessions see the same trees and consume the same uniforms."""
    from specc.runtime.drafters.suffix import SuffixDrafter

    drafter = SuffixDrafter(K, max_cached_requests=0, propose_tree=True)
    fresh = Session(str(compiled.artifact.root), proposer=drafter, verbose=False)
    eager = make_session(tiny_llama_dir, dict(TREE_SPEC, suffix_decoding_max_cached_requests=0),
                         max_model_len=MAX_MODEL_LEN, batch_buckets=BUCKETS)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in range(3)]
    params.append(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=9, max_tokens=16))
    prompts = PROMPTS[:2] + BRANCHY[:2]
    a = fresh.generate(prompts, params)
    b = eager.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.metrics.tokens_per_step for o in a] == [o.metrics.tokens_per_step for o in b]
