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
* :class:`EagleStepProgram` — the same for an EAGLE / EAGLE-3 head: the head's catch-up
  over the pairs the last step left, its k chain steps, the verify (whose fused features
  it writes into the ``features`` state); :class:`EaglePrefillProgram` — the prefill
  that also runs the head's prompt pass. Both take the head's state after the target's:
  ``head_kv`` (the head's per-layer K/V, like ``kv``) and ``features`` ``[b,
  max_model_len + 1, hidden]`` (the fused target feature at each position), written in
  place. The draft loop the two step programs share is :func:`chain_drafts`.
"""

from __future__ import annotations

import torch
from torch import nn

from specc.models.eagle import EagleHeadBase
from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM
from specc.passes.tree_mask import tree_attention_inputs
from specc.runtime.sampling import greedy_mask, sample_draft

__all__ = ["VerifyProgram", "TreeVerifyProgram", "PrefillProgram", "EarlyExitStepProgram", "EaglePrefillProgram",
           "EagleStepProgram", "chain_drafts", "flat_kv", "kv_view"]


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
        n = self.model.config.num_hidden_layers
        out = self.model(input_ids, positions, kv_view(kv, self.max_model_len), kv_len=_kv_len(key_positions),
                         hidden_layers=(n,))
        return self._last_logits(out.hidden_states[n], last_index)

    def _last_logits(self, last_hidden: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        """``[1, V]`` float32 logits of the last layer's output ``[1, t, H]`` at ``last_index``."""
        model = self.model
        # norm + lm_head at the one position needed; the full logits are dead code (the
        # compiler drops them), which saves t - 1 rows of the vocabulary GEMM
        h = last_hidden.index_select(1, last_index)
        return model.lm_head(model.model.norm(h)).float().squeeze(1)


class _FusedStepProgram(nn.Module):
    """What the draft-then-verify programs hold: the target, the trash position
    (``max_model_len``) and k."""

    def __init__(self, model: LlamaForCausalLM, max_model_len: int, num_speculative_tokens: int) -> None:
        super().__init__()
        self.model = model
        self.max_model_len = max_model_len
        self.k = num_speculative_tokens


class EarlyExitStepProgram(_FusedStepProgram):
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
        super().__init__(model, max_model_len, num_speculative_tokens)
        self.num_draft_layers = num_draft_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, ...],
                key_positions: torch.Tensor | None, uniforms: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor):
        cache, kv_len, limit = kv_view(kv, self.max_model_len), _kv_len(key_positions), self.max_model_len

        def next_logits(step: int, tok: torch.Tensor) -> torch.Tensor:
            pos = (positions[:, :1] + step).clamp_max(limit)  # trash position from the limit on
            return self.model(tok, pos, cache, kv_len=kv_len, num_layers=self.num_draft_layers).logits[:, 0]

        ids, q = chain_drafts(self.k, input_ids, next_logits, uniforms, temperature, top_k, top_p)
        logits = self.model(ids, positions, cache, kv_len=kv_len).logits
        return logits, ids, q


