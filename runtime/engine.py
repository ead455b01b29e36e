"""The eager step loop: admit → prefill → (draft → verify → accept/reject) → stop checks.

This is the reference path: every compiled program must match it token for token.

One step for B live requests (request i in KV slot i):

1. each row draws ``2k + 1`` uniforms from its own generator (k for a sampling drafter,
   k for accept tests, 1 for the recovered/bonus token), always the same count, so a seeded
   request is reproducible whatever it is batched with;
2. the proposer drafts up to ``max_new_drafts`` tokens per row;
3. the target verifies ``[last_token, d_1 .. d_n]`` in one forward (rows with fewer drafts
   are padded at the cache's trash position); a proposer that lists ``hidden_layers``
   (EAGLE) receives those hidden states of every target forward, prompt chunks included
   (``Proposer.on_target_hidden_states``);
4. :func:`specc.kernels.rejection_sampler.rejection_sample` accepts a prefix and adds one
   recovered or bonus token, on the device, as tensor code;
5. only the accepted counts and tokens come back to the host, which applies stop checks,
   logprobs and counters. Rejected positions need no rollback: their K/V lies beyond the
   sequence's length and is rewritten before any query can see it.

A proposal may carry a token *tree* (``Proposal.parents``; deterministic drafts only):
step 3 then feeds all nodes under the tree attention mask with depth positions
(:func:`specc.passes.tree_mask.tree_attention_inputs`), step 4 is
:func:`specc.kernels.tree_rejection_sampler.tree_rejection_sample` (one accepted path),
and the path's K/V is moved after the prefix (:mod:`specc.passes.kv_compaction`) before
the next step; a proposer with ``hidden_layers`` (EAGLE) receives the target states of
the accepted path only, at the path's sequence positions. Chain proposals (``parents`` None) take the chain path unchanged.

Non-speculative decoding is the same step with no drafts.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from specc.kernels.rejection_sampler import rejection_sample
from specc.kernels.tree_rejection_sampler import tree_rejection_sample
from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM
from specc.outputs import TokenLogprob
from specc.passes.kv_compaction import compact_accepted_kv
from specc.passes.accept_reject import processed_logits
from specc.passes.tree_accept_reject import path_logits
from specc.passes.tree_mask import tree_attention_inputs
from specc.runtime.drafters.base import Proposer, StepBatch
from specc.runtime.request import Request
from specc.runtime.sampling import compute_logprobs, process_logits, sample_from_probs
from specc.runtime.tracing import stage, traced

PREFILL_CHUNK = 256  # prompt tokens per prefill forward (bounds the logits' memory)


class Engine:
    """Runs requests to completion on one target model and an optional proposer.

    Args:
        model: the target.
        kv_cache: ``num_slots`` = max_num_seqs, length max_model_len + 1 (trash position).
        detokenize: ``list[int] -> str`` (stop strings, streaming).
        proposer: the drafter, or None for non-speculative decoding.
        max_num_seqs: most requests running at once (default: the cache's slots).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        detokenize: Callable[[list[int]], str],
        proposer: Proposer | None = None,
        max_num_seqs: int | None = None,
    ):
        self.model = model
        self.max_num_seqs = max_num_seqs or kv_cache.num_slots
        self.cache = kv_cache
        self.detokenize = traced(detokenize, "specc.detokenize")
        self.proposer = proposer
        self.k = proposer.num_speculative_tokens if proposer else 0

    # -- public --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, requests: list[Request], on_step: Callable[[list[Request]], None] | None = None) -> None:
        """Generate until every request finishes. Requests are admitted in order as KV slots
        free up (continuous batching); ``on_step(live_or_just_finished)`` runs after each
        step, for streaming."""
        waiting = deque(requests)
        running: list[Request] = []
        while waiting or running:
            while waiting and len(running) < self.max_num_seqs:
                req = waiting.popleft()
                running.append(req)
                with stage("specc.prefill"):
                    self._prefill(req, len(running) - 1)
            touched = list(running)
            if any(not r.finished for r in running):
                with stage("specc.step"):
                    self._step([r for r in running])
            for req in [r for r in running if r.finished]:
                self._release(running, req)
                req.metrics.total_time = time.perf_counter() - req.arrival_time
            if on_step is not None:
                on_step(touched)

    # -- internals -----------------------------------------------------------------------
    def _release(self, running: list[Request], req: Request) -> None:
        """Free ``req``'s slot; the request in the last slot moves into it."""
        if self.proposer is not None:
            self.proposer.finish(req)
        i, last = running.index(req), len(running) - 1
        if i != last:
            self.cache.copy_slot(last, i)
            if self.proposer is not None:
                self.proposer.move_slot(last, i)
            running[i] = running[last]
        running.pop()

    def _prefill(self, req: Request, slot: int) -> None:
        """Write the prompt's K/V into ``slot`` and sample the first output token."""
        logits = self._prefill_logits(req.prompt_token_ids, slot)  # [1, V]
        req.num_computed = len(req.prompt_token_ids)
        batch = self._batch([req])
        processed = process_logits(logits, batch.temperature, batch.top_k, batch.top_p)
        u = torch.rand(1, generator=req.generator)
        if bool(batch.is_greedy[0]):
            tok = logits.argmax(-1)
        else:
            tok = sample_from_probs(torch.softmax(processed, -1), u)
        lp = _EagerLogprobs(processed[None], [[int(tok)]])
        self._emit(req, [int(tok)], lambda n, top: lp(0, n, top), num_drafts=None)
        req.metrics.time_to_first_token = time.perf_counter() - req.arrival_time
        if self.proposer is not None and not req.finished:
            self.proposer.prefill(req, slot)

    def _prefill_logits(self, ids: list[int], slot: int) -> torch.Tensor:
        """Run the prompt ``ids`` through the target into ``slot``'s cache, in chunks of
        ``PREFILL_CHUNK`` tokens; returns the raw logits ``[1, V]`` of its last token."""
        cache = self.cache.slots(slot, slot + 1)
        for start in range(0, len(ids), PREFILL_CHUNK):
            piece = torch.tensor([ids[start : start + PREFILL_CHUNK]], dtype=torch.long)
            pos = torch.arange(start, start + piece.shape[1], dtype=torch.long)[None]
            logits = self._target(piece, pos, cache, start + piece.shape[1], slot)
        return logits[:, -1]

    def _target(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, kv_len: int, slot0: int,
                **tree) -> torch.Tensor:
        """One target forward over ``cache`` (slots ``slot0 ..``); returns logits
        ``[B, T, V]`` and hands the proposer the hidden states it lists, if any.
        ``tree``: ``attn_mask`` and ``cache_positions`` of a tree verify."""
        logits, hidden = self._target_hidden(ids, pos, cache, kv_len, **tree)
        if hidden is not None:
            self.proposer.on_target_hidden_states(slot0, pos, hidden)
        return logits

    def _target_hidden(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, kv_len: int,
                       **tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward: (logits ``[B, T, V]``, the hidden states the proposer lists
        ``[B, T, len(hidden_layers), H]``, or None when it lists none), handed to no one."""
        layers = self.proposer.hidden_layers if self.proposer is not None else ()
        out = self.model(ids, pos, cache, kv_len=kv_len, hidden_layers=layers, **tree)
        if not layers:
            return out.logits, None
        return out.logits, torch.stack([out.hidden_states[i] for i in layers], dim=2)

    def _step(self, running: list[Request]) -> None:
        B, k = len(running), self.k
        batch = self._batch(running)
        uniforms = torch.stack([torch.rand(2 * k + 1, generator=r.generator) for r in running])
        caps = [0 if r.finished else r.max_new_drafts(k) for r in running]

        if self.proposer is not None and max(caps) > 0:
            with stage("specc.draft"):
                proposal = self.proposer.propose(batch, caps, uniforms[:, :k])
            nd = torch.minimum(proposal.num_draft_tokens, torch.tensor(caps))
            K = int(nd.max())
            drafts = proposal.draft_token_ids[:, :K]
            draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[:, :K]
        else:
            proposal, K = None, 0
            nd = torch.zeros(B, dtype=torch.long)
            drafts, draft_probs = torch.zeros(B, 0, dtype=torch.long), None

        is_tree = proposal is not None and proposal.parents is not None
        paths = [[] for _ in running] if is_tree else None  # a tree proposer always learns its paths
        if is_tree and K > 0:
            # the first nd[b] nodes of a tree are a tree (parents precede children)
            tokens, accepted, logprobs, paths = self._verify_tree(
                running, batch, drafts, proposal.parents[:, :K], nd, draft_probs, uniforms)
        else:
            tokens, accepted, logprobs = self._verify(running, batch, drafts, nd, draft_probs, uniforms)
        nds = nd.tolist()
        with stage("specc.bookkeeping"):
            for b, req in enumerate(running):
                if req.finished:
                    continue
                req.num_computed += self._emit(req, tokens[b][: accepted[b] + 1],
                                               lambda n, top, b=b: logprobs(b, n, top), num_drafts=nds[b])
            if self.proposer is not None and proposal is not None:
                if paths is None:
                    self.proposer.on_verified(batch, accepted)
                else:
                    self.proposer.on_verified(batch, accepted, accepted_paths=paths)

    def _verify(self, running: list[Request], batch: StepBatch, drafts: torch.Tensor, nd: torch.Tensor,
                draft_probs: torch.Tensor | None, uniforms: torch.Tensor):
        """Target verify + accept/reject for one step.

        Args:
            drafts: ``[B, K]`` int64 draft tokens (``K`` may be 0); ``nd``: ``[B]`` int64
                drafts per row; ``draft_probs``: ``[B, K, V]`` or None (one-hot q);
                ``uniforms``: ``[B, 2k + 1]`` float32 (see the module docstring).

        Returns:
            ``(tokens, accepted, logprobs)``: per row the emitted block
            ``tokens[b][: accepted[b] + 1]`` (lists of ints), and
            ``logprobs(b, n, num_top) -> (token_logprob [n], top_ids [n, num_top],
            top_logprobs [n, num_top])`` for the first ``n`` emitted tokens of row ``b``.
        """
        B, k, K = len(running), self.k, drafts.shape[1]
        ids, start, kv_len = self._verify_inputs(running, drafts, nd)
        # positions past each row's drafts → trash
        offs = torch.arange(K + 1)
        pos = start[:, None] + offs[None]
        pos = torch.where(offs[None] <= nd[:, None], pos, torch.full_like(pos, self.cache.trash_pos))
        with stage(f"specc.verify[{K + 1}]"):
            logits = self._target(ids, pos, self.cache.rows(B), kv_len, 0)  # [B, K+1, V]

        with stage("specc.accept"):
            processed = self._process(logits, batch)
            result = rejection_sample(
                processed, drafts, nd, draft_probs, batch.is_greedy,
                uniforms[:, k : k + K], uniforms[:, 2 * k],
            )
            tokens = result.output_token_ids.tolist()
            accepted = result.num_accepted.tolist()
        return tokens, accepted, _EagerLogprobs(processed, tokens)

    def _verify_tree(self, running: list[Request], batch: StepBatch, drafts: torch.Tensor, parents: torch.Tensor,
                     nd: torch.Tensor, draft_probs: torch.Tensor | None, uniforms: torch.Tensor):
        """:meth:`_verify` for a token tree per row, then KV compaction of the accepted path.

        Args:
            parents: ``[B, K]`` int64, node ``i + 1``'s parent (``0..i``) at ``[:, i]``
                (:mod:`specc.runtime.token_tree`); the rest as :meth:`_verify`.

        Returns:
            ``(tokens, accepted, logprobs, paths)``: as :meth:`_verify`, plus per row the
            accepted node indices in path order (root excluded).

        A proposer that lists ``hidden_layers`` (EAGLE) gets the target states of the
        accepted path only, after accept/reject: entry ``j`` is the state of the path's
        ``j``-th input (root, then the accepted nodes) at sequence position ``start + j``
        (trash beyond the path), exactly what a chain verify of that path hands over.

        Raises:
            ValueError: a tree with draft probabilities (only one-hot q is verified on
                trees).
        """
        if draft_probs is not None:
            raise ValueError("tree proposals must be deterministic (draft_probs None): the tree sampler "
                             "implements recursive rejection for one-hot q only")
        B, k, K = len(running), self.k, drafts.shape[1]
        ids, start, kv_len = self._verify_inputs(running, drafts, nd)
        tree = tree_attention_inputs(parents, nd, start, kv_len, self.cache.trash_pos)
        cache = self.cache.rows(B)
        with stage(f"specc.verify_tree[{K + 1}]"):
            logits, hidden = self._target_hidden(ids, tree.positions, cache, kv_len,
                                                 attn_mask=tree.mask, cache_positions=tree.cache_positions)
        with stage("specc.accept"):
            processed = self._process(logits, batch)
            result = tree_rejection_sample(processed, drafts, parents, nd, batch.is_greedy,
                                           uniforms[:, k : k + K], uniforms[:, 2 * k])
            tokens = result.output_token_ids.tolist()
            accepted = result.num_accepted.tolist()
            nodes = result.accepted_nodes  # [B, K+1]: root, then the path
            compact_accepted_kv((*cache.k, *cache.v), start, nodes, result.num_accepted, self.cache.trash_pos)
            # emitted token j was scored at node nodes[b, j]: logprobs read those rows
            on_path = path_logits(processed, nodes)
        if hidden is not None:
            on = nodes >= 0                                                  # [B, K+1]
            path_pos = torch.where(on, start[:, None] + torch.arange(K + 1), self.cache.trash_pos)
            path_hidden = hidden[torch.arange(B)[:, None], nodes.clamp(min=0)]  # [B, K+1, n, H]
            self.proposer.on_target_hidden_states(0, path_pos, path_hidden)
        return tokens, accepted, _EagerLogprobs(on_path, tokens), tree_paths(nodes, accepted)

    @staticmethod
    def _verify_inputs(running: list[Request], drafts: torch.Tensor, nd: torch.Tensor):
        """``(ids, start, kv_len)`` of a verify pass: ``ids`` ``[B, K+1]`` int64 =
        ``[last_token, d_1 .. d_K]`` per row, ``start`` ``[B]`` int64 the last token's
        position (``num_computed``), ``kv_len`` the keys any row needs."""
        last = torch.tensor([[r.last_token] for r in running], dtype=torch.long)
        start = torch.tensor([r.num_computed for r in running], dtype=torch.long)
        return torch.cat([last, drafts], dim=1), start, int((start + nd).max()) + 1

    @staticmethod
    def _process(logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """``[B, T, V]`` raw logits -> each row's processors applied (temperature, top-k, top-p)."""
        return processed_logits(logits, batch.temperature, batch.top_k, batch.top_p)

    def _emit(self, req: Request, tokens: list[int], logprobs, num_drafts: int | None) -> int:
        """Append a step's tokens (stop checks cut them), then logprobs and counters.

        ``logprobs(n, num_top)``: ``(token_logprob [n], top_ids [n, num_top],
        top_logprobs [n, num_top])`` of the first ``n`` tokens (called only when the
        request asks for logprobs).
        ``num_drafts``: draft tokens verified this step (None for the prefill token).
        Returns how many of ``tokens`` were kept: a stop inside the block drops the rest,
        and the request's K/V count advances by the kept tokens only.
        """
        kept = req.append_tokens(tokens, self.detokenize)
        m = req.metrics
        m.num_generation_tokens = len(req.output_token_ids)
        m.tokens_per_step.append(kept)
        if req.params.logprobs is not None:
            lp, top_ids, top_lp = logprobs(kept, req.params.logprobs)
            req.logprobs = req.logprobs or []
            for i in range(kept):
                top = list(zip(top_ids[i].tolist(), top_lp[i].tolist()))
                req.logprobs.append(TokenLogprob(tokens[i], float(lp[i]), top))
        if num_drafts is None:
            return kept
        m.num_steps += 1
        if num_drafts > 0:
            # a step's accepted count is what it emitted minus the one recovered/bonus
            # token, so tokens after a stop never count and 1 + accepted/drafts equals
            # the tokens emitted per verify step
            spec = m.spec
            spec.num_drafts += 1
            spec.num_draft_tokens += num_drafts
            spec.num_accepted_tokens += kept - 1
            if len(spec.accepted_per_position) < self.k:
                spec.accepted_per_position += [0] * (self.k - len(spec.accepted_per_position))
            for i in range(kept - 1):
                spec.accepted_per_position[i] += 1
        return kept

    @staticmethod
    def _batch(requests: list[Request]) -> StepBatch:
        ps = [r.params for r in requests]
        temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        greedy = torch.tensor([p.is_greedy for p in ps], dtype=torch.bool)
        return StepBatch(requests, temperature, top_k, top_p, greedy)


def tree_paths(accepted_nodes: torch.Tensor, num_accepted: list[int]) -> list[list[int]]:
    """Per row the accepted node indices in path order, root excluded, from
    ``accepted_nodes`` ``[B, K+1]`` (``[0, n_1, .., n_a, -1, ..]``)."""
    return [row[1 : a + 1] for row, a in zip(accepted_nodes.tolist(), num_accepted)]


class _EagerLogprobs:
    """Logprobs of a step's emitted tokens, computed on demand from the processed logits.

    ``processed``: ``[B, T, V]`` float32; ``tokens``: per row the emitted ids (``-1`` pads
    beyond the block are never asked for)."""

    def __init__(self, processed: torch.Tensor, tokens: list[list[int]]):
        self.processed, self.tokens = processed, tokens

    def __call__(self, b: int, n: int, num_top: int):
        tok = torch.tensor(self.tokens[b][:n], dtype=torch.long)
        return compute_logprobs(self.processed[b, :n], tok, num_top)
