"""The fused draft-then-verify graph on a small model (passes/accept_reject.py with q,
runtime/programs.py EarlyExitStepProgram, passes/bucket_padding.py).

On the tiny random Llama of test_passes_accept_reject (2 layers, vocabulary 512), k = 3,
the early-exit drafter = layer 0 + norm + lm_head:

* the exported and fused graph equals the module run eagerly followed by
  :func:`accept_reject_outputs` with ``draft_probs = q``, for greedy / sampling /
  top-k-top-p / mixed rows, with the same K/V writes; and re-exports;
* the drafts are the eager drafter's: greedy rows the argmax of the first layer's logits
  chained step by step, sampled rows :func:`sample_draft` with ``uniforms[:, step]``;
* with :func:`pad_rows`, padding rows write only at the trash position and return -1 / 0.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specc.kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID
from specc.passes.accept_reject import accept_reject_outputs, fuse_accept_reject
from specc.passes.bucket_padding import pad_rows
from specc.passes.signature import export_flat, placeholders
from specc.runtime.programs import EarlyExitStepProgram, kv_view
from specc.runtime.sampling import greedy_mask, sample_draft
from specc.sampling_params import MAX_LOGPROBS
from test_passes_accept_reject import MAX_LEN, _assert_same, _clone, _kv, _llama, _params

K, ROWS, N = 3, 3, 1


def _inputs(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (rows, 1), generator=g)
    nd = torch.tensor([K, K - 1, 0, 1][:rows], dtype=torch.int64)
    start = torch.tensor([5, 9, 3, 30][:rows])  # row 3's last draft step is past the limit (trash)
    offs = torch.arange(K + 1)
    pos = torch.where(offs[None] <= nd[:, None], start[:, None] + offs[None], torch.full((rows, K + 1), MAX_LEN))
    return ids, pos, nd, torch.rand(rows, 2 * K + 1, generator=g)


def _graph(rows: int):
    module = EarlyExitStepProgram(_llama(), MAX_LEN, N, K)
    ids, pos, nd, u = _inputs(rows, 0)
    t, tk, tp = _params("greedy", rows)
    keys = torch.arange(MAX_LEN)
    gm = export_flat(module, (ids, pos, _kv(rows), keys, u, t, tk, tp))
    return module, fuse_accept_reject(gm, num_speculative_tokens=K, max_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def graphs():
    return _graph(ROWS)


@pytest.mark.parametrize("scenario", ["greedy", "sampling", "top_k_top_p", "mixed"])
def test_fused_graph_equals_module_then_accept_reject(graphs, scenario):
    module, fused = graphs
    assert list(placeholders(fused))[-1] == "num_draft_tokens"  # the others are the module's
    params, keys = _params(scenario, ROWS), torch.arange(MAX_LEN)
    for seed in range(3):
        ids, pos, nd, u = _inputs(ROWS, seed)
        kv_ref, kv_got = _kv(ROWS, seed), _kv(ROWS, seed)
        logits, verified, q = module(ids, pos, kv_ref, keys, u, *params)
        want = accept_reject_outputs(logits, verified, nd, u, *params, num_speculative_tokens=K,
                                     max_logprobs=MAX_LOGPROBS, draft_probs=q)
        got = fused(ids, pos, *kv_got, keys, u, *params, nd)
        _assert_same(got, want, exact=False)
        assert all(torch.equal(a, b) for a, b in zip(kv_got, kv_ref))


def test_drafts_are_the_eager_drafters(graphs):
    """Step by step: the draft of step s is sample_draft over the first layer's logits at
    the previous draft, written at start + s, from uniforms[:, s]."""
    module, _ = graphs
    params, keys = _params("mixed", ROWS), torch.arange(MAX_LEN)
    ids, pos, nd, u = _inputs(ROWS, 1)
    kv = _kv(ROWS, 1)
    _, verified, q = module(ids, pos, _clone(kv), keys, *([u] + list(params)))
    cache, tok = kv_view(tuple(kv), MAX_LEN), ids
    for s in range(K):
        p = (pos[:, :1] + s).clamp_max(MAX_LEN)
        logits = _llama()(tok, p, cache, kv_len=MAX_LEN, num_layers=N).logits[:, 0]
        draft, q_s = sample_draft(logits, *params, greedy_mask(params[0]), u[:, s])
        assert torch.equal(verified[:, s + 1], draft) and torch.allclose(q[:, s], q_s)
        tok = draft[:, None]
    assert torch.equal(verified[:, 0], ids[:, 0])


def test_reexport_and_padding_rows_inert():
    module, fused = _graph(4)
    gm = pad_rows(fused, trash_pos=MAX_LEN)
    params, keys = _params("mixed", 4), torch.arange(MAX_LEN)
    ids, pos, nd, u = _inputs(4, 2)
    ids[2:, 0] = torch.tensor([-1, 10 ** 6])  # garbage ids in the padding rows
    kv = _kv(4, 2)
    args = (ids, pos, *kv, keys, u, *params, nd, torch.tensor(2))
    ep = torch.export.export(gm, tuple(copy.deepcopy(list(args))), strict=False)
    kv_got = _clone(kv)
    got = ep.module()(ids, pos, *kv_got, keys, u, *params, nd, torch.tensor(2))
    assert bool((got[0][2:] == PLACEHOLDER_TOKEN_ID).all()) and bool((got[1][2:] == 0).all())
    for a, b in zip(kv_got, kv):
        assert torch.equal(a[2:, :, :MAX_LEN], b[2:, :, :MAX_LEN])
    # the real rows: what the 2-row program gives them
    _, fused2 = _graph(2)
    kv2 = [t[:2].clone() for t in kv]
    want = fused2(ids[:2], pos[:2], *kv2, keys, u[:2], *[p[:2] for p in params], nd[:2])
    assert torch.equal(got[0][:2], want[0]) and torch.equal(got[1][:2], want[1])
