"""Tree attention inputs (specc.passes.tree_mask) and KV compaction
(specc.passes.kv_compaction) against brute-force references on random trees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specc.models.kv_cache import KVCache
from specc.passes.kv_compaction import compact_accepted_kv
from specc.passes.tree_mask import static_tree_tensors, tree_attention_from_static, tree_attention_inputs
from specc.runtime.token_tree import TokenTree

TRASH = 99


def _brute(parents: list[int], k: int, start: int, kv_len: int):
    """Per node: RoPE position, cache position, visible keys, by walking parent links."""
    n = len(parents)
    pos, cpos, mask = [], [], torch.zeros(k + 1, kv_len, dtype=torch.bool)
    for node in range(k + 1):
        if node > n:  # padding
            pos.append(TRASH)
            cpos.append(TRASH)
            mask[node, : start + 1] = True
            continue
        chain, j = [node], node
        while j > 0:
            j = parents[j - 1]
            chain.append(j)
        pos.append(start + len(chain) - 1)
        cpos.append(start + node)
        mask[node, :start] = True
        for a in chain:
            mask[node, start + a] = True
    return pos, cpos, mask


@st.composite
def rows(draw, k=6):
    out = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, k))
        out.append(([draw(st.integers(0, i)) for i in range(n)], draw(st.integers(1, 20))))
    return out


@settings(max_examples=80, deadline=None)
@given(rows())
def test_dynamic_tree_inputs_match_brute_force(batch):
    k = 6
    kv_len = max(s + len(p) for p, s in batch) + 3  # extra keys beyond every tree: never visible
    parents = torch.tensor([p + [7] * (k - len(p)) for p, _ in batch], dtype=torch.long)  # junk padding
    parents = torch.where(parents > torch.arange(k), torch.arange(k), parents)  # junk stays in range
    nd = torch.tensor([len(p) for p, _ in batch])
    start = torch.tensor([s for _, s in batch])
    got = tree_attention_inputs(parents, nd, start, kv_len, TRASH)
    for b, (p, s) in enumerate(batch):
        pos, cpos, mask = _brute(p, k, s, kv_len)
        assert got.positions[b].tolist() == pos
        assert got.cache_positions[b].tolist() == cpos
        assert torch.equal(got.mask[b], mask)


def test_static_tree_equals_dynamic_and_chain_is_causal():
    tree = TokenTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    k = tree.num_drafts
    depths, anc = static_tree_tensors(tree)
    nd, start = torch.tensor([k, 3, 0]), torch.tensor([5, 9, 2])
    a = tree_attention_from_static(depths, anc, nd, start, 16, TRASH)
    b = tree_attention_inputs(torch.tensor([tree.parents] * 3), nd, start, 16, TRASH)
    for x, y in zip((a.positions, a.cache_positions, a.mask), (b.positions, b.cache_positions, b.mask)):
        assert torch.equal(x, y)
    chain = tree_attention_inputs(torch.arange(4)[None], torch.tensor([4]), torch.tensor([3]), 8, TRASH)
    assert chain.positions.tolist() == [[3, 4, 5, 6, 7]] == chain.cache_positions.tolist()
    causal = torch.arange(8)[None, None] <= chain.positions[:, :, None]
    assert torch.equal(chain.mask, causal)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=6, max_size=6), st.integers(1, 10))
def test_compaction_moves_the_path(parent_choices, start):
    parents = [min(p, i) for i, p in enumerate(parent_choices)]
    tree = TokenTree(tuple(parents))
    end = max(range(len(parents) + 1), key=lambda n: (tree.depths[n], -n))
    path = list(tree.path(end))
    cache = KVCache(2, 1, 1, 32, 2)
    for t in (*cache.k, *cache.v):
        t[0, 0, :, 0] = torch.arange(33, dtype=torch.float32)  # value = position
    nodes = torch.tensor([[0, *path] + [-1] * (len(parents) - len(path))])
    compact_accepted_kv((*cache.k, *cache.v), torch.tensor([start]), nodes, torch.tensor([len(path)]),
                        cache.trash_pos)
    for t in (*cache.k, *cache.v):
        got = t[0, 0, start + 1 : start + 1 + len(path), 0].tolist()
        assert got == [float(start + n) for n in path]
        assert t[0, 0, : start + 1, 0].tolist() == [float(i) for i in range(start + 1)]  # prefix untouched