def chain_drafts(k: int, last: torch.Tensor, next_logits, uniforms: torch.Tensor, temperature: torch.Tensor,
                 top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft loop of the fused step programs: k chain steps, step ``s`` drawing
    ``d_{s+1}`` with :func:`~specc.runtime.sampling.sample_draft` from ``uniforms[:, s]``
    (greedy rows: the argmax), as the eager proposers do.

    Args:
        k: draft steps.
        last: ``[b, 1]`` int64, each row's last token.
        next_logits: ``(step, tokens [b, 1] int64) -> [b, V]`` float32 raw drafter logits
            of the next token, ``tokens`` being the last token (step 0) or ``d_step``.
        uniforms: ``[b, >= k]`` float32 (columns ``0..k-1`` are the drafter's).
        temperature, top_k, top_p: ``[b]`` the rows' processors.

    Returns:
        ``(ids [b, k + 1] int64 = [last, d_1..d_k], draft_probs [b, k, V] float32)``.
    """
    is_greedy = greedy_mask(temperature)
    tok, drafts, probs = last, [last], []
    for step in range(k):
        draft, q = sample_draft(next_logits(step, tok), temperature, top_k, top_p, is_greedy, uniforms[:, step])
        tok = draft[:, None]
        drafts.append(tok)
        probs.append(q)
    return torch.cat(drafts, dim=1), torch.stack(probs, dim=1)


def _scatter_features(features: torch.Tensor, positions: torch.Tensor, feats: torch.Tensor) -> None:
    """Write ``feats`` ``[b, T, H]`` into ``features`` ``[b, S + 1, H]`` at ``positions``
    ``[b, T]`` (in place; padding lands at the trash position), as the eager
    :meth:`~specc.runtime.drafters.eagle.EagleProposer.on_target_hidden_states`."""
    features.scatter_(1, positions[:, :, None].expand(feats.shape), feats.to(features.dtype))


def _gather_features(features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[b, T, H]``: the features at ``positions`` ``[b, T]``."""
    b, t = positions.shape
    return features.gather(1, positions[:, :, None].expand(b, t, features.shape[-1]))


def _target_features(head: EagleHeadBase, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
    """``[b, T, H]``: the head's fused features of one target forward's hidden states."""
    return head.fuse(torch.stack([hidden_states[i] for i in head.hidden_layers], dim=2))


class EaglePrefillProgram(PrefillProgram):
    """:class:`PrefillProgram` that also leaves an EAGLE / EAGLE-3 head ready: the chunk's
    fused target features are written into ``features`` at their positions, and the head
    runs over the pairs ``(f_{p-1}, x_p)`` at position ``p - 1`` for each chunk token
    ``p > 0`` (the pair at the chunk's first token reads ``f_{p-1}`` from the previous
    chunk), writing its K/V. So after the prompt's last chunk the head holds the pairs
    at ``0 .. n-2``, as the eager :meth:`~specc.runtime.drafters.eagle.EagleProposer.prefill`
    leaves it (the pair at ``n - 1`` waits for the first step, whose draft it predicts).

    forward(input_ids ``[1, t]``, positions ``[1, t]``, last_index ``[1]``, kv,
    key_positions, head_kv (the head's per-layer K/V, ``[1, kv_heads, S + 1, head_dim]``
    each), features ``[1, S + 1, H]``) -> logits ``[1, V]`` float32.
    """

    def __init__(self, model: LlamaForCausalLM, head: EagleHeadBase, max_model_len: int) -> None:
        super().__init__(model, max_model_len)
        self.head = head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_index: torch.Tensor,
                kv: tuple[torch.Tensor, ...], key_positions: torch.Tensor | None = None,
                head_kv: tuple[torch.Tensor, ...] = (), features: torch.Tensor | None = None) -> torch.Tensor:
        n, trash, kv_len = self.model.config.num_hidden_layers, self.max_model_len, _kv_len(key_positions)
        layers = tuple(sorted({n, *self.head.hidden_layers}))
        out = self.model(input_ids, positions, kv_view(kv, trash), kv_len=kv_len, hidden_layers=layers)
        _scatter_features(features, positions, _target_features(self.head, out.hidden_states))
        pair_pos = torch.where((positions > 0) & (positions < trash), positions - 1, trash)
        # only the head's K/V writes are kept: its outputs are dead code here
        self.head(input_ids, _gather_features(features, pair_pos), pair_pos, kv_view(head_kv, trash), kv_len=kv_len)
        return self._last_logits(out.hidden_states[n], last_index)


class EagleStepProgram(_FusedStepProgram):
    """Draft-then-verify for an EAGLE / EAGLE-3 head, as one traced forward: the eager
    :meth:`specc.runtime.drafters.eagle.EagleProposer.propose` (catch-up, then k - 1
    chain steps), then the verify, whose fused features are written into ``features``
    for the next step's catch-up (rejected drafts' features lie at or beyond the
    sequence length and are rewritten before they are read, as their K/V).

    1. catch-up: the head runs over the pairs ``(f_p, x_{p+1})`` at ``pair_positions``
       (``p = done .. n - 1``, the trash position after; features read from
       ``features``); its output at the row's last real pair gives draft 1's logits;
    2. chain step ``s = 1 .. k - 1``: the pair (head output, ``d_s``) at position
       ``n - 1 + s`` (the trash position from ``max_model_len`` on);
    3. the target verify of ``[last, d_1..d_k]`` at ``positions``.

    Drafts are sampled by :func:`chain_drafts` (same columns of the same uniforms as the
    eager proposer).

    forward(input_ids ``[b, 1]`` int64 (last tokens), positions ``[b, k + 1]`` int64
    (verify positions, as :class:`EarlyExitStepProgram`; column 0 is ``n``), kv,
    key_positions ``[kv_len]`` (covering ``n + k - 1`` too), uniforms ``[b, 2k + 1]``,
    temperature, top_k, top_p ``[b]``, head_kv, features ``[b, S + 1, H]``, pair_ids
    ``[b, k + 1]`` int64 (``x_{p+1}`` of each catch-up pair; padding: any id),
    pair_positions ``[b, k + 1]`` int64 (``done .. n - 1``, then the trash position))
    -> ``(logits [b, k + 1, V] float32, verified ids [b, k + 1] int64, draft_probs
    [b, k, V] float32)``.
    """

    def __init__(self, model: LlamaForCausalLM, head: EagleHeadBase, max_model_len: int,
                 num_speculative_tokens: int) -> None:
        super().__init__(model, max_model_len, num_speculative_tokens)
        self.head = head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, ...],
                key_positions: torch.Tensor | None, uniforms: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, head_kv: tuple[torch.Tensor, ...],
                features: torch.Tensor, pair_ids: torch.Tensor, pair_positions: torch.Tensor):
        trash, kv_len, head = self.max_model_len, _kv_len(key_positions), self.head
        head_cache = kv_view(head_kv, trash)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        last_pair = ((pair_positions != trash).sum(dim=1) - 1).clamp_min(0)  # [b]
        h = None  # [b, 1, H]: the head's last output, the next pair's feature

        def next_logits(step: int, tok: torch.Tensor) -> torch.Tensor:
            nonlocal h
            if step == 0:  # catch-up over the pairs the last step left
                out = head(pair_ids, _gather_features(features, pair_positions), pair_positions, head_cache,
                           kv_len=kv_len)
                h = out[rows, last_pair][:, None]
            else:
                pos = (positions[:, :1] + step - 1).clamp_max(trash)
                h = head(tok, h, pos, head_cache, kv_len=kv_len)
            return head.compute_logits(h[:, 0])

        ids, q = chain_drafts(self.k, input_ids, next_logits, uniforms, temperature, top_k, top_p)
        out = self.model(ids, positions, kv_view(kv, trash), kv_len=kv_len, hidden_layers=head.hidden_layers)
        _scatter_features(features, positions, _target_features(head, out.hidden_states))
        return out.logits, ids, q
