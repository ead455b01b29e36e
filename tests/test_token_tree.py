"""Token trees (specc.runtime.token_tree): derived shapes, vLLM's tree format, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specc.runtime.token_tree import (
    TokenTree, TokenTreeError, batch_ancestor_mask, batch_depths, parse_choices,
)


def test_small_tree_shapes():
    #        0
    #      1   2
    #     3 4   5
    #     6
    t = TokenTree((0, 0, 1, 1, 2, 3))
    assert t.depths == (0, 1, 1, 2, 2, 2, 3)
    assert t.children[0] == (1, 2) and t.children[1] == (3, 4) and t.children[6] == ()
    assert t.leaves == (4, 5, 6)
    assert t.path(6) == (1, 3, 6) and t.path(0) == ()
    m = t.ancestor_mask()
    assert m.shape == (7, 7) and m.dtype == torch.bool
    assert m[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert m[2].nonzero().flatten().tolist() == [0, 2]
    assert not t.is_chain and TokenTree.chain(3).is_chain


def test_chain_mask_is_causal():
    m = TokenTree.chain(4).ancestor_mask()
    assert torch.equal(m, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("bad", [(1,), (0, 2), (-1,), (0, 0.5)])
def test_bad_parents(bad):
    with pytest.raises(TokenTreeError, match="parent"):
        TokenTree(bad)


def test_vllm_choices():
    # vLLM sorts breadth-first: (0,), (1,), (0, 0), (0, 1), (1, 0)
    t = TokenTree.from_choices("[(0,), (0, 0), (1,), (1, 0), (0, 1)]")
    assert parse_choices([(0, 1), (0,), (0, 0)]) == [(0,), (0, 0), (0, 1)]
    assert t.parents == (0, 0, 1, 1, 2)
    assert TokenTree.from_choices([[0], [0, 0], [0, 0, 0]]).is_chain  # YAML lists work too


@pytest.mark.parametrize("bad, msg", [
    ("[(0,), (0, 0", "literal"),
    ([], "non-empty"),
    ([(0,), (0,)], "twice"),
    ([(0, 0)], "parent"),
    ([(0,), (1,), (0, 1)], "elder sibling"),
    ([(0,), (-1,)], "ranks"),
])
def test_vllm_choices_errors(bad, msg):
    with pytest.raises(TokenTreeError, match=msg):
        parse_choices(bad)


@st.composite
def parent_lists(draw, max_nodes=8):
    n = draw(st.integers(0, max_nodes))
    return [draw(st.integers(0, i)) for i in range(n)]


def _brute_ancestors(parents):
    n = len(parents) + 1
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while True:
            m[i, j] = True
            if j == 0:
                break
            j = parents[j - 1]
    return m


@settings(max_examples=60, deadline=None)
@given(st.lists(parent_lists(), min_size=1, max_size=4))
def test_batched_forms_match_single_trees(rows):
    k = max(len(r) for r in rows)
    padded = torch.tensor([r + list(range(len(r), k)) for r in rows], dtype=torch.long).view(len(rows), k)
    masks, depths = batch_ancestor_mask(padded), batch_depths(padded)
    for b, r in enumerate(rows):
        n = len(r) + 1
        assert torch.equal(masks[b, :n, :n], _brute_ancestors(r))
        assert depths[b, :n].tolist() == list(TokenTree(tuple(r)).depths)
        assert list(TokenTree(tuple(r)).depths) == [len(TokenTree(tuple(r)).path(i)) for i in range(n)]
