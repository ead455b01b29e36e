"""The modules specc traces into programs: plain forward functions over the target and
the static KV cache, before any pass runs.

Every program takes the KV cache as one flat tuple ``(k_0, v_0, k_1, v_1, ...)`` of
per-layer tensors ``[b, kv_heads, max_model_len + 1, head_dim]`` (slots ``0..b-1`` of the
session's cache, written in place) and, last, ``key_positions`` ``[kv_len]`` int64
(``arange(kv_len)``): attention reads cache positions ``[0, kv_len)``, with the causal
mask (key ``j`` visible to a query at position ``p`` iff ``j <= p``) hiding what lies
beyond each sequence. ``kv_len`` is the one dynamic dimension of a program (exported as
a symbolic size): a step reads the K/V its rows hold, not the whole cache, while batch
and token widths stay static per bucket.

* :class:`VerifyProgram` — ``[b, T]`` tokens in, ``[b, T, V]`` logits out. With
  ``T = 1`` it is the body of ``decode[b]``; with ``T = k + 1`` (last token + k drafts)
  the body of ``spec_step[b]``. :mod:`specc.passes.accept_reject` then appends the
  on-device accept/reject, so the compiled program returns tokens, not logits.
* :class:`TreeVerifyProgram` — a token tree per row (``N = k + 1`` nodes, the tree as
  inputs): ``[b, N]`` logits under the tree attention mask; the body of ``tree_step[b]``
  (:mod:`specc.passes.tree_accept_reject` appends accept/reject and KV compaction).
* :class:`PrefillProgram` — one prompt chunk ``[1, t]`` in, the logits at one index out.
* :class:`EarlyExitStepProgram` — the draft-then-verify body of ``spec_step[b]`` for an
  early-exit drafter: k draft steps through the target's first N layers, then the
  verify of ``[last, d_1..d_k]``; returns the logits, the verified ids and the drafter's
  q, which :mod:`specc.passes.accept_reject` turns into tokens on the device.
"""

from __future__ import annotations

import torch
from torch import nn

from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM
from specc.passes.tree_mask import tree_attention_inputs
from specc.runtime.sampling import greedy_mask, sample_draft

__all__ = ["VerifyProgram", "TreeVerifyProgram", "PrefillProgram", "EarlyExitStepProgram", "flat_kv", "kv_view"]


def flat_kv(cache: KVCache) -> tuple[torch.Tensor, ...]:
    """``(k_0, v_0, k_1, v_1, ...)``: the per-layer tensors of ``cache`` as programs take them."""
    return tuple(t for pair in zip(cache.k, cache.v) for t in pair)


def kv_view(kv: tuple[torch.Tensor, ...], max_model_len: int) -> KVCache:
    """A :class:`KVCache` over the flat tuple ``kv`` (no copy)."""
    cache = KVCache.__new__(KVCache)
    cache._init_views(list(kv[0::2]), list(kv[1::2]), max_model_len)
    return cache


def _kv_len(key_positions: torch.Tensor | None):
    """Keys attended: ``key_positions``' length (symbolic under export), or the whole cache."""
    return None if key_positions is None else key_positions.shape[0]


class VerifyProgram(nn.Module):
    """Target forward over ``T`` tokens per row, every key position of the cache.

    forward(input_ids ``[b, T]`` int64, positions ``[b, T]`` int64 (padding at
    ``max_model_len``, the cache's trash position), kv, key_positions ``[kv_len]`` or
    None (the whole cache)) -> logits ``[b, T, V]`` float32.
    """

    def __init__(self, model: LlamaForCausalLM, max_model_len: int) -> None:
        super().__init__()
        self.model = model
        self.max_model_len = max_model_len

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, ...],
                key_positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_view(kv, self.max_model_len),
                          kv_len=_kv_len(key_positions)).logits


class TreeVerifyProgram(nn.Module):
    """Target forward over a token tree per row (:mod:`specc.runtime.token_tree`), every
    node in one pass; the tree's positions and mask are built in the graph by
    :func:`specc.passes.tree_mask.tree_attention_inputs` (the builder the eager engine
    calls), so the tree is a program input, not a constant.

    forward(input_ids ``[b, N]`` int64 (``[last token, node 1 .. node N-1]``), start
    ``[b]`` int64 (the root's cache position, ``num_computed``), parents ``[b, N-1]``
    int64 (node ``i + 1``'s parent at ``[:, i]``, in ``0..i``), num_draft_tokens ``[b]``
    int64 (nodes ``1..num_draft_tokens`` exist; the rest write at the trash position),
    kv, key_positions ``[kv_len]``) -> logits ``[b, N, V]`` float32 (row ``i``: after
    node ``i`` along its path). Node ``m``'s K/V is written at ``start + m``.
    """

    def __init__(self, model: LlamaForCausalLM, max_model_len: int) -> None:
        super().__init__()
        self.model = model
        self.max_model_len = max_model_len

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, parents: torch.Tensor,
                num_draft_tokens: torch.Tensor, kv: tuple[torch.Tensor, ...],
                key_positions: torch.Tensor) -> torch.Tensor:
        kv_len = key_positions.shape[0]
        tree = tree_attention_inputs(parents, num_draft_tokens, start, kv_len, self.max_model_len)
        return self.model(input_ids, tree.positions, kv_view(kv, self.max_model_len), kv_len=kv_len,
                          attn_mask=tree.mask, cache_positions=tree.cache_positions).logits


