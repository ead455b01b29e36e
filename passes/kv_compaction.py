"""KV compaction after a tree verify: keep the accepted path, contiguously.

After a tree verify (:mod:`specc.passes.tree_mask`) node ``m`` of row ``b`` has its K/V
at cache position ``start[b] + m``. The accepted path ``n_1 < n_2 < .. < n_a`` (root
excluded) must end up at ``start[b] + 1 .. start[b] + a``, where later steps read it; its
RoPE positions (``start + depth``) already are those, so the entries are moved unchanged.
Entries of rejected nodes stay beyond the sequence's new length and are rewritten before
any query can see them, as with rejected chain drafts. A chain, or a path along the
first children, moves nothing.
"""

from __future__ import annotations

import torch

from specc.models.kv_cache import KVCache

__all__ = ["compaction_moves", "compact_accepted_kv"]


def compaction_moves(start: list[int], accepted_nodes: list[list[int]]) -> list[tuple[int, int, int]]:
    """``(row, destination, source)`` cache positions, in path order, for the entries not
    already in place. In path order a source ``start + n_j`` (``n_j >= j``) is never a
    destination of an earlier move (those lie below ``start + j``), so applying the moves
    one after another is correct."""
    return [(b, s + j + 1, s + n) for b, (s, nodes) in enumerate(zip(start, accepted_nodes))
            for j, n in enumerate(nodes) if n != j + 1]


@torch.no_grad()
def compact_accepted_kv(cache: KVCache, start: list[int], accepted_nodes: list[list[int]]) -> int:
    """Apply :func:`compaction_moves` to every layer's K and V of ``cache`` (row ``b`` =
    slot ``b``). ``accepted_nodes[b]``: the accepted node indices in path order, root
    excluded. Returns the number of positions moved per layer and tensor."""
    moves = compaction_moves(start, accepted_nodes)
    for b, dst, src in moves:
        for t in (*cache.k, *cache.v):
            t[b, :, dst] = t[b, :, src]
    return len(moves)
