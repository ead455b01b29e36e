"""EAGLE / EAGLE-3 chain drafting: k autoregressive steps of a feature-level head.

Contract with the engine (``Proposer.hidden_layers``): every eager target forward hands
the proposer the hidden states it listed, with their positions
(:meth:`EagleProposer.on_target_hidden_states`). The proposer fuses them into features
(:meth:`~specc.models.eagle.EagleHeadBase.fuse`) and writes them into a per-slot buffer
``[slots, max_model_len + 1, hidden]`` at their positions, exactly as the target writes
K/V: padding lands at the trash position, and features of rejected drafts lie at or
beyond the sequence length, to be overwritten before anyone reads them.

A step for the request in slot ``b`` with ``n = num_computed`` verified tokens (the target
holds features ``f_0 .. f_{n-1}``; the last token ``x_n`` is not verified yet):

1. catch-up: the head runs over the pairs ``(f_p, x_{p+1})`` at positions
   ``p = done_b .. n-1`` that it has not seen with true target features (the tokens
   emitted by the last verify; at admission :meth:`prefill` has already run the prompt's
   pairs up to ``n - 2``); its output at ``n - 1`` gives the logits of draft 1;
2. draft step ``j = 1 .. k-1``: the pair (head output, ``d_j``) at position ``n - 1 + j``.

Each draft is sampled from the head's processed distribution q (same temperature /
top-k / top-p as the target) with the request's uniforms, and q goes to rejection
sampling (Leviathan et al. 2023, Chen et al. 2023), so output is lossless; greedy rows
take the argmax. EAGLE-3's q is over its draft vocabulary, placed at the target ids
(zero elsewhere). Papers: Li et al. 2024 (EAGLE), Li et al. 2025 (EAGLE-3).
"""

from __future__ import annotations

import torch

from specc.models.eagle import EagleHeadBase
from specc.models.kv_cache import KVCache
from specc.runtime.drafters.base import Proposal, Proposer, StepBatch
from specc.runtime.request import Request
from specc.runtime.sampling import sample_draft

__all__ = ["EagleProposer", "EagleState"]

PREFILL_CHUNK = 256  # prompt pairs per head forward at admission


