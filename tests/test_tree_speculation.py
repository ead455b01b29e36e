"""Tree speculation on the eager engine (issue #6).

* greedy output equals non-speculative greedy with suffix-decoding trees
  (``suffix_decoding_propose_tree``), n-gram trees (``ngram_propose_tree``) and with a static tree (vLLM's
  ``speculative_token_tree`` format) filled by an oracle whose true token sits at a
  non-first child, so accepted paths leave the first-child chain and KV compaction moves
  entries; batches where every row has its own tree;
* after every tree step the cache at ``[0, num_computed)`` of every row equals what a
  plain causal forward over the request's tokens writes (compaction is right where the
  next steps read);
* a chain given as a tree verifies exactly as the chain path (tokens, seeded samples);
* tree configs plan a ``tree_step`` per bucket; an artifact without them refuses trees
  (the compiled tree step itself: ``test_compiled_tree.py``).
"""

from __future__ import annotations

import pytest
import torch

from helpers import drafter_spec, greedy, greedy_truth, make_session, oracle_table, patched
from specc import SamplingParams
from specc.compiler import check_compilable, plan_programs
from specc.config import load_config
from specc.models.kv_cache import KVCache
from specc.runtime.drafters.base import Proposal, Proposer, StepBatch
from specc.runtime.token_tree import TokenTree, parse_choices

K = 4
# true token at child rank 1 at depth 1, rank 0 below: the accepted path is nodes 2, 4, 6
CHOICES = [(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 0, 0)]
TRUE_RANK = {1: 1, 2: 0, 3: 0}

PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "one two three four one two three four one two",
    "Hello",
    "a b a b a c a b a b a c a b",
]
# token ids over a 3-token alphabet: most contexts have several continuations, so the
# suffix drafter's candidate trees branch
_G = torch.Generator().manual_seed(5)
BRANCHY = [(1000 + torch.randint(0, 3, (n,), generator=_G)).tolist() for n in (40, 25, 60)]


class StaticTreeOracle(Proposer):
    """Fills a static tree: below a node on the true path, the child of rank
    ``TRUE_RANK[depth]`` carries the true next token, its siblings wrong ones."""

    def __init__(self, choices, truth, vocab_size: int):
        self.tree = TokenTree.from_choices(choices)
        self.ranks = parse_choices(choices)  # node i + 1's rank path
        super().__init__(self.tree.num_drafts)
        self.truth, self.vocab = truth, vocab_size
        self.verified: list[list[list[int]]] = []

    def propose(self, batch: StepBatch, max_drafts, uniforms) -> Proposal:
        n_nodes = self.tree.num_drafts
        ids = torch.zeros(batch.size, n_nodes, dtype=torch.long)
        for b, req in enumerate(batch.requests):
            full = self.truth[tuple(req.prompt_token_ids)]
            done = len(req.output_token_ids)
            on_truth = {0: full[:done] == req.output_token_ids}
            for i, path in enumerate(self.ranks):
                node, parent, d = i + 1, self.tree.parents[i], len(path)
                true = full[done + d - 1] if done + d - 1 < len(full) else 0
                hit = on_truth[parent] and path[-1] == TRUE_RANK[d]
                on_truth[node] = hit
                ids[b, i] = true if hit else (true + 1 + path[-1]) % self.vocab
        parents = torch.tensor([self.tree.parents] * batch.size, dtype=torch.long)
        return Proposal(ids, torch.tensor([min(n_nodes, c) for c in max_drafts]), None, parents)

    def on_verified(self, batch, num_accepted, accepted_paths=None):
        self.verified.append(accepted_paths)


class ChainAsTree(Proposer):
    """Wraps a chain proposer and hands its chains over as trees (parents 0, 1, 2, ...)."""

    def __init__(self, inner: Proposer):
        super().__init__(inner.num_speculative_tokens)
        self.inner = inner

    def prefill(self, request, slot):
        self.inner.prefill(request, slot)

    def propose(self, batch, max_drafts, uniforms):
        p = self.inner.propose(batch, max_drafts, uniforms)
        return Proposal(p.draft_token_ids, p.num_draft_tokens, None,
                        torch.arange(p.width).repeat(batch.size, 1))

    def on_verified(self, batch, num_accepted, accepted_paths=None):
        assert accepted_paths == [list(range(1, a + 1)) for a in num_accepted]
        self.inner.on_verified(batch, num_accepted)

    def finish(self, request):
        self.inner.finish(request)


