"""Compile passes: splice (passes/splice.py), the fused accept/reject
(passes/accept_reject.py) and bucket padding (passes/bucket_padding.py).

* splice: bound and new placeholders, attribute copies under non-clashing names, a guest
  with a ``torch.cond``, re-export.
* fuse_accept_reject on a toy host (embedding + linear, logits of position i depend on
  token i only, so draft chains the target accepts are easy to build) for k = 0, 1, 4,
  greedy / sampling / top-k-top-p (both ``torch.cond`` branches) / mixed rows, mixed
  num_draft_tokens: the fused graph's outputs equal :func:`accept_reject_outputs` on the
  original graph's logits; then the same on the tiny Llama verify program (k = 0, 2).
* pad_rows: padding rows are inert (KV slot unchanged except at trash_pos, tokens -1,
  count 0), real rows equal the unpadded smaller batch; re-export with torch.export.
* one AOTInductor round trip (tiny Llama, k = 2, bucket 2, 1 real row).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM, ModelConfig
from specc.passes.accept_reject import (
    ACCEPT_REJECT_INPUTS,
    accept_reject_outputs,
    fuse_accept_reject,
)
from specc.passes.bucket_padding import pad_rows
from specc.passes.signature import export_flat, output_node, output_values, placeholders
from specc.passes.splice import add_placeholder, splice
from specc.runtime.programs import VerifyProgram, flat_kv
from specc.sampling_params import MAX_LOGPROBS

# ---------------------------------------------------------------------------- helpers

TOY_VOCAB, TOY_LOGPROBS, B = 64, 5, 4

#: per-row sampling parameters of a 4-row batch
SCENARIOS = {
    "greedy": dict(temperature=[0.0, 0.0, 0.0, 0.0], top_k=[0, 0, 0, 0], top_p=[1.0] * 4),
    # sampling, no row filters: the torch.cond's false branch
    "sampling": dict(temperature=[1.0, 0.7, 1.3, 0.9], top_k=[0, 0, 0, 0], top_p=[1.0] * 4),
    # top-k / top-p rows: the true branch (row 3 samples unfiltered inside it)
    "top_k_top_p": dict(temperature=[1.0, 0.7, 1.3, 0.9], top_k=[3, 0, 5, 0],
                        top_p=[1.0, 0.8, 0.9, 1.0]),
    # greedy rows carry filter params (ignored); sampling rows with and without top-k
    "mixed": dict(temperature=[0.0, 1.0, 0.0, 0.8], top_k=[4, 0, 0, 3],
                  top_p=[0.5, 1.0, 1.0, 1.0]),
}


def _params(name: str, rows: int = B):
    p = SCENARIOS[name]
    return (torch.tensor(p["temperature"][:rows], dtype=torch.float32),
            torch.tensor(p["top_k"][:rows], dtype=torch.int64),
            torch.tensor(p["top_p"][:rows], dtype=torch.float32))


def _assert_same(got, want, *, exact: bool = True):
    """Accept/reject outputs equal; logprobs compared where the output token is real."""
    names = ("output_token_ids", "num_accepted", "token_logprobs", "top_logprob_ids", "top_logprobs")
    assert len(got) == len(want) == 5
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    real = want[0] >= 0
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert torch.equal(got[1], want[1])
    if exact:
        assert torch.equal(got[2][real], want[2][real])
        assert torch.equal(got[3], want[3]) and torch.equal(got[4], want[4])
    else:
        torch.testing.assert_close(got[2][real], want[2][real])
        torch.testing.assert_close(got[4], want[4])
        assert torch.equal(got[3][real], want[3][real])


class Toy(nn.Module):
    """logits[b, i] = head(embed(input_ids[b, i])): position i sees token i only."""

    def __init__(self, vocab: int = TOY_VOCAB, hidden: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.head = nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.6)

    def forward(self, input_ids):
        return nn.functional.embedding(input_ids, self.embed) @ self.head.T


@functools.lru_cache(maxsize=None)
def _toy_graphs(k: int):
    """(original graph, fused graph) of the toy host, [B, k + 1] tokens."""
    toy = Toy().eval().requires_grad_(False)
    gm = export_flat(toy, (torch.zeros(B, k + 1, dtype=torch.int64),))
    original = copy.deepcopy(gm)
    fused = fuse_accept_reject(gm, num_speculative_tokens=k, max_logprobs=TOY_LOGPROBS)
    return original, fused


def _toy_inputs(k: int, seed: int):
    """ids [B, k+1] and num_draft_tokens: row 0 a full greedy chain, row 1 a chain broken
    at draft 2, row 2 random drafts, row 3 a chain with half the drafts; entries past
    num_draft_tokens are random garbage."""
    g = torch.Generator().manual_seed(seed)
    toy = Toy()
    ids = torch.randint(0, TOY_VOCAB, (B, k + 1), generator=g)
    for b in (0, 1, 3):
        for i in range(k):
            ids[b, i + 1] = int(toy(ids[b, i : i + 1]).argmax())
    if k >= 2:
        ids[1, 2] = (ids[1, 2] + 1) % TOY_VOCAB
    nd = torch.tensor([k, k, max(k - 1, 0), k // 2], dtype=torch.int64)
    uniforms = torch.rand(B, 2 * k + 1, generator=g)
    return ids, nd, uniforms


# ----------------------------------------------------------------------------- splice


class _Scale(nn.Module):
    """A guest with a parameter whose name clashes with the host's, a buffer and a cond."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)
        self.register_buffer("offset", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x, scale):
        y = x * self.w * scale
        return torch.cond(y.sum() > 0, lambda t: t + self.offset, lambda t: t - self.offset, (y,)), y.sum()


