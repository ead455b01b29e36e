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
"""

from __future__ import annotations

import torch
from torch import nn

from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM
from specc.passes.tree_mask import tree_attention_inputs

__all__ = ["VerifyProgram", "TreeVerifyProgram", "PrefillProgram", "flat_kv", "kv_view"]


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