def _check_cache_after_steps(session):
    """Wrap the engine's step: afterwards every live row's K/V below num_computed must
    equal a fresh causal forward over its tokens (one slot, same weights)."""
    engine, model = session.engine, session.target.model
    orig = engine._step
    checked = []

    def step(running):
        orig(running)
        for slot, req in enumerate(running):
            if req.finished:
                continue
            n = req.num_computed
            ref = KVCache.for_model(model.config, 1, session.kv_cache.max_model_len)
            model(torch.tensor([req.all_token_ids[:n]]), torch.arange(n)[None], ref, kv_len=n)
            for got, want in zip((*engine.cache.k, *engine.cache.v), (*ref.k, *ref.v)):
                torch.testing.assert_close(got[slot, :, :n], want[0, :, :n], atol=2e-5, rtol=1e-4)
            checked.append(n)

    return patched(engine, "_step", step), checked


def test_static_tree_oracle_greedy_and_compaction(tiny_llama_dir, base):
    truth = greedy_truth(base, PROMPTS, 40)
    vocab = base.target.model.config.vocab_size
    drafter = StaticTreeOracle(CHOICES, oracle_table(truth), vocab)
    session = make_session(tiny_llama_dir, proposer=drafter)
    ctx, checked = _check_cache_after_steps(session)
    with ctx:
        outs = session.generate(PROMPTS, greedy(40))
    assert [o.token_ids for o in outs] == [t for _, t in truth]
    assert checked, "no tree step was checked"
    # every full step accepts the true path (nodes 2, 4, 6): 3 drafts + the bonus token
    paths = [p for step in drafter.verified for p in step if p]
    assert paths and all(p == [2, 4, 6][: len(p)] for p in paths)
    assert max(max(o.metrics.tokens_per_step) for o in outs) == 4


TREE_SPECS = {
    "suffix_own_trees": drafter_spec("suffix", K, suffix_decoding_propose_tree=True,
                                     suffix_decoding_max_cached_requests=0),
    "suffix_global_tree": drafter_spec("suffix", K, suffix_decoding_propose_tree=True,
                                       suffix_decoding_max_cached_requests=100),
    "ngram": drafter_spec("ngram", K, ngram_propose_tree=True),
}


@pytest.mark.parametrize("drafter", list(TREE_SPECS))
def test_tree_drafters_greedy_equal_nonspec(tiny_llama_dir, base, drafter):
    session = make_session(tiny_llama_dir, TREE_SPECS[drafter])
    proposals = []
    orig = session.proposer.propose

    def propose(batch, max_drafts, uniforms):
        p = orig(batch, max_drafts, uniforms)
        proposals.append(p)
        return p

    ctx, checked = _check_cache_after_steps(session)
    with ctx, patched(session.proposer, "propose", propose):
        outs = session.generate(PROMPTS + BRANCHY, greedy(48))
    want = base.generate(PROMPTS + BRANCHY, greedy(48), use_speculation=False)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    branching = [p for p in proposals if p.parents is not None and any(
        not TokenTree(tuple(row[:n].tolist())).is_chain for row, n in zip(p.parents, p.num_draft_tokens))]
    assert branching, f"the {drafter} drafter proposed no branching tree"
    assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("params", [greedy(32), SamplingParams(temperature=1.0, max_tokens=32, seed=7)])
def test_chain_as_tree_is_identical(tiny_llama_dir, params):
    spec = drafter_spec("ngram", K)
    chain = make_session(tiny_llama_dir, spec)
    tree = make_session(tiny_llama_dir, spec)
    tree.engine.proposer = tree.proposer = ChainAsTree(tree.proposer)
    params = [params] * len(PROMPTS)
    a, b = chain.generate(PROMPTS, params), tree.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.metrics.tokens_per_step for o in a] == [o.metrics.tokens_per_step for o in b]