class _Host(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -1.0, 0.5]), requires_grad=False)

    def forward(self, x):
        return (x * self.w,)


def test_splice_binds_adds_placeholders_and_copies_attrs_and_cond():
    x = torch.tensor([1.0, 2.0, 3.0])
    host = export_flat(_Host(), (x,))
    guest_mod = _Scale()
    guest = export_flat(guest_mod, (x, torch.tensor(1.0)))
    assert any("cond" in str(n.target) for n in guest.graph.nodes)
    # a host node already named like the new input: the input still gets its exact name
    (hx,) = output_values(host)
    hx._rename("scale")
    host.recompile()
    assert hx.name == "scale"

    outs = splice(host, guest, {"x": hx, "scale": "scale"})
    assert len(outs) == 2
    output_node(host.graph).args = (tuple(outs),)
    host.graph.lint()
    host.recompile()

    assert list(placeholders(host)) == ["x", "scale"]
    # the guest's w did not overwrite the host's: both live under distinct names
    params = dict(host.named_parameters())
    assert torch.equal(params["w"], torch.tensor([1.0, -1.0, 0.5]))
    assert sum(torch.equal(p, torch.full((3,), 2.0)) for p in params.values()) == 1
    assert any(torch.equal(b, torch.tensor([1.0, 2.0, 3.0])) for b in host.buffers())
    subgraphs = [n for n, m in host.named_children() if isinstance(m, torch.fx.GraphModule)]
    assert len(subgraphs) == 2  # the cond's branches

    for s in (1.0, -1.0):  # both branches
        scale = torch.tensor(s)
        want = guest_mod(x * _Host().w, scale)
        got = host(x, scale)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        ep = torch.export.export(host, (x, scale), strict=False)
        got = ep.module()(x, scale)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_splice_errors():
    x = torch.tensor([1.0, 2.0, 3.0])
    host = export_flat(_Host(), (x,))
    guest = export_flat(_Scale(), (x, torch.tensor(1.0)))
    (hx,) = output_values(host)
    with pytest.raises(ValueError, match="missing"):
        splice(host, guest, {"x": hx})
    with pytest.raises(ValueError, match="unknown"):
        splice(host, guest, {"x": hx, "scale": "scale", "nope": "nope"})
    with pytest.raises(ValueError, match="already has a placeholder"):
        splice(host, guest, {"x": hx, "scale": "x"})
    with pytest.raises(ValueError, match="already has a placeholder"):
        add_placeholder(host, "x")


# ------------------------------------------------------------- accept/reject on the toy


