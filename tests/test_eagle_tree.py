"""EAGLE / EAGLE-3 heads drafting static token trees (``speculative_token_tree``, eager path):
greedy output equals non-speculative greedy for several trees and batches; a chain-shaped
tree drafts, accepts and emits exactly as the chain proposer; every node's token equals a
from-scratch recomputation along its path (the head's tree mask); the same for EAGLE-2's
dynamic trees (``eagle_dynamic_tree``); config and compile-path errors. Seeded sampled trees are reproducible:
``test_eagle_drafting.py``; the sampled distribution check is in
``test_case_c06_sampling_distribution.py`` (``eagle_tree``)."""

from __future__ import annotations

import pytest
import torch

from eagle_checkpoints import write_echo_eagle_checkpoint
from helpers import drafter_spec, greedy, make_session, patched, spec_counts
from specc.config import ConfigError, load_config
from specc.runtime.drafters.eagle import EagleProposer
from specc.runtime.token_tree import TokenTree
from test_eagle_drafting import _caught_up

PROMPTS = ["Hello there, how are you today?", "The capital of France is", "1 2 3 4 5 6",
           "def f(x):\n    return", "Once upon a time"]
CHAIN3 = [(0,), (0, 0), (0, 0, 0)]
WIDE = [(0,), (1,), (2,), (3,)]
DEEP_WIDE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


@pytest.fixture(scope="module")
def heads(tiny_eagle_heads, tmp_path_factory, base):
    """The random heads, plus ``echo``: an EAGLE head whose drafts get accepted."""
    echo = write_echo_eagle_checkpoint(tmp_path_factory.mktemp("tree_echo") / "echo", base.target.model.config)
    return {**tiny_eagle_heads, "echo": echo}


def _spec(heads, name: str, tree=None, k: int | None = None) -> dict:
    method = "eagle3" if name == "eagle3" else "eagle"
    kw = {} if tree is None else dict(speculative_token_tree=str(tree))
    spec = drafter_spec(method, k or 1, heads[name], **kw)
    if k is None:
        spec.pop("num_speculative_tokens")  # taken from the tree
    return spec


@pytest.fixture(scope="module")
def reference(base):
    return [o.token_ids for o in base.generate(PROMPTS, greedy(20), use_speculation=False)]


@pytest.mark.parametrize("name", ["echo", "eagle3"])
def test_chain_shaped_tree_equals_chain(tiny_llama_dir, heads, name):
    """A chain written as a tree drafts the chain's tokens: same output, same drafts and
    acceptance counts, per position (the tree verify, the path's hidden-state hand-over and
    the catch-up reproduce the chain's)."""
    chain = make_session(tiny_llama_dir, _spec(heads, name, k=3), max_num_seqs=2)
    tree = make_session(tiny_llama_dir, _spec(heads, name, CHAIN3), max_num_seqs=2)
    assert tree.proposer.tree is not None and tree.proposer.num_speculative_tokens == 3
    params = [greedy(20 - 2 * i) for i in range(len(PROMPTS))]
    a, b = chain.generate(PROMPTS, params), tree.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert spec_counts(a) == spec_counts(b)
    if name == "echo":
        assert sum(o.metrics.spec.num_accepted_tokens for o in b) > 0


@pytest.mark.parametrize("name,tree,max_num_seqs", [("echo", WIDE, 4), ("echo", DEEP_WIDE, 2),
                                                    ("eagle3", DEEP_WIDE, 4)])
def test_greedy_equals_non_speculative(tiny_llama_dir, heads, reference, name, tree, max_num_seqs):
    """Five prompts of different lengths, admitted as slots free up (slot moves)."""
    s = make_session(tiny_llama_dir, _spec(heads, name, tree), max_num_seqs=max_num_seqs)
    paths, original = [], s.proposer.on_verified

    def on_verified(batch, accepted, accepted_paths=None):
        paths.extend(accepted_paths)
        return original(batch, accepted, accepted_paths=accepted_paths)

    with patched(s.proposer, "on_verified", on_verified):
        outs = s.generate(PROMPTS, [greedy(20 - i) for i in range(len(PROMPTS))])
    for i, (o, ref) in enumerate(zip(outs, reference)):
        assert o.token_ids == ref[: 20 - i], (name, i)
    assert s.metrics.num_draft_tokens > 0
    if name == "echo":  # accepted paths that leave the chain (a rank > 0 on the way)
        t = TokenTree.from_choices(tree)
        chain = {i for i in range(1, t.num_drafts + 1) if all(t.children[t.parents[j - 1]][0] == j
                                                              for j in t.path(i))}
        assert any(set(p) - chain for p in paths), paths


