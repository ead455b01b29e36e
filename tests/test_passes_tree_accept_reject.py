"""The tree accept/reject pass (passes/tree_accept_reject.py) and bucket padding of a
tree step, on the tiny Llama's tree verify graph (FX level, no AOTInductor: the compiled
program is tested in test_compiled_tree.py).

The fused and padded 4-row graph, with a garbage padding row (ids past the vocabulary,
parents out of range, root beyond the cache), equals :func:`tree_accept_reject_outputs`
on the unfused 3-row graph's logits: tokens, counts, accepted nodes, logprobs, and the
cache after the step (compacted identically; the padding row's slot written only at
the trash position); greedy and sampled rows with top-k / top-p.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specc.passes.bucket_padding import TREE_FILLS, pad_rows
from specc.passes.signature import export_flat, placeholders
from specc.passes.tree_accept_reject import (
    TREE_ACCEPT_REJECT_INPUTS,
    fuse_tree_accept_reject,
    tree_accept_reject_outputs,
)
from specc.runtime.programs import TreeVerifyProgram
from test_passes_accept_reject import CFG, MAX_LEN, _clone, _kv, _llama, _params

K = 4
KEYS = torch.arange(24)
PARENTS = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3], [0, 0, 0, 0]])
ND = torch.tensor([4, 4, 2])
START = torch.tensor([5, 11, 2])


def _graph(rows: int):
    ids = torch.zeros(rows, K + 1, dtype=torch.int64)
    args = (ids, START[:1].repeat(rows), PARENTS[:1].repeat(rows, 1), ND[:1].repeat(rows), _kv(rows), KEYS)
    return export_flat(TreeVerifyProgram(_llama(), MAX_LEN), args)


@pytest.mark.parametrize("scenario", ["greedy", "mixed", "top_k_top_p"])
def test_fused_padded_tree_graph_equals_reference(scenario):
    original = _graph(3)
    fused = fuse_tree_accept_reject(_graph(4), num_speculative_tokens=K, max_logprobs=5, trash_pos=MAX_LEN)
    padded = pad_rows(copy.deepcopy(fused), trash_pos=MAX_LEN, fills=TREE_FILLS)
    assert list(placeholders(padded))[-5:] == [*TREE_ACCEPT_REJECT_INPUTS, "num_rows"]

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab_size, (3, K + 1), generator=g)
    uniforms = torch.rand(4, 2 * K + 1, generator=g)
    params = _params(scenario, 4)
    kv = _kv(4, seed=1)
    kv_ref = [t[:3].clone() for t in kv]
    (logits,) = original(ids, START, PARENTS, ND, *kv_ref, KEYS)
    want = tree_accept_reject_outputs(logits, ids, PARENTS, ND, START, kv_ref, uniforms[:3],
                                      *[p[:3] for p in params], max_logprobs=5, trash_pos=MAX_LEN)

    garbage = (torch.full((1, K + 1), 10**6), torch.tensor([10**6]), torch.tensor([[7, 9, 9, 9]]),
               torch.tensor([K]))
    inputs = [torch.cat([x, y]) for x, y in zip((ids, START, PARENTS, ND), garbage)]
    kv_got = _clone(kv)
    got = padded(*inputs, *kv_got, KEYS, uniforms, *params, torch.tensor(3))
    for x, y in zip(got, want):
        if x.dtype.is_floating_point:
            torch.testing.assert_close(x[:3], y, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(x[:3], y)
    assert got[0][3].tolist() == [-1] * (K + 1) and int(got[1][3]) == 0
    for a, b, before in zip(kv_got, kv_ref, kv):
        torch.testing.assert_close(a[:3], b, atol=1e-5, rtol=1e-5)
        assert torch.equal(a[3, :, :MAX_LEN], before[3, :, :MAX_LEN])  # padding row: trash only


def test_fuse_tree_rejects_a_chain_graph():
    from specc.runtime.programs import VerifyProgram

    ids = torch.zeros(2, K + 1, dtype=torch.int64)
    chain = export_flat(VerifyProgram(_llama(), MAX_LEN), (ids, torch.zeros_like(ids), _kv(2)))
    with pytest.raises(ValueError, match=r"missing placeholders \['start', 'parents', 'num_draft_tokens'\]"):
        fuse_tree_accept_reject(chain, num_speculative_tokens=K, max_logprobs=5, trash_pos=MAX_LEN)
