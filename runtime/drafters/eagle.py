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

**Static token trees** (``speculative_config.speculative_token_tree``, vLLM's format,
:meth:`~specc.runtime.token_tree.TokenTree.from_choices`; EAGLE's tree drafting, Li et
al. 2024, §4.2): after the catch-up, the head runs once per tree depth over all nodes of
that depth. Node ``i`` (depth ``d``, parent ``p``) is the pair (head output of ``p``,
token of ``i``) at RoPE position ``n - 1 + d`` and *cache* position ``n - 1 + i`` (one
slot per node, as the target's tree verify): it attends to the committed head prefix
``[0, n)`` and to its ancestors' and its own entries, nothing else (a tree mask), so stale
entries at or beyond ``n`` are never read; the next catch-up overwrites them with true
pairs. The children of a node are its ``r`` best tokens under the head's *processed*
distribution (greedy rows: the raw logits, rank 0 the argmax, as the chain's draft): a
deterministic candidate set, so the proposal carries no ``draft_probs`` and the tree
sampler's recursive rejection with one-hot q keeps sampled rows lossless (each candidate
is a fixed token, SpecInfer §4.2); the drafter's uniforms go unused. After the verify the
engine hands over the target states of the accepted path only, at the sequence positions
the path takes (:meth:`specc.runtime.engine.Engine._verify_tree`), so the next catch-up
runs over exactly the pairs a chain would have. **Dynamic trees**
(``eagle_dynamic_tree``, EAGLE-2): :meth:`EagleProposer._propose_dynamic`, the same head
tree forward over a per-row tree chosen by cumulative head probability.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specc.models.eagle import EagleHeadBase
from specc.models.kv_cache import KVCache
from specc.runtime.drafters.base import Proposal, Proposer, StepBatch
from specc.runtime.request import Request
from specc.runtime.sampling import process_logits, sample_draft
from specc.runtime.token_tree import TokenTree

if TYPE_CHECKING:
    from specc.config import DynamicTreeConfig

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
    """Chain, static-tree or EAGLE-2 dynamic-tree drafting with an EAGLE or EAGLE-3 head.

    Args:
        head: the loaded head (:func:`specc.models.eagle_checkpoint.load_eagle_head`).
        num_speculative_tokens: k (with ``tree``: its node count).
        num_slots, max_model_len: as the target's KV cache (the head's cache and feature
            buffer have the same slots and length).
        tree: a static token tree to draft each step (None: a chain of k).
        dynamic_tree: ``speculative_config.eagle_dynamic_tree``
            (:class:`specc.config.DynamicTreeConfig`: ``depth``, ``topk``): EAGLE-2's
            dynamic tree of k nodes instead (:meth:`_propose_dynamic`).

    Raises:
        ValueError: ``tree`` with other than ``num_speculative_tokens`` nodes; both trees;
            a dynamic tree with fewer candidates than k.
    """

    def __init__(self, head: EagleHeadBase, num_speculative_tokens: int, num_slots: int, max_model_len: int,
                 tree: TokenTree | None = None, dynamic_tree: DynamicTreeConfig | None = None):
        super().__init__(num_speculative_tokens)
        if tree is not None and tree.num_drafts != num_speculative_tokens:
            raise ValueError(f"a token tree of {tree.num_drafts} nodes for num_speculative_tokens = "
                             f"{num_speculative_tokens}: they must be equal")
        if tree is not None and dynamic_tree is not None:
            raise ValueError("a static tree and a dynamic tree: give one")
        if dynamic_tree is not None and dynamic_tree.num_candidates < num_speculative_tokens:
            raise ValueError(f"dynamic tree depth {dynamic_tree.depth}, topk {dynamic_tree.topk}: its "
                             f"{dynamic_tree.num_candidates} candidates cannot hold {num_speculative_tokens} nodes")
        self.tree = tree
        self.dynamic_tree = dynamic_tree
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
        if self.tree is not None:
            return self._propose_tree(batch, max_drafts)
        if self.dynamic_tree is not None:
            return self._propose_dynamic(batch, max_drafts)
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

    def _catch_up(self, batch: StepBatch) -> torch.Tensor:
        """The catch-up forward of a tree step: the head's output at each row's last
        verified position ``n - 1`` ``[B, H]`` (it scores the root's children)."""
        dev, trash = self.features.device, self.cache.trash_pos
        rows = torch.arange(batch.size, device=dev)
        ids, pos, last = (x.to(dev) for x in self.state.catch_up_pairs(batch.requests))
        kv_len = int(torch.where(pos == trash, 0, pos).max()) + 1
        out = self.head(ids, self.features[rows[:, None], pos], pos, self.cache.rows(batch.size), kv_len=kv_len)
        return out[rows, last]

    def _tree_forward(self, n: torch.Tensor, depth: int, ids: torch.Tensor, feats: torch.Tensor,
                      slot: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One head forward over ``m`` tree nodes per row, all at ``depth``.

        Args:
            n: ``[B]`` int64, each row's verified tokens (the committed head prefix is
                ``[0, n)``; the root pair sits at ``n - 1``).
            ids, feats: ``[B, m]`` the nodes' tokens, ``[B, m, H]`` their parents' outputs.
            slot: ``[B, m]`` int64 >= 1, each node's head-cache slot relative to ``n - 1``.
            visible: ``[B, m, S + 1]`` bool: node ``i`` sees relative slot ``s`` (its
                ancestors' and its own; ``s = 0`` is the root, always visible).

        Returns:
            ``[B, m, H]`` the nodes' head outputs. Slots at or past the cache's limit go to
            the trash position (such nodes lie beyond every row's draft cap).
        """
        b, m = ids.shape
        trash, limit = self.cache.trash_pos, self.cache.max_model_len
        rope = (n[:, None] - 1 + depth).expand(b, m)
        where = n[:, None] - 1 + slot
        rope = torch.where(rope < limit, rope, torch.full_like(rope, trash))
        where = torch.where(where < limit, where, torch.full_like(where, trash))
        s_max = visible.shape[-1] - 1
        kv_len = min(int(n.max()) + int(slot.max()), self.cache.max_len)
        key = torch.arange(kv_len, device=ids.device)
        rel = key[None] - (n[:, None] - 1)                                   # [B, kv_len]: slot at the key
        own = visible.gather(2, rel.clamp(0, s_max)[:, None, :].expand(b, m, kv_len))
        mask = (key[None, None] < n[:, None, None]) | (own & ((rel >= 1) & (rel <= s_max))[:, None, :])
        return self.head(ids, feats, rope, self.cache.rows(b), kv_len=kv_len, attn_mask=mask,
                         cache_positions=where)

    def _propose_tree(self, batch: StepBatch, max_drafts: list[int]) -> Proposal:
        """One static tree per row (module docstring): ``draft_token_ids`` ``[B, N]``,
        ``parents`` ``[B, N]`` (the tree's, every row), ``draft_probs`` None."""
        tree = self.tree
        assert tree is not None
        B, N, dev = batch.size, tree.num_drafts, self.features.device
        h_root = self._catch_up(batch)
        outs = h_root.new_zeros(B, N + 1, h_root.shape[-1])                 # head output per node
        outs[:, 0] = h_root
        tokens = torch.zeros(B, N + 1, dtype=torch.long, device=dev)
        n = torch.tensor([r.num_computed for r in batch.requests], device=dev)  # [B]
        depths, parents = tree.depths, (0,) + tree.parents                 # per node (root: itself)
        rank = [0] * (N + 1)
        for kids in tree.children:
            for r, c in enumerate(kids):
                rank[c] = r
        ancestors = tree.ancestor_mask().to(dev)                           # [N+1, N+1]
        for d in range(1, max(depths) + 1):
            level = [i for i in range(1, N + 1) if depths[i] == d]
            # children of depth d-1: each parent's best len(children) tokens
            heads_of = sorted({parents[i] for i in level})
            top = self._top_tokens(outs[:, heads_of], batch, max(len(tree.children[p]) for p in heads_of))
            col = {p: j for j, p in enumerate(heads_of)}
            for i in level:
                tokens[:, i] = top[:, col[parents[i]], rank[i]]
            if not any(tree.children[i] for i in level):
                break  # the deepest level: its outputs would feed no child
            node = torch.tensor(level, device=dev)
            outs[:, level] = self._tree_forward(n, d, tokens[:, level], outs[:, [parents[i] for i in level]],
                                                node[None].expand(B, -1), ancestors[node][None].expand(B, -1, -1))
        num = torch.tensor(max_drafts, dtype=torch.long).clamp(max=N)
        return Proposal(tokens[:, 1:].cpu(), num, None, torch.tensor([tree.parents], dtype=torch.long).repeat(B, 1))

    def _propose_dynamic(self, batch: StepBatch, max_drafts: list[int]) -> Proposal:
        """EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of
        Language Models with Dynamic Draft Trees", §4), per row.

        Expansion: the root's ``topk`` best tokens (by the head's log-probability) are the
        depth-1 candidates and the first frontier. At each further depth the head runs
        once over the frontier (:meth:`_tree_forward`), each frontier node proposes its
        ``topk`` best children, valued by the *cumulative* log-probability along the path
        (the head's estimate of the path's acceptance), and the ``topk`` best of those
        ``topk**2`` children become the next frontier; ``depth`` depths in all. Rerank:
        the ``k`` best of all candidates by value form the tree (ties: the shallower,
        earlier one first, so a parent, whose value is never lower, precedes its child
        and the kept set is a tree), in candidate order (parents first). Values use the
        head's processed distribution for sampled rows and its raw softmax for greedy
        rows; candidates are fixed tokens, so ``draft_probs`` is None (lossless under
        the tree sampler's one-hot recursive rejection).

        Returns:
            a tree :class:`Proposal`: ``[B, k]`` tokens and per-row ``parents``.
        """
        assert self.dynamic_tree is not None
        depth, e = self.dynamic_tree.depth, self.dynamic_tree.topk
        B, k, dev = batch.size, self.num_speculative_tokens, self.features.device
        n = torch.tensor([r.num_computed for r in batch.requests], device=dev)
        h = self._catch_up(batch)[:, None]                                   # [B, 1, H] the root
        f_score, f_tok = self._log_probs(h, batch).topk(e, dim=-1)          # [B, 1, e]
        f_score, f_tok = f_score[:, 0], f_tok[:, 0]                          # frontier: [B, e]
        f_id = torch.arange(e, device=dev).expand(B, e)                      # candidate ids
        f_feat = h.expand(B, e, h.shape[-1])                                 # parents' outputs
        tok, score, parent = [f_tok], [f_score], [torch.full((B, e), -1, dtype=torch.long, device=dev)]
        s_max = (depth - 1) * e
        visible = torch.zeros(B, e, s_max + 1, dtype=torch.bool, device=dev)
        count = e
        for d in range(1, depth):
            slot = (1 + (d - 1) * e + torch.arange(e, device=dev)).expand(B, e)
            visible = visible.scatter(2, slot[:, :, None], True)             # a node sees itself
            out = self._tree_forward(n, d, f_tok, f_feat, slot, visible)    # [B, e, H]
            c_score, c_tok = (f_score[:, :, None] + self._log_probs(out, batch)).topk(e, dim=-1)  # [B, e, e]
            tok.append(c_tok.reshape(B, e * e))
            score.append(c_score.reshape(B, e * e))
            parent.append(f_id.repeat_interleave(e, dim=1))
            f_score, pick = score[-1].topk(e, dim=-1)                        # the next frontier
            f_tok = tok[-1].gather(1, pick)
            f_id = count + pick
            src = pick // e                                                  # its parent, in the frontier
            f_feat = out.gather(1, src[:, :, None].expand(B, e, out.shape[-1]))
            visible = visible.gather(1, src[:, :, None].expand(B, e, s_max + 1))
            count += e * e
        tok, score, parent = (torch.cat(x, dim=1).cpu() for x in (tok, score, parent))
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values
        ids = tok.gather(1, order)
        parents = torch.zeros(B, k, dtype=torch.long)
        for b in range(B):
            node = {c: i + 1 for i, c in enumerate(order[b].tolist())}       # candidate -> node number
            parents[b] = torch.tensor([node.get(p, 0) for p in parent[b, order[b]].tolist()])
        num = torch.tensor(max_drafts, dtype=torch.long).clamp(max=k)
        return Proposal(ids, num, None, parents)

    def _log_probs(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """``h`` ``[B, P, H]`` -> ``[B, P, V]`` float32 log-probabilities of the head: its
        processed distribution for sampled rows, its raw softmax for greedy rows."""
        return torch.log_softmax(self._scores(h, batch), dim=-1)

    def _scores(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """``[B, P, H]`` -> ``[B, P, V]``: raw logits for greedy rows, processed logits
        (temperature / top-k / top-p) for sampled rows."""
        b, p, _ = h.shape
        flat = self.head.compute_logits(h).reshape(b * p, -1)
        dev = flat.device
        rep = (lambda x: x.to(dev).repeat_interleave(p))
        processed = process_logits(flat, rep(batch.temperature), rep(batch.top_k), rep(batch.top_p))
        return torch.where(rep(batch.is_greedy)[:, None], flat, processed).view(b, p, -1)

    def _top_tokens(self, h: torch.Tensor, batch: StepBatch, r: int) -> torch.Tensor:
        """``h`` ``[B, P, H]`` head outputs -> ``[B, P, r]`` int64: each one's ``r`` best
        tokens, distinct: by the raw logits for greedy rows (rank 0 the argmax, the chain
        draft), by the processed logits (the request's temperature / top-k / top-p) for
        sampled rows. Tokens the processors remove can fill the last ranks when fewer
        than ``r`` remain; the verifier rejects them (target probability 0)."""
        b, p, _ = h.shape
        scores = self._scores(h, batch).reshape(b * p, -1)
        scores = scores.scatter(1, scores.argmax(-1, keepdim=True), float("inf"))  # rank 0 = the argmax
        return scores.topk(r, dim=-1).indices.view(b, p, r)