def test_context_limit(tiny_llama_dir, heads):
    """Requests run into max_model_len: nodes whose head or target slot would pass the
    limit are capped (the first nodes of a breadth-first tree are a tree)."""
    plain = make_session(tiny_llama_dir, max_model_len=40)
    s = make_session(tiny_llama_dir, _spec(heads, "echo", DEEP_WIDE), max_model_len=40)
    params = [greedy(64, ignore_eos=True)] * 3
    ref = [o.token_ids for o in plain.generate(PROMPTS[:3], params)]
    outs = s.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)


DYNAMIC = dict(depth=3, topk=2)


@pytest.mark.parametrize("name,max_num_seqs", [("echo", 2), ("eagle3", 4)])
def test_dynamic_tree_greedy_equals_non_speculative(tiny_llama_dir, heads, reference, name, max_num_seqs):
    """EAGLE-2's dynamic tree (``eagle_dynamic_tree``): per-row trees, same output; every
    node's token is among its parent's ``topk`` best by the head's logits recomputed from
    nothing along the parent's path."""
    spec = drafter_spec("eagle3" if name == "eagle3" else "eagle", 5, heads[name], eagle_dynamic_tree=DYNAMIC)
    s = make_session(tiny_llama_dir, spec, max_num_seqs=max_num_seqs)
    prop, checked = s.proposer, []
    original = prop.propose

    def propose(batch, max_drafts, uniforms):
        p = original(batch, max_drafts, uniforms)
        if name == "echo" and len(checked) < 12:
            for b, r in enumerate(batch.requests):
                t = TokenTree(tuple(p.parents[b].tolist()))
                toks = [0] + p.draft_token_ids[b].tolist()
                assert max(t.depths) <= DYNAMIC["depth"]
                for node in range(1, t.num_drafts + 1):
                    path = [toks[i] for i in t.path(t.parents[node - 1])]
                    top = _path_logits(s.target.model, prop.head, r.all_token_ids, path).topk(DYNAMIC["topk"])
                    assert toks[node] in top.indices.tolist(), (r.request_id, node)
                checked.append(r.request_id)
        return p

    with patched(prop, "propose", propose), torch.inference_mode():
        outs = s.generate(PROMPTS, [greedy(20 - i) for i in range(len(PROMPTS))])
    for i, (o, ref) in enumerate(zip(outs, reference)):
        assert o.token_ids == ref[: 20 - i], (name, i)
    assert s.metrics.num_draft_tokens > 0
    if name == "echo":
        assert checked and s.metrics.num_accepted_tokens > 0


def _path_logits(target, head, ids: list[int], path_tokens: list[int]) -> torch.Tensor:
    """The head's logits after the committed ``ids`` and then the chain ``path_tokens``,
    from nothing (target forward, every true pair, then chain steps)."""
    h, hc, n = _caught_up(target, head, ids, len(path_tokens) + 1)
    for j, tok in enumerate(path_tokens):
        h = head(torch.tensor([[tok]]), h, torch.tensor([[n + j]]), hc, kv_len=n + j + 1)
    return head.compute_logits(h[:, -1])[0]