@pytest.mark.parametrize("method,field", [("suffix", "suffix_decoding_propose_tree"),
                                          ("ngram", "ngram_propose_tree")])
def test_tree_configs_plan_tree_steps(method, field):
    """A tree switch: a tree_step per bucket beside the chain programs; chain configs
    plan none."""
    tree_spec = drafter_spec(method, K, **{field: True})
    plan = plan_programs(load_config({"target": "x", "batch_buckets": [1, 4], "speculative_config": tree_spec}))
    check_compilable(load_config({"target": "x", "speculative_config": tree_spec}))
    trees = [p for p in plan if p["kind"] == "tree_step"]
    assert [(p["name"], p["batch"], p["tokens"]) for p in trees] == [("tree_step_b1", 1, K + 1),
                                                                      ("tree_step_b4", 4, K + 1)]
    chain = plan_programs(load_config({"target": "x", "speculative_config": drafter_spec(method, K)}))
    assert not [p for p in chain if p["kind"] == "tree_step"]


def test_suffix_drafter_proposes_its_candidate_tree():
    from specc.runtime.drafters.suffix import SuffixDrafter
    from specc.runtime.request import Request
    from specc.runtime.drafters.suffix_tree import SuffixTree

    prompt = [1, 2, 3, 1, 2, 4, 1, 2]  # after "1 2": 3 or 4 (1/3 each; the last "1 2" has no next)
    req = Request(0, "", prompt, SamplingParams(max_tokens=100), torch.Generator(), frozenset(), 4096)
    batch = StepBatch([req], torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                      torch.ones(1, dtype=torch.bool))
    d = SuffixDrafter(K, max_tree_depth=8, max_cached_requests=0, max_spec_factor=2.0, propose_tree=True)
    d.prefill(req, 0)
    prop = d.propose(batch, [K], torch.zeros(1, K))
    ref = SuffixTree(8)
    ref.extend(0, prompt)
    cand = ref.speculate(prompt, K, 2.0, 0.1, tree=True)
    n = int(prop.num_draft_tokens[0])
    assert n == len(cand) and prop.draft_token_ids[0, :n].tolist() == cand.token_ids
    assert prop.parents[0, :n].tolist() == [p + 1 for p in cand.parents]
    assert not TokenTree(tuple(prop.parents[0, :n].tolist())).is_chain  # it branches
    chain = SuffixDrafter(K, max_tree_depth=8, max_cached_requests=0).propose(batch, [K], torch.zeros(1, K))
    assert chain.parents is None


def test_tree_logprobs_equal_nonspec(tiny_llama_dir, base):
    """Logprobs of tokens emitted along an accepted path (nodes 2, 4, 6) are read at the
    nodes that scored them: equal to non-speculative decoding (C8)."""
    truth = greedy_truth(base, PROMPTS[:2], 24)
    drafter = StaticTreeOracle(CHOICES, oracle_table(truth), base.target.model.config.vocab_size)
    session = make_session(tiny_llama_dir, proposer=drafter)
    outs = session.generate(PROMPTS[:2], greedy(24, logprobs=3))
    want = base.generate(PROMPTS[:2], greedy(24, logprobs=3), use_speculation=False)
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids and len(o.logprobs) == len(w.logprobs)
        for a, b in zip(o.logprobs, w.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert max(max(o.metrics.tokens_per_step) for o in outs) == 4


def test_compiled_engine_without_tree_programs_refuses_trees():
    """An artifact built for chains has no tree_step: a tree proposal is refused with a
    message saying how to build one (or to run eagerly), never verified as something else."""
    from types import SimpleNamespace

    from specc.runtime.replay import CompiledEngine

    engine = object.__new__(CompiledEngine)
    engine.programs = SimpleNamespace(tree_step={})
    with pytest.raises(NotImplementedError, match="suffix_decoding_propose_tree.*enforce_eager"):
        engine._verify_tree([], None, None, None, None, None, None)
