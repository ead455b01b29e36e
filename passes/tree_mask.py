"""Tree attention inputs for a verify pass over a token tree.

A verify pass over a token tree (:mod:`specc.runtime.token_tree`; SpecInfer, Miao et al.
2024; Medusa; EAGLE-2) feeds all ``K + 1`` nodes of each row at once: node 0 is the
request's last token, at cache position ``start = num_computed``. Every node needs

* a **RoPE position** ``start + depth(node)``: the position its token would have in a
  sequence along its own path;
* a **cache position** ``start + node``: where its K/V is written, one distinct slot per
  node (two siblings share a RoPE position but not a slot); after accept/reject the
  accepted path's entries are moved to ``start + 1, start + 2, ...``
  (:func:`specc.passes.kv_compaction.compact_accepted_kv`), where their RoPE positions already place them;
* an **attention mask** row over keys ``[0, kv_len)``: the whole cache prefix
  (``j < start``) plus the slots of its ancestors and itself (``j = start + m`` with
  ``m`` an ancestor-or-self of the node), nothing else: not its siblings, not other
  branches, not stale entries beyond.

Padding nodes (``node > num_drafts[b]``) are written at the cache's trash position and
see the prefix and the root only (every query row must see a key).

For a chain the mask equals the causal mask and the positions equal ``start + node``:
the tree inputs of a chain are exactly the chain verify's.

Static trees (from config, the same shape every step) are a constant ancestor mask and a
constant depth vector (:func:`static_tree_tensors`) that a compiled program embeds; a
dynamic tree (a drafter's per-step tree, e.g. suffix decoding's) passes ``parents`` as an
input and the mask is built in the graph by :func:`tree_attention_inputs` (plain tensor
code, ``K`` gathers). Both meet in one assembly step, so they cannot drift apart. The
eager engine calls :func:`tree_attention_inputs` directly.

The mask comes in two forms: the compact ``[B, N, N]`` node-to-node ``tree_mask`` (the
input of the tree attention kernel, :mod:`specc.kernels.tree_attention`, which reads the
prefix length and never builds the dense mask) and the dense ``[B, N, kv_len]`` key
``mask`` the model's attention takes, expanded from it by the kernel module's own
:func:`~specc.kernels.tree_attention.expand_tree_mask` (so the two cannot disagree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specc.kernels.tree_attention import expand_tree_mask
from specc.runtime.token_tree import TokenTree, batch_ancestor_mask, batch_depths

__all__ = ["TreeAttention", "static_tree_tensors", "tree_attention_from_static", "tree_attention_inputs"]


@dataclass
class TreeAttention:
    """The inputs of one tree verify forward (``B`` rows, ``N = K + 1`` nodes).

    Attributes:
        positions: ``[B, N]`` int64 RoPE positions (trash for padding nodes).
        cache_positions: ``[B, N]`` int64 K/V write positions (trash for padding nodes).
        mask: ``[B, N, kv_len]`` bool, True = key visible (what the model's dense
            attention takes).
        tree_mask: ``[B, N, N]`` bool, node ``i`` sees node ``m`` (the compact form:
            ``mask`` is the prefix ``[0, start)`` plus this at ``start + m``,
            :func:`specc.kernels.tree_attention.expand_tree_mask`; the tree attention
            kernel's input, :mod:`specc.kernels.tree_attention`).
    """

    positions: torch.Tensor
    cache_positions: torch.Tensor
    mask: torch.Tensor
    tree_mask: torch.Tensor


def static_tree_tensors(tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Constants of a static tree: depths ``[N]`` int64 and the ancestor mask ``[N, N]`` bool."""
    return torch.tensor(tree.depths, dtype=torch.long), tree.ancestor_mask()


def tree_attention_inputs(parents: torch.Tensor, num_drafts: torch.Tensor, start: torch.Tensor,
                          kv_len: int, trash_pos: int) -> TreeAttention:
    """Attention inputs of a dynamic tree per row.

    Args:
        parents: ``[B, K]`` int64, node ``i + 1``'s parent at ``[:, i]`` (``0..i``);
            entries past ``num_drafts[b]`` are padding (any value; replaced here).
        num_drafts: ``[B]`` int64 in ``0..K``.
        start: ``[B]`` int64, the root's cache position (the request's ``num_computed``).
        kv_len: keys attended (``> max(start + num_drafts)``).
        trash_pos: the cache's trash position (padding nodes write there).
    """
    k = parents.shape[1]
    node = torch.arange(k, device=parents.device)[None]
    safe = torch.where(node < num_drafts[:, None], parents, node)  # padding: chain-like, in range
    return _assemble(batch_depths(safe), batch_ancestor_mask(safe), num_drafts, start, kv_len, trash_pos)


def tree_attention_from_static(depths: torch.Tensor, ancestors: torch.Tensor, num_drafts: torch.Tensor,
                               start: torch.Tensor, kv_len: int, trash_pos: int) -> TreeAttention:
    """:func:`tree_attention_inputs` for one static tree shared by all rows, from its
    constants (:func:`static_tree_tensors`); a row with fewer drafts keeps the first
    ``num_drafts[b]`` nodes (a static tree's nodes are in breadth-first order, so any
    prefix of them is a tree)."""
    bsz = start.shape[0]
    n = depths.shape[0]
    return _assemble(depths.expand(bsz, n), ancestors.expand(bsz, n, n), num_drafts, start, kv_len, trash_pos)


def _assemble(depths: torch.Tensor, ancestors: torch.Tensor, num_drafts: torch.Tensor, start: torch.Tensor,
              kv_len: int, trash_pos: int) -> TreeAttention:
    """depths ``[B, N]``, ancestors ``[B, N, N]`` -> :class:`TreeAttention` (module docstring)."""
    n = depths.shape[1]
    device = depths.device
    node = torch.arange(n, device=device)[None]  # [1, N]
    valid = node <= num_drafts[:, None]  # [B, N]
    trash = torch.full_like(depths, trash_pos)
    positions = torch.where(valid, start[:, None] + depths, trash)
    cache_positions = torch.where(valid, start[:, None] + node, trash)
    # real rows: their ancestors among the real nodes; padding rows: the root only
    tree_mask = ancestors & valid[:, None, :] & valid[:, :, None]
    tree_mask = tree_mask | (~valid[:, :, None] & (node == 0)[:, None, :])
    return TreeAttention(positions, cache_positions, expand_tree_mask(start, tree_mask, kv_len), tree_mask)