@pytest.mark.parametrize("k", [0, 1, 4])
def test_fused_toy_equals_reference(k):
    original, fused = _toy_graphs(k)
    names = list(placeholders(fused))
    assert names == ["input_ids", *ACCEPT_REJECT_INPUTS]
    accepted_any = False
    for scenario in SCENARIOS:
        for seed in range(3):
            ids, nd, uniforms = _toy_inputs(k, seed)
            temperature, top_k, top_p = _params(scenario)
            (logits,) = original(ids)
            want = accept_reject_outputs(logits, ids, nd, uniforms, temperature, top_k, top_p,
                                         num_speculative_tokens=k, max_logprobs=TOY_LOGPROBS)
            got = fused(ids, nd, uniforms, temperature, top_k, top_p)
            _assert_same(got, want)
            tokens, accepted = got[0], got[1]
            assert tokens.shape == (B, k + 1) and accepted.shape == (B,)
            assert got[3].shape == got[4].shape == (B, k + 1, TOY_LOGPROBS)
            assert bool((accepted <= nd).all())
            emitted = torch.arange(k + 1)[None] <= accepted[:, None]
            assert bool((tokens[emitted] >= 0).all()) and bool((tokens[~emitted] == -1).all())
            accepted_any |= bool((accepted > 0).any())
            if scenario == "greedy" and k > 0:
                assert int(accepted[0]) == k  # the full chain is accepted
                # logprob of the greedy token is the top-1 logprob
                torch.testing.assert_close(got[2][0], got[4][0, :, 0])
            if scenario == "top_k_top_p":
                # the filtering branch ran: row 0 keeps only its top 3 tokens, the
                # unfiltered row 3 keeps every token
                assert bool(torch.isinf(got[4][0, :, 3:]).all())
                assert bool(torch.isfinite(got[4][3]).all())
    assert accepted_any or k == 0


@pytest.mark.parametrize("k", [0, 2])
def test_branch_free_has_no_cond_and_equals_reference(k):
    """``branch_free=True`` (programs replayed as CUDA graphs): no ``torch.cond`` in the
    graph (its predicate would be read on the host inside a capture), same outputs."""
    original, _ = _toy_graphs(k)
    fused = fuse_accept_reject(copy.deepcopy(original), num_speculative_tokens=k, max_logprobs=TOY_LOGPROBS,
                               branch_free=True)
    conds = [n for n in fused.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert not conds
    assert any(n.target is torch.ops.higher_order.cond for n in _toy_graphs(k)[1].graph.nodes)
    for scenario in SCENARIOS:
        ids, nd, uniforms = _toy_inputs(k, 0)
        temperature, top_k, top_p = _params(scenario)
        (logits,) = original(ids)
        want = accept_reject_outputs(logits, ids, nd, uniforms, temperature, top_k, top_p,
                                     num_speculative_tokens=k, max_logprobs=TOY_LOGPROBS)
        _assert_same(fused(ids, nd, uniforms, temperature, top_k, top_p), want)


def test_fuse_rejects_bad_graphs():
    toy = Toy().eval().requires_grad_(False)
    gm = export_flat(toy, (torch.zeros(2, 3, dtype=torch.int64),))
    with pytest.raises(ValueError, match="T = 3"):
        fuse_accept_reject(gm, num_speculative_tokens=1, max_logprobs=2)
    with pytest.raises(ValueError, match="max_logprobs"):
        fuse_accept_reject(gm, num_speculative_tokens=2, max_logprobs=TOY_VOCAB + 1)
    with pytest.raises(ValueError, match="trash_pos|fuse_accept_reject"):
        pad_rows(gm, trash_pos=10)  # not fused


# ------------------------------------------------------------------- tiny Llama verify

MAX_LEN = 32  # trash position 32
CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@functools.lru_cache(maxsize=None)
def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG).eval().requires_grad_(False)