class EagleState:
    """Per-slot state of an EAGLE head, on the eager path and as compiled program state.

    Args:
        cache: the head's KV cache (``num_slots`` slots, ``max_model_len + 1`` positions).
        hidden_size: the head's feature width H.

    Attributes:
        cache: as given; written by the head at each pair's position.
        features: ``[slots, max_model_len + 1, H]`` (the cache's dtype and device): the
            fused target feature at each position, written as the target writes K/V.
        done: per slot, positions ``< done`` hold pairs the head ran with true features.
    """

    def __init__(self, cache: KVCache, hidden_size: int):
        self.cache = cache
        k0 = cache.k[0]
        self.features = torch.zeros(cache.num_slots, cache.max_len, hidden_size, dtype=k0.dtype, device=k0.device)
        self.done = [0] * cache.num_slots

    def move_slot(self, src: int, dst: int) -> None:
        """Slot ``src``'s head K/V, features and ``done`` move to slot ``dst``."""
        self.cache.copy_slot(src, dst)
        self.features[dst].copy_(self.features[src])
        self.done[dst] = self.done[src]

    def catch_up_pairs(self, requests: list[Request], slot0: int = 0,
                       width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs each row (request ``i`` in slot ``slot0 + i``) has not run with true
        features: positions ``min(done, n - 1) .. n - 1`` (at least one: its output gives
        draft 1), padded at the trash position, then marks them done (``done = n``).

        ``width``: the pairs per row (a compiled step's ``k + 1``); a row with more
        pending keeps its last ``width`` (only a row that will draft no more can fall that
        far behind: see :class:`~specc.runtime.drafters.in_graph.InGraphDrafter`).
        None: as many as the most behind row needs.

        Returns:
            (tokens ``[B, W]`` int64 (``x_{p+1}`` of each pair), positions ``[B, W]``
            int64, index of each row's last real pair ``[B]`` int64), on the CPU.
        """
        n = [r.num_computed for r in requests]
        start = [min(self.done[slot0 + b], n[b] - 1) for b in range(len(requests))]
        if width is not None:
            start = [max(s, m - width) for s, m in zip(start, n)]
        width = width if width is not None else max(m - s for m, s in zip(n, start))
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        pos = torch.full((len(requests), width), self.cache.trash_pos, dtype=torch.long)
        for b, r in enumerate(requests):
            ids[b, : n[b] - start[b]] = torch.tensor(r.all_token_ids[start[b] + 1 : n[b] + 1], dtype=torch.long)
            pos[b, : n[b] - start[b]] = torch.arange(start[b], n[b])
            self.done[slot0 + b] = n[b]
        return ids, pos, torch.tensor([m - s - 1 for m, s in zip(n, start)])


class EagleProposer(Proposer):
    """Chain drafting with an EAGLE or EAGLE-3 head.

    Args:
        head: the loaded head (:func:`specc.models.eagle_checkpoint.load_eagle_head`).
        num_speculative_tokens: k.
        num_slots, max_model_len: as the target's KV cache (the head's cache and feature
            buffer have the same slots and length).
    """

    def __init__(self, head: EagleHeadBase, num_speculative_tokens: int, num_slots: int, max_model_len: int):
        super().__init__(num_speculative_tokens)
        self.head = head
        self.hidden_layers = head.hidden_layers
        self.state = EagleState(head.make_cache(num_slots, max_model_len), head.config.hidden_size)

    @property
    def cache(self) -> KVCache:
        return self.state.cache

    @property
    def features(self) -> torch.Tensor:
        return self.state.features

    # -- state ---------------------------------------------------------------------------
    @torch.inference_mode()
    def on_target_hidden_states(self, slot0: int, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store the target's states of rows ``slot0 ..`` (``positions`` ``[B, T]``,
        ``hidden`` ``[B, T, len(hidden_layers), H]``) as features at their positions."""
        b, t = positions.shape
        feats = self.head.fuse(hidden.to(self.features.dtype))             # [B, T, H]
        index = positions[:, :, None].expand(b, t, feats.shape[-1]).to(self.features.device)
        self.features[slot0 : slot0 + b].scatter_(1, index, feats)

    @torch.inference_mode()
    def prefill(self, request: Request, slot: int) -> None:
        """Run the head over the prompt's pairs at positions ``0 .. n-2`` (the pair at
        ``n - 1`` waits for the first step, whose draft it predicts)."""
        n = len(request.prompt_token_ids)
        ids = request.all_token_ids
        cache = self.cache.slots(slot, slot + 1)
        for start in range(0, n - 1, PREFILL_CHUNK):
            stop = min(start + PREFILL_CHUNK, n - 1)
            tok = torch.tensor([ids[start + 1 : stop + 1]], dtype=torch.long, device=self.features.device)
            pos = torch.arange(start, stop, dtype=torch.long, device=self.features.device)[None]
            self.head(tok, self.features[slot : slot + 1, start:stop], pos, cache, kv_len=stop)
        self.state.done[slot] = max(n - 1, 0)

    def move_slot(self, src: int, dst: int) -> None:
        self.state.move_slot(src, dst)

    # -- drafting ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms: torch.Tensor) -> Proposal:
        B, k, dev = batch.size, self.num_speculative_tokens, self.features.device
        trash, limit = self.cache.trash_pos, self.cache.max_model_len
        temperature, top_k, top_p, greedy = (x.to(dev) for x in (batch.temperature, batch.top_k, batch.top_p,
                                                                  batch.is_greedy))
        uniforms = uniforms.to(dev)
        ids, pos, last = (x.to(dev) for x in self.state.catch_up_pairs(batch.requests))
        rows = torch.arange(B, device=dev)
        feats = self.features[rows[:, None], pos]                         # [B, W, H]
        next_pos = torch.tensor([r.num_computed for r in batch.requests], device=dev)
        cache = self.cache.rows(B)

        drafts, probs = [], []
        for step in range(k):
            kv_len = int(torch.where(pos == trash, 0, pos).max()) + 1
            h = self.head(ids, feats, pos, cache, kv_len=kv_len)[rows, last]  # [B, H]
            tok, q = sample_draft(self.head.compute_logits(h), temperature, top_k, top_p, greedy,
                                  uniforms[:, step])
            drafts.append(tok)
            probs.append(q)
            # next pair: (this output, this draft) at the next position (trash past the limit)
            ids, feats = tok[:, None], h[:, None]
            p = next_pos + step
            pos = torch.where(p < limit, p, torch.full_like(p, trash))[:, None]
            last = torch.zeros(B, dtype=torch.long, device=dev)
        num = torch.tensor(max_drafts, dtype=torch.long).clamp(max=k)
        any_sampled = not bool(batch.is_greedy.all())
        return Proposal(torch.stack(drafts, dim=1).cpu(), num,
                        torch.stack(probs, dim=1).cpu() if any_sampled else None)
