"""Tree attention reference (specc.kernels.tree_attention): against a brute-force masked
softmax on random trees, and against what models/llama.py's attention computes in a real
tree verify forward (so the reference is the model's computation, not a lookalike)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specc.kernels.tree_attention import tree_attention
from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM, ModelConfig
from specc.passes.tree_mask import tree_attention_inputs
from helpers import random_parents, random_tree_inputs


def brute_force(q, k_cache, v_cache, prefix_lens, parents) -> torch.Tensor:
    """Float64, one (row, head, node) at a time: walk the parent links to list the keys
    the node sees (the prefix, its ancestors and itself), softmax over those only."""
    bsz, heads, n, d = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(bsz, heads, n, d, dtype=torch.float64)
    for b in range(bsz):
        start = int(prefix_lens[b])
        for i in range(n):
            chain, j = [i], i
            while j > 0:
                j = int(parents[b, j - 1])
                chain.append(j)
            keys = list(range(start)) + [start + m for m in sorted(chain)]
            for h in range(heads):
                kk = k_cache[b, h // group, keys].double()
                vv = v_cache[b, h // group, keys].double()
                w = torch.softmax(kk @ q[b, h, i].double() / math.sqrt(d), dim=0)
                out[b, h, i] = w @ vv
    return out


@pytest.mark.parametrize("bsz,heads,kv_heads,n,d,s", [
    (1, 2, 2, 1, 8, 5),  # the root alone (no drafts)
    (3, 4, 2, 7, 16, 40),  # GQA, odd tree size
    (4, 6, 1, 5, 12, 23),  # multi-query, head size not a power of two
    (2, 4, 4, 17, 8, 30),  # k = 16 nodes + root
])
def test_reference_matches_brute_force(bsz, heads, kv_heads, n, d, s):
    for seed in range(3):
        q, k, v, plen, tmask, parents = random_tree_inputs(seed, bsz, heads, kv_heads, n, d, s)
        got = tree_attention(q, k, v, plen, tmask)
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.double(), brute_force(q, k, v, plen, parents), atol=1e-5, rtol=1e-5)


def test_reference_ignores_keys_outside_the_tree():
    """Stale entries after the tree, and siblings' keys, never change a node's output."""
    q, k, v, plen, tmask, parents = random_tree_inputs(4, 2, 2, 1, 6, 8, 30)
    plen = torch.tensor([3, 11])
    base = tree_attention(q, k, v, plen, tmask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:], v2[:, :, 20:] = 1e4, -1e4  # beyond both trees (ends 9 and 17)
    torch.testing.assert_close(tree_attention(q, k2, v2, plen, tmask), base, rtol=0, atol=0)


def test_reference_errors():
    q, k, v, plen, tmask, _ = random_tree_inputs(0, 2, 4, 2, 3, 8, 10)
    bad = {
        "q": q[0], "k_cache": k[:1], "v_cache": v[..., :4], "prefix_lens": plen.int(),
        "tree_mask": tmask.int(),
    }
    args = dict(q=q, k_cache=k, v_cache=v, prefix_lens=plen, tree_mask=tmask)
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            tree_attention(**dict(args, **{name: value}))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tree_attention(q[:, :3], k, v, plen, tmask)
    with pytest.raises(ValueError, match="dtype"):
        tree_attention(q, k.double(), v.double(), plen, tmask)


def test_reference_is_the_models_tree_verify_attention(monkeypatch):
    """A tree verify forward of a 2-layer GQA Llama over rows with different prefix
    lengths and draft counts (padding nodes included): at every layer the reference on
    the compact inputs (prefix lengths + ``TreeAttention.tree_mask``) returns exactly
    what the model's ``scaled_dot_product_attention`` over the dense mask returned."""
    config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    cache = KVCache.for_model(config, 3, 64)
    starts, k_max = [9, 20, 4], 5
    for b, n in enumerate(starts):  # prefill each row's prefix
        ids = torch.randint(0, 50, (1, n))
        model(ids, torch.arange(n)[None], cache.slots(b, b + 1), kv_len=n)
    parents = random_parents(torch.Generator().manual_seed(1), len(starts), k_max)
    nd = torch.tensor([5, 2, 0])
    start = torch.tensor(starts)
    kv_len = int((start + nd).max()) + 1
    tree = tree_attention_inputs(parents, nd, start, kv_len, cache.trash_pos)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        out = sdpa(q, k, v, attn_mask=attn_mask, **kw)
        calls.append((q, k, v, out))
        return out

    ids = torch.randint(0, 50, (3, k_max + 1))
    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", spy)
        model(ids, tree.positions, cache, attn_mask=tree.mask, cache_positions=tree.cache_positions, kv_len=kv_len)
    assert len(calls) == config.num_hidden_layers
    for q, k, v, out in calls:
        assert q.shape == (3, 4, k_max + 1, 8) and k.shape[2] == kv_len
        assert torch.equal(tree_attention(q, k, v, start, tree.tree_mask), out)
