"""KV compaction after a tree verify: keep the accepted path, contiguously.

After a tree verify (:mod:`specc.passes.tree_mask`) node ``m`` of row ``b`` has its K/V
at cache position ``start[b] + m``. The accepted path ``n_1 < n_2 < .. < n_a`` (root
excluded) must end up at ``start[b] + 1 .. start[b] + a``, where later steps read it; its
RoPE positions (``start + depth``) already are those, so the entries are moved unchanged.
Entries of rejected nodes stay beyond the sequence's new length and are rewritten before
any query can see them, as with rejected chain drafts. A chain, or a path along the
first children, moves nothing (its entries are rewritten with themselves).

Plain tensor code with static shapes and no host sync: the eager engine calls
:func:`compact_accepted_kv` after its tree accept/reject, and the compiled tree step
(:mod:`specc.passes.accept_reject`, ``fuse_tree_accept_reject``) runs the same function
inside its graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["compaction_indices", "compact_accepted_kv"]


def compaction_indices(start: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor,
                       trash_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(destination, source)`` cache positions ``[B, K]`` int64 of the moves.

    Args:
        start: ``[B]`` int64, the root's cache position.
        accepted_nodes: ``[B, K + 1]`` int64, ``[0, n_1, .., n_a, -1, ..]``
            (:class:`specc.kernels.tree_rejection_sampler.TreeRejectionOutput`).
        num_accepted: ``[B]`` int64, ``a``.
        trash_pos: the cache's trash position: slot ``j >= a`` moves trash to trash.

    Move ``j`` copies ``start + n_{j+1}`` to ``start + j + 1``. All sources are read
    before any destination is written (a gather, then a scatter), so the order of the
    moves does not matter.
    """
    k = accepted_nodes.shape[1] - 1
    j = torch.arange(k, device=start.device)[None]  # [1, K]
    keep = j < num_accepted[:, None]
    trash = torch.full_like(accepted_nodes[:, 1:], trash_pos)
    dst = torch.where(keep, start[:, None] + j + 1, trash)
    src = torch.where(keep, start[:, None] + accepted_nodes[:, 1:].clamp(min=0), trash)
    return dst, src


def compact_accepted_kv(kv: Sequence[torch.Tensor], start: torch.Tensor, accepted_nodes: torch.Tensor,
                        num_accepted: torch.Tensor, trash_pos: int) -> None:
    """Move the accepted path's K/V in every tensor of ``kv`` (in place).

    Args:
        kv: per-layer K and V tensors ``[B, kv_heads, max_model_len + 1, head_dim]``
            (row ``b`` = the row's cache slot), e.g. ``(*cache.k, *cache.v)``.
        start, accepted_nodes, num_accepted, trash_pos: as :func:`compaction_indices`.
    """
    dst, src = compaction_indices(start, accepted_nodes, num_accepted, trash_pos)
    for t in kv:
        b, h, _, d = t.shape
        where_from = src[:, None, :, None].expand(b, h, src.shape[1], d)
        where_to = dst[:, None, :, None].expand(b, h, dst.shape[1], d)
        t.scatter_(2, where_to, t.gather(2, where_from))
