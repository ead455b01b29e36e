"""C11: drafter history (../shared/cases/correctness.md).

ngram, k=5, prompt_lookup_max=4, repeated phrase in the prompt, 64 tokens, two requests
of different lengths batched (also with one finishing early, so the other changes
slot). Checked at every step: the history the drafter sees is exactly prompt + the
tokens emitted so far (no rejected draft, placeholder or token of another request, and
its length is the prompt plus the step-by-step emitted counts); the drafts equal those of
a plain reference n-gram matcher on that history (cut to the engine's cap); the output
equals non-spec.

The same "history == prompt + emitted" property for the stateful drafter
(``draft_model``, own KV cache): after every step, the drafter's cache slot of each live
request holds exactly the K/V of that request's first ``num_computed`` tokens (checked
against a fresh prefill of prompt + emitted tokens), and it never claims more tokens
than the request has verified.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import drafter_spec, greedy, make_session, patched, reference_ngram
from specc.models.kv_cache import KVCache
from specc.session import Session

K = 5
LOOKUP_MIN, LOOKUP_MAX = 1, 4
PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat sat",
    "to be or not to be, that is the question. " * 4 + "to be or not",
]


@pytest.fixture(scope="module")
def ngram(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, drafter_spec("ngram", K, prompt_lookup_min=LOOKUP_MIN,
                                                     prompt_lookup_max=LOOKUP_MAX))


@pytest.fixture(scope="module")
def draft_model(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, drafter_spec("draft_model", K, tiny_llama_dir))


@pytest.mark.parametrize("max_tokens", [(64, 64), (64, 23), (23, 64)], ids=["same", "second_short", "first_short"])
def test_ngram_history_and_drafts(base, ngram, max_tokens):
    prompt_ids = [ngram.tokenize(p) for p in PROMPTS]
    assert len(prompt_ids[0]) != len(prompt_ids[1])
    proposer = ngram.proposer
    calls: list[tuple[int, list[int], int, list[int]]] = []  # (request id, history, cap, drafts)
    orig = proposer.propose

    def propose(batch, max_drafts, uniforms):
        proposal = orig(batch, max_drafts, uniforms)
        for b, req in enumerate(batch.requests):
            n = int(proposal.num_draft_tokens[b])
            calls.append((req.request_id, list(req.all_token_ids), max_drafts[b],
                          proposal.draft_token_ids[b, :n].tolist()))
        return proposal

    params = [greedy(m) for m in max_tokens]
    with patched(proposer, "propose", propose):
        outs = ngram.generate(prompt_ids, params)
    refs = base.generate(prompt_ids, params, use_speculation=False)

    for out, ref, m in zip(outs, refs, max_tokens):
        assert out.token_ids == ref.token_ids and len(out.token_ids) == m
        assert out.text == ref.text
        assert out.metrics.spec.num_drafts > 0  # the repeated phrase gets drafted
        mine = [c for c in calls if c[0] == out.request_id]
        full = out.prompt_token_ids + out.token_ids
        # history lengths: the prompt plus the tokens emitted before each step
        emitted_before = set(itertools.accumulate(out.metrics.tokens_per_step[:-1]))
        prev = -1
        for _, history, cap, drafts in mine:
            n_emitted = len(history) - len(out.prompt_token_ids)
            assert history == full[: len(history)]  # exactly prompt + emitted tokens
            assert n_emitted in emitted_before
            assert n_emitted > prev  # one proposal per step, history only grows
            prev = n_emitted
            # the engine's cap: drafts + 1 <= tokens left
            assert cap == max(0, min(K, m - n_emitted - 1))
            expected = reference_ngram(history, K, LOOKUP_MIN, LOOKUP_MAX)[:cap] if cap > 0 else []
            assert drafts == expected
        # every step where this request had room for a draft consulted the drafter
        consulted = {len(h) - len(out.prompt_token_ids) for _, h, _, _ in mine}
        assert {e for e in emitted_before if min(K, m - e - 1) > 0} <= consulted


def _fresh_kv(model, ids: list[int], num_layers: int, num_kv_heads: int, head_dim: int, dtype):
    cache = KVCache(num_layers, 1, num_kv_heads, len(ids), head_dim, dtype)
    pos = torch.arange(len(ids))[None]
    model(torch.tensor([ids]), pos, cache, kv_len=len(ids))
    return cache


@pytest.mark.parametrize("max_tokens", [(64, 64), (23, 64)], ids=["same", "first_short"])
def test_draft_model_cache_is_prompt_plus_emitted(base, draft_model, max_tokens):
    prompt_ids = [draft_model.tokenize(p) for p in PROMPTS]
    proposer = draft_model.proposer
    dm = proposer.model
    cfg = dm.config
    checked = []
    orig = proposer.on_verified

    @torch.inference_mode()
    def on_verified(batch, num_accepted):
        orig(batch, num_accepted)
        for b, req in enumerate(batch.requests):
            if req.finished:
                continue
            n = proposer.num_computed[b]
            assert len(req.prompt_token_ids) <= n <= req.num_computed
            fresh = _fresh_kv(dm, req.all_token_ids[:n], cfg.num_hidden_layers,
                              cfg.num_key_value_heads, cfg.head_dim, proposer.cache.dtype)
            for layer in range(cfg.num_hidden_layers):
                for got, want in ((proposer.cache.k[layer], fresh.k[layer]), (proposer.cache.v[layer], fresh.v[layer])):
                    torch.testing.assert_close(got[b, :, :n], want[0, :, :n], atol=1e-4, rtol=1e-4)
            checked.append((req.request_id, b))

    params = [greedy(m) for m in max_tokens]
    with patched(proposer, "on_verified", on_verified):
        outs = draft_model.generate(prompt_ids, params)
    refs = base.generate(prompt_ids, params, use_speculation=False)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert any(rid == out.request_id for rid, _ in checked)
    if max_tokens[0] < max_tokens[1]:
        # the long request moved from slot 1 to slot 0 and kept a correct history there
        assert (outs[1].request_id, 1) in checked and (outs[1].request_id, 0) in checked


@pytest.mark.parametrize("max_tokens", [(64, 64), (23, 64)], ids=["same", "first_short"])
def test_suffix_history_and_drafts(base, tiny_llama_dir, max_tokens):
    """The suffix drafter (per-request trees only): at every step each request's tree
    holds exactly prompt + emitted tokens, also after the other request finished and this
    one moved slot; its drafts equal those of a tree built afresh from that history (cut
    to the engine's cap); the output equals non-spec."""
    from specc.runtime.drafters.suffix_tree import SuffixTree

    s = make_session(tiny_llama_dir, drafter_spec("suffix", K, suffix_decoding_max_cached_requests=0))
    proposer = s.proposer
    prompt_ids = [s.tokenize(p) for p in PROMPTS]
    calls: list[tuple[int, list[int], list[int], int, list[int]]] = []  # (id, tree, history, cap, drafts)
    orig = proposer.propose

    def propose(batch, max_drafts, uniforms):
        proposal = orig(batch, max_drafts, uniforms)
        for b, req in enumerate(batch.requests):
            if max_drafts[b] > 0:
                n = int(proposal.num_draft_tokens[b])
                calls.append((req.request_id, proposer.history(req.request_id), list(req.all_token_ids),
                              max_drafts[b], proposal.draft_token_ids[b, :n].tolist()))
        return proposal

    params = [greedy(m) for m in max_tokens]
    with patched(proposer, "propose", propose):
        outs = s.generate(prompt_ids, params)
    refs = base.generate(prompt_ids, params, use_speculation=False)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert out.metrics.spec.num_accepted_tokens > 0  # the repeated phrase gets drafted
        full = out.prompt_token_ids + out.token_ids
        mine = [c for c in calls if c[0] == out.request_id]
        assert mine
        for _, tree, history, cap, drafts in mine:
            assert tree == history == full[: len(history)]  # exactly prompt + emitted tokens
            fresh = SuffixTree(proposer.max_tree_depth)
            fresh.extend(0, history)
            want = fresh.speculate(history, min(K, cap), proposer.max_spec_factor, proposer.min_token_prob)
            assert drafts == want.token_ids
    assert proposer.num_live == 0