class PrefillProgram(nn.Module):
    """Target forward over one prompt chunk; returns the logits at ``last_index``.

    forward(input_ids ``[1, t]`` int64, positions ``[1, t]`` int64 (padding at the trash
    position), last_index ``[1]`` int64 (the chunk's last real token), kv,
    key_positions ``[kv_len]`` or None) -> logits ``[1, V]`` float32.
    """

    def __init__(self, model: LlamaForCausalLM, max_model_len: int) -> None:
        super().__init__()
        self.model = model
        self.max_model_len = max_model_len

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_index: torch.Tensor,
                kv: tuple[torch.Tensor, ...], key_positions: torch.Tensor | None = None) -> torch.Tensor:
        model, n = self.model, self.model.config.num_hidden_layers
        out = model(input_ids, positions, kv_view(kv, self.max_model_len), kv_len=_kv_len(key_positions),
                    hidden_layers=(n,))
        # norm + lm_head at the one position needed; the full logits are dead code (the
        # compiler drops them), which saves t - 1 rows of the vocabulary GEMM
        h = out.hidden_states[n].index_select(1, last_index)
        return model.lm_head(model.model.norm(h)).float().squeeze(1)


class EarlyExitStepProgram(nn.Module):
    """Draft-then-verify for an early-exit drafter (the target's first ``num_draft_layers``
    layers + final norm + lm_head over the shared cache), as one traced forward.

    The draft loop is :meth:`specc.runtime.drafters.draft_model.DraftModelProposer.propose`
    for a shared cache, unrolled: step ``s`` feeds the last token (``s = 0``) or draft
    ``d_s`` at position ``start + s`` (the trash position from ``max_model_len`` on),
    writes the first N layers' K/V there and draws ``d_{s+1}`` with
    :func:`~specc.runtime.sampling.sample_draft` from ``uniforms[:, s]`` (greedy rows: the
    argmax). The verify then rewrites every layer's K/V at the verified positions, so the
    drafter keeps no state between steps.

    forward(input_ids ``[b, 1]`` int64 (each row's last token), positions ``[b, k + 1]``
    int64 (the verify positions: ``start + i`` for ``i <= num_draft_tokens``, the trash
    position after; column 0 is the last token's, where drafting starts), kv,
    key_positions ``[kv_len]`` (``kv_len`` must cover ``start + k`` for the draft steps),
    uniforms ``[b, 2k + 1]`` float32 (columns ``0..k-1`` are the drafter's), temperature,
    top_k, top_p ``[b]``) -> ``(logits [b, k + 1, V] float32, verified ids [b, k + 1]
    int64 = [last, d_1..d_k], draft_probs [b, k, V] float32)``.
    """

    def __init__(self, model: LlamaForCausalLM, max_model_len: int, num_draft_layers: int,
                 num_speculative_tokens: int) -> None:
        super().__init__()
        self.model = model
        self.max_model_len = max_model_len
        self.num_draft_layers = num_draft_layers
        self.k = num_speculative_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, ...],
                key_positions: torch.Tensor | None, uniforms: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor):
        cache, kv_len, limit = kv_view(kv, self.max_model_len), _kv_len(key_positions), self.max_model_len
        is_greedy = greedy_mask(temperature)
        tok, pos = input_ids, positions[:, :1]
        drafts, probs = [input_ids], []
        for step in range(self.k):
            logits = self.model(tok, pos, cache, kv_len=kv_len, num_layers=self.num_draft_layers).logits[:, 0]
            draft, q = sample_draft(logits, temperature, top_k, top_p, is_greedy, uniforms[:, step])
            tok = draft[:, None]
            drafts.append(tok)
            probs.append(q)
            pos = (positions[:, :1] + step + 1).clamp_max(limit)  # trash position from the limit on
        ids = torch.cat(drafts, dim=1)
        logits = self.model(ids, positions, cache, kv_len=kv_len).logits
        return logits, ids, torch.stack(probs, dim=1)