def _kv(rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A cache with random (already written) content, as after some steps."""
    kv = flat_kv(KVCache.for_model(CFG, rows, MAX_LEN))
    g = torch.Generator().manual_seed(seed)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def _clone(kv):
    return [t.clone() for t in kv]


def _llama_graph(rows: int, k: int):
    ids = torch.zeros(rows, k + 1, dtype=torch.int64)
    return export_flat(VerifyProgram(_llama(), MAX_LEN), (ids, torch.zeros_like(ids), _kv(rows)))


def _llama_inputs(original, rows: int, k: int, seed: int):
    """ids / positions / num_draft_tokens / uniforms like the engine builds them; row 0's
    drafts are the target's greedy chain (so greedy accepts all), the others random."""
    g = torch.Generator().manual_seed(seed)
    kv = _kv(rows)
    ids = torch.randint(0, CFG.vocab_size, (rows, k + 1), generator=g)
    nd = torch.tensor([k, max(k - 1, 0), k, 0][:rows], dtype=torch.int64)
    start = torch.tensor([5, 9, 3, 12][:rows])
    offs = torch.arange(k + 1)
    pos = torch.where(offs[None] <= nd[:, None], start[:, None] + offs[None],
                      torch.full((rows, k + 1), MAX_LEN))
    for i in range(k):
        (logits,) = original(ids, pos, *_clone(kv))
        ids[0, i + 1] = logits[0, i].argmax()
    uniforms = torch.rand(rows, 2 * k + 1, generator=g)
    return ids, pos, kv, nd, uniforms


@pytest.mark.parametrize("k", [0, 2])
def test_fused_llama_equals_reference_and_reexports(k):
    rows = 3
    gm = _llama_graph(rows, k)
    original = copy.deepcopy(gm)
    fused = fuse_accept_reject(gm, num_speculative_tokens=k, max_logprobs=MAX_LOGPROBS)
    assert list(placeholders(fused))[-5:] == list(ACCEPT_REJECT_INPUTS)
    ids, pos, kv, nd, uniforms = _llama_inputs(original, rows, k, seed=k)
    kv_ref, kv_got = _clone(kv), _clone(kv)
    (logits,) = original(ids, pos, *kv_ref)
    for scenario in ("greedy", "top_k_top_p", "mixed"):
        params = _params(scenario, rows)
        want = accept_reject_outputs(logits, ids, nd, uniforms, *params,
                                     num_speculative_tokens=k, max_logprobs=MAX_LOGPROBS)
        kv_got = _clone(kv)
        got = fused(ids, pos, *kv_got, nd, uniforms, *params)
        _assert_same(got, want)
        assert all(torch.equal(a, b) for a, b in zip(kv_got, kv_ref))  # same K/V writes
        if scenario == "greedy" and k > 0:
            assert int(got[1][0]) == k

    # re-export of the fused graph (what AOTInductor gets)
    params = _params("top_k_top_p", rows)
    args = (ids, pos, *kv, nd, uniforms, *params)
    ep = torch.export.export(fused, args, strict=False)
    want = fused(ids, pos, *_clone(kv), nd, uniforms, *params)
    got = ep.module()(ids, pos, *_clone(kv), nd, uniforms, *params)
    _assert_same(got, want)


# -------------------------------------------------------------------- bucket padding

K_PAD = 2


@functools.lru_cache(maxsize=None)
def _padded_graph(bucket: int):
    gm = _llama_graph(bucket, K_PAD)
    fuse_accept_reject(gm, num_speculative_tokens=K_PAD, max_logprobs=MAX_LOGPROBS)
    return pad_rows(gm, trash_pos=MAX_LEN)


def _padded_inputs(bucket: int, real: int, scenario: str, seed: int = 1):
    """Inputs for ``bucket`` rows whose first ``real`` are the real requests; padding rows
    carry garbage: real-looking positions, out-of-vocabulary ids, drafts, filters."""
    g = torch.Generator().manual_seed(seed)
    k = K_PAD
    ids = torch.randint(0, CFG.vocab_size, (bucket, k + 1), generator=g)
    start = torch.tensor([4, 11, 7, 2][:bucket])
    pos = start[:, None] + torch.arange(k + 1)[None]
    nd = torch.full((bucket,), k, dtype=torch.int64)
    uniforms = torch.rand(bucket, 2 * k + 1, generator=g)
    temperature, top_k, top_p = _params(scenario, bucket)
    # padding rows: sampling with a filter, so the cond's branch may differ from the
    # unpadded batch's; real rows must not notice
    temperature[real:], top_k[real:] = 1.0, 2
    ids[real:, 0], ids[real:, 1:] = -1, CFG.vocab_size + 7  # stale ids: never looked up
    return ids, pos, nd, uniforms, temperature, top_k, top_p


@pytest.mark.parametrize("scenario", ["greedy", "sampling", "mixed"])
def test_padding_rows_are_inert(scenario):
    bucket, real = 3, 2
    padded = _padded_graph(bucket)
    assert list(placeholders(padded))[-1] == "num_rows"
    unpadded = _llama_graph(real, K_PAD)
    fuse_accept_reject(unpadded, num_speculative_tokens=K_PAD, max_logprobs=MAX_LOGPROBS)

    ids, pos, nd, uniforms, temperature, top_k, top_p = _padded_inputs(bucket, real, scenario)
    kv = _kv(bucket, seed=3)
    kv_pad = _clone(kv)
    got = padded(ids, pos, *kv_pad, nd, uniforms, temperature, top_k, top_p, torch.tensor(real))

    kv_small = [t[:real].clone() for t in kv]
    want = unpadded(ids[:real], pos[:real], *kv_small, nd[:real], uniforms[:real],
                    temperature[:real], top_k[:real], top_p[:real])
    # real rows: as if run alone
    _assert_same([x[:real] for x in got], list(want), exact=False)
    for a, b in zip(kv_pad, kv_small):
        torch.testing.assert_close(a[:real], b)
    # padding rows: nothing emitted, their slot unchanged except at the trash position
    assert bool((got[0][real:] == -1).all()) and bool((got[1][real:] == 0).all())
    for before, after in zip(kv, kv_pad):
        assert torch.equal(after[real:, :, :MAX_LEN], before[real:, :, :MAX_LEN])
        assert not torch.equal(after[real:, :, MAX_LEN], before[real:, :, MAX_LEN])

    # all rows real: nothing masked, the ids are looked up (in range now)
    ids = ids.clamp(0, CFG.vocab_size - 1)
    full = padded(ids, pos, *_clone(kv), nd, uniforms, temperature, top_k, top_p,
                  torch.tensor(bucket))
    assert bool((full[0][:, 0] >= 0).all())
    with pytest.raises(IndexError):  # sanity: out-of-range ids do fail in a real row
        padded(ids.fill_(-1), pos, *_clone(kv), nd, uniforms, temperature, top_k, top_p,
               torch.tensor(bucket))


def test_pad_rows_reexports():
    bucket, real = 3, 1
    padded = _padded_graph(bucket)
    inputs = _padded_inputs(bucket, real, "mixed")
    ids, pos, nd, uniforms, temperature, top_k, top_p = inputs
    kv = _kv(bucket)
    args = (ids, pos, *kv, nd, uniforms, temperature, top_k, top_p, torch.tensor(real))
    ep = torch.export.export(padded, args, strict=False)
    kv_a, kv_b = _clone(kv), _clone(kv)
    want = padded(ids, pos, *kv_a, nd, uniforms, temperature, top_k, top_p, torch.tensor(real))
    got = ep.module()(ids, pos, *kv_b, nd, uniforms, temperature, top_k, top_p, torch.tensor(real))
    _assert_same(got, want)
    assert all(torch.equal(a, b) for a, b in zip(kv_a, kv_b))
    with pytest.raises(ValueError, match="trash"):
        pad_rows(_llama_graph_fused(1), trash_pos=MAX_LEN - 1)


def _llama_graph_fused(rows: int):
    gm = _llama_graph(rows, 0)
    return fuse_accept_reject(gm, num_speculative_tokens=0, max_logprobs=4)


# ------------------------------------------------------------------ AOTInductor round trip


def test_aoti_round_trip(tmp_path):
    bucket, real = 2, 1
    padded = _padded_graph(bucket)
    ids, pos, nd, uniforms, temperature, top_k, top_p = _padded_inputs(bucket, real, "mixed")
    temperature[0], top_k[0] = 0.9, 0  # the real row samples
    kv = _kv(bucket, seed=5)
    num_rows = torch.tensor(real)
    args = (ids, pos, *kv, nd, uniforms, temperature, top_k, top_p, num_rows)
    ep = torch.export.export(padded, args, strict=False)
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "spec_step.pt2"),
        inductor_configs={"aot_inductor.package_constants_in_so": False},
    )
    runner = torch._inductor.aoti_load_package(path)
    tensors = dict(padded.named_parameters(remove_duplicate=False))
    tensors.update(padded.named_buffers(remove_duplicate=False))
    runner.load_constants({fqn: tensors[fqn] for fqn in runner.get_constant_fqns()},
                          check_full_update=True, user_managed=True)

    kv_fx, kv_aoti = _clone(kv), _clone(kv)
    want = padded(ids, pos, *kv_fx, nd, uniforms, temperature, top_k, top_p, num_rows)
    got = runner(ids, pos, *kv_aoti, nd, uniforms, temperature, top_k, top_p, num_rows)
    _assert_same(list(got), list(want), exact=False)
    assert got[0][1].tolist() == [-1] * (K_PAD + 1) and int(got[1][1]) == 0
    for a, b in zip(kv_aoti, kv_fx):
        torch.testing.assert_close(a, b)
        assert torch.equal(a[real:, :, :MAX_LEN], b[real:, :, :MAX_LEN])
