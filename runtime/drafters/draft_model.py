"""Model drafters: an independent draft model, or the target's first N layers (early exit).

Both run k autoregressive single-token steps of a causal LM over a KV cache and sample
each draft from the drafter's processed distribution q with the request's uniforms, so
rejection sampling can use the real q (Leviathan et al. 2023, Chen et al. 2023).

* ``draft_model``: a second model with the target's tokenizer and its own KV cache; it is
  prefilled with the prompt at admission and catches up on the tokens it has not seen
  (1 token, or 2 after a fully accepted step: the last draft and the bonus token).
* early exit (``draft_model`` with ``num_draft_layers: N``): the target's first N layers +
  final norm + lm_head, sharing the target's weights and the KV cache of those layers. The
  target's verify pass rewrites those layers' K/V at every verified position, so the
  drafter never keeps state of its own and always starts from the target's last token.
"""

from __future__ import annotations

import torch

from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM
from specc.runtime.drafters.base import Proposal, Proposer, StepBatch
from specc.runtime.request import Request
from specc.runtime.sampling import sample_draft


class DraftModelProposer(Proposer):
    """k-step autoregressive drafting with a causal LM.

    Args:
        model: the drafter (or the target itself for early exit).
        num_speculative_tokens: k.
        kv_cache: the drafter's cache (``num_slots >= max_num_seqs``); for early exit, the
            target's own cache.
        target_vocab_size: V of the target; drafter logits are cut or padded to it.
        num_layers: run only the first N layers (early exit); None = whole model.
        shares_target_cache: True for early exit (no state of its own).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_speculative_tokens: int,
        kv_cache: KVCache,
        target_vocab_size: int,
        *,
        num_layers: int | None = None,
        shares_target_cache: bool = False,
    ):
        super().__init__(num_speculative_tokens)
        self.model = model
        self.cache = kv_cache
        self.vocab_size = target_vocab_size
        self.num_layers = num_layers
        self.shares_target_cache = shares_target_cache
        # tokens whose K/V the drafter holds, per slot (separate-cache drafters only)
        self.num_computed = [0] * kv_cache.num_slots
        self._pending: list[int] = []  # per row: num_computed right after drafting

    # -- state ---------------------------------------------------------------------------
    def prefill(self, request: Request, slot: int) -> None:
        if self.shares_target_cache:
            return
        # the drafter sees the prompt now; the first sampled token is fed at the first step
        ids = request.prompt_token_ids
        chunk = 256
        cache = self.cache.slots(slot, slot + 1)
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start : start + chunk]], dtype=torch.long)
            pos = torch.arange(start, start + piece.shape[1], dtype=torch.long)[None]
            self.model(piece, pos, cache, kv_len=start + piece.shape[1], num_layers=self.num_layers)
        self.num_computed[slot] = len(ids)

    def move_slot(self, src: int, dst: int) -> None:
        if not self.shares_target_cache:
            self.cache.copy_slot(src, dst)
            self.num_computed[dst] = self.num_computed[src]

    def _start(self, req: Request, slot: int) -> int:
        return req.num_computed if self.shares_target_cache else self.num_computed[slot]

    # -- drafting ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms: torch.Tensor) -> Proposal:
        B, k = batch.size, self.num_speculative_tokens
        trash, limit = self.cache.trash_pos, self.cache.max_model_len
        cache = self.cache.rows(B)
        # first step: the tokens each row has not fed yet (1, or 2 after a full accept)
        feeds = [r.all_token_ids[self._start(r, b) :] for b, r in enumerate(batch.requests)]
        width = max(len(f) for f in feeds)
        ids = torch.zeros(B, width, dtype=torch.long)
        pos = torch.full((B, width), trash, dtype=torch.long)
        for b, f in enumerate(feeds):
            start = self._start(batch.requests[b], b)
            ids[b, : len(f)] = torch.tensor(f, dtype=torch.long)
            pos[b, : len(f)] = torch.arange(start, start + len(f))
        last = torch.tensor([len(f) - 1 for f in feeds], dtype=torch.long)
        next_pos = torch.tensor([r.num_tokens for r in batch.requests], dtype=torch.long)

        drafts, probs = [], []
        for step in range(k):
            kv_len = int(torch.where(pos == trash, 0, pos).max()) + 1
            out = self.model(ids, pos, cache, kv_len=kv_len, num_layers=self.num_layers)
            logits = out.logits[torch.arange(B), last]  # [B, V_draft]
            logits = self._fit_vocab(logits)
            tok, q = sample_draft(logits, batch.temperature, batch.top_k, batch.top_p, batch.is_greedy,
                                  uniforms[:, step])
            drafts.append(tok)
            probs.append(q)
            # next input: the draft just made, at the next position (trash past the limit)
            ids = tok[:, None]
            p = next_pos + step
            pos = torch.where(p < limit, p, torch.full_like(p, trash))[:, None]
            last = torch.zeros(B, dtype=torch.long)
        draft_ids = torch.stack(drafts, dim=1)
        num = torch.tensor(max_drafts, dtype=torch.long).clamp(max=k)
        self._pending = [self._start(r, b) + len(feeds[b]) + k - 1 for b, r in enumerate(batch.requests)]
        any_sampled = not bool(batch.is_greedy.all())
        return Proposal(draft_ids, num, torch.stack(probs, dim=1) if any_sampled else None)

    def on_verified(self, batch: StepBatch, num_accepted: list[int]) -> None:
        if self.shares_target_cache:
            return
        for b, req in enumerate(batch.requests):
            # K/V at positions < old length + accepted are the verified tokens
            verified = req.num_computed  # engine already advanced it (accepted + 1, fewer after a stop)
            self.num_computed[b] = min(self._pending[b], verified)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