def test_tree_nodes_equal_from_scratch_recomputation(tiny_llama_dir, heads):
    """Every node's token is the ``rank``-th best of the head's logits recomputed from
    nothing along the node's own path: the head's tree mask shows a node its ancestors
    and nothing else (not siblings, not other branches, not stale entries)."""
    s = make_session(tiny_llama_dir, _spec(heads, "echo", DEEP_WIDE), max_num_seqs=3)
    prop = s.proposer
    tree = TokenTree.from_choices(DEEP_WIDE)
    original, checked = prop.propose, []

    def propose(batch, max_drafts, uniforms):
        p = original(batch, max_drafts, uniforms)
        for b, r in enumerate(batch.requests):
            if max_drafts[b] == 0:
                continue
            toks = [0] + p.draft_token_ids[b].tolist()
            for parent, kids in enumerate(tree.children):
                if not kids:
                    continue
                path = [toks[i] for i in tree.path(parent)]
                top = _path_logits(s.target.model, prop.head, r.all_token_ids, path).topk(len(kids)).indices
                assert [toks[c] for c in kids] == top.tolist(), (r.request_id, parent)
            checked.append(r.request_id)
        return p

    with patched(prop, "propose", propose), torch.inference_mode():
        s.generate(PROMPTS[:3], [greedy(8 + 3 * i) for i in range(3)])
    assert len(set(checked)) == 3 and len(checked) > 8


def test_config_rules():
    def spec(**kw):
        return load_config(dict(target="t", speculative_config=dict(method="eagle", model="h", **kw)))

    c = spec(speculative_token_tree="[(1,), (0,), (0, 0)]").speculative_config
    assert c.num_speculative_tokens == 3 and c.speculative_token_tree == [[0], [1], [0, 0]]
    assert c.token_tree.parents == (0, 0, 1) and c.tree_field == "speculative_token_tree"
    assert spec(speculative_token_tree=[[0], [0, 0]], num_speculative_tokens=2).speculative_config.token_tree.is_chain
    with pytest.raises(ConfigError, match=r"speculative_config.num_speculative_tokens = 4: must equal the number "
                                          r"of nodes of speculative_token_tree \(3\); set it to 3 or omit it"):
        spec(speculative_token_tree="[(0,), (1,), (0, 0)]", num_speculative_tokens=4)
    with pytest.raises(ConfigError, match=r"speculative_config.speculative_token_tree = .*its parent \(0,\) is "
                                          r"missing"):
        spec(speculative_token_tree="[(0, 0)]")
    with pytest.raises(ConfigError, match=r"speculative_token_tree = .*not a Python list literal"):
        spec(speculative_token_tree="[(0,")
    with pytest.raises(ConfigError, match=r"speculative_config.speculative_token_tree: has 17 nodes; at most 16"):
        spec(speculative_token_tree=str([(i,) for i in range(17)]))
    with pytest.raises(ConfigError, match=r"speculative_config.num_speculative_tokens = 9: the dynamic tree "
                                          r"\(depth 2, topk 2\) proposes 6 candidates, fewer than the 9"):
        spec(eagle_dynamic_tree=dict(depth=2, topk=2), num_speculative_tokens=9)
    with pytest.raises(ConfigError, match=r"eagle_dynamic_tree.*not both"):
        spec(eagle_dynamic_tree=dict(depth=2, topk=2), speculative_token_tree="[(0,)]")
    assert spec(eagle_dynamic_tree=dict(depth=2, topk=2)).speculative_config.tree_field == "eagle_dynamic_tree"
    with pytest.raises(ConfigError, match=r"speculative_token_tree = .*not allowed with method 'ngram'"):
        load_config(dict(target="t", speculative_config=dict(method="ngram", speculative_token_tree="[(0,)]")))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_compiled_path_refuses_trees(method):
    from specc.compiler import check_compilable

    for field, value in (("speculative_token_tree", "[(0,), (1,)]"), ("eagle_dynamic_tree", DYNAMIC)):
        cfg = load_config(dict(target="t", speculative_config={"method": method, "model": "h", field: value}))
        with pytest.raises(ConfigError, match=rf"speculative_config.{field}: method .* drafts token trees on the "
                                              r"eager path only .*enforce_eager: true"):
            check_compilable(cfg)


def test_tree_size_must_match_k(tiny_llama_dir, heads, base):
    from specc.models.eagle_checkpoint import load_eagle_head

    head = load_eagle_head(str(heads["eagle"]), base.target.model, method="eagle")
    with pytest.raises(ValueError, match="token tree of 2 nodes for num_speculative_tokens = 3"):
        EagleProposer(head, 3, 1, 64, tree=TokenTree.from_choices([(0,), (1,)]))
