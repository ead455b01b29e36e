"""Accept/reject over a token *tree*: the plain-torch reference.

The chain sampler (:mod:`specc.kernels.rejection_sampler`) verifies one draft per
position; here a row's drafts form a tree (:mod:`specc.runtime.token_tree`: node 0 is
the root, the request's last token; node ``i + 1``'s parent is ``parents[b, i] <= i``)
and one root-to-node *path* is accepted. Vocabulary as in the chain sampler: the path's
draft tokens are the **accepted tokens**, then one **recovered** token (some child of the
path's last node was rejected) or **bonus** token (none was tried).

* Greedy rows: node ``i`` *matches* when its token equals the target's argmax at its
  parent and its parent matches (the root matches). The accepted path ends at the deepest
  matching node (ties: the lowest index), and the final token is the argmax there. This is
  the longest root-to-node path the target's greedy decoding would produce.
* Sampling rows, for deterministic drafts (q one-hot at each node's token):
  multi-candidate recursive rejection sampling (SpecInfer, Miao et al. 2024, "SpecInfer:
  Accelerating Large Language Model Serving with Tree-based Speculative Inference and
  Verification", ASPLOS 2024, §4.2; EAGLE-2's recursive rejection, Li et al. 2024). At
  the current node (the root first) with residual ``r = p(. | node)``, the children are
  tried in index order: child ``c`` (token ``t``) is accepted with probability
  ``r(t) / sum(r)``, tested as ``u_c * sum(r) < r(t)`` (no division); accepting moves to
  ``c`` with ``r = p(. | c)``; rejecting zeroes ``r(t)``. When no child is accepted the
  final token is sampled from ``r`` (the residual after the rejections, or ``p`` itself
  at a node none of whose children exist). Each step emits a token distributed exactly
  as the target's (each rejection is one chain step with a one-hot q), so the output is
  lossless; a chain gives the chain sampler's test ``u < p(x)`` (``sum(r) = 1``).

Processing nodes in index order visits them exactly as that recursion does: a node is
*tried* iff its parent is the current node when its turn comes (a parent precedes its
children, and after a child is accepted its later siblings no longer hang from the
current node). So both rules are one loop over the ``K`` node slots, vectorised over
the batch. Each node uses its own uniform (at most one test per node), so a row needs
``K`` accept uniforms plus one for the final token, drawn by the caller (per-request
generators: seeded requests are reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specc.kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID
from specc.runtime.sampling import sample_from_probs
from specc.runtime.token_tree import batch_ancestor_mask

__all__ = ["TreeRejectionOutput", "tree_rejection_sample"]


@dataclass
class TreeRejectionOutput:
    """Result of one tree accept/reject step for ``B`` rows of ``K`` draft nodes.

    Attributes:
        output_token_ids: ``[B, K+1]`` int64: the accepted path's draft tokens, then the
            recovered or bonus token, then ``-1`` padding.
        num_accepted: ``[B]`` int64, the accepted path's length (drafts).
        accepted_nodes: ``[B, K+1]`` int64: node indices of the emitted tokens' *inputs*
            along the path: ``[0, n_1, .., n_a]`` (root, then the accepted nodes), then
            ``-1``. Entry ``j`` is the node whose target distribution scored emitted
            token ``j``; entries ``1..a`` are the nodes whose K/V must be kept.
        num_emitted: ``[B]`` int64, ``num_accepted + 1``.
    """

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    num_emitted: torch.Tensor


def tree_rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms_accept: torch.Tensor,
    uniforms_sample: torch.Tensor,
) -> TreeRejectionOutput:
    """Accept one path of each row's draft tree and pick the recovered or bonus token.

    Args:
        target_logits: ``[B, K+1, V]`` float32 processed target logits (raw for greedy
            rows) at nodes ``0..K``: row ``i`` is the target's distribution after node
            ``i``'s token (given its path).
        draft_token_ids: ``[B, K]`` int64, the token of node ``i + 1`` at ``[:, i]``.
        parents: ``[B, K]`` int64, the parent node of node ``i + 1`` at ``[:, i]``, in
            ``0..i``; entries past ``num_draft_tokens[b]`` are padding (any value in range).
        num_draft_tokens: ``[B]`` int64 in ``0..K``: nodes ``1..num_draft_tokens[b]`` exist.
        is_greedy: ``[B]`` bool.
        uniforms_accept: ``[B, K]`` float32 in ``[0, 1)``, the accept test of node ``i + 1``.
        uniforms_sample: ``[B]`` float32 in ``[0, 1)`` for the recovered/bonus token.

    Returns:
        :class:`TreeRejectionOutput`.

    Raises:
        ValueError: shapes that do not agree, or a parent index out of ``[0, i]``.

    Only deterministic drafts (one-hot q) are handled: a drafter with a distribution q
    per node needs the general multi-draft rule (SpecInfer's MSS with q), not built.
    """
    bsz, k1, vocab = target_logits.shape
    k = k1 - 1
    if draft_token_ids.shape != (bsz, k) or parents.shape != (bsz, k) or uniforms_accept.shape != (bsz, k):
        raise ValueError(f"draft_token_ids {tuple(draft_token_ids.shape)}, parents {tuple(parents.shape)}, "
                         f"uniforms_accept {tuple(uniforms_accept.shape)} must all be [B, K] = [{bsz}, {k}]")
    device = target_logits.device
    node = torch.arange(k, device=device)
    # a value check (a host sync): skipped while tracing a program, whose inputs the
    # runtime builds from validated trees and whose padding rows get parents 0
    if k and not torch.compiler.is_compiling() and (bool((parents < 0).any()) or
                                                     bool((parents > node[None]).any())):
        raise ValueError("parents[b, i] must lie in [0, i] (node i + 1's parent precedes it)")
    valid = node[None] < num_draft_tokens.clamp(0, k)[:, None]  # [B, K]
    tokens = torch.where(valid, draft_token_ids, 0).clamp(0, vocab - 1)
    logits = target_logits.to(torch.float32)
    argmax = logits.argmax(-1)  # [B, K+1]
    probs = torch.softmax(logits, -1)  # [B, K+1, V]
    rows = torch.arange(bsz, device=device)

    # ---- greedy: deepest node whose whole path matches the target's argmax ----------
    matched = torch.ones(bsz, k1, dtype=torch.bool, device=device)
    depth = torch.zeros(bsz, k1, dtype=torch.long, device=device)
    for i in range(k):
        par = parents[:, i]
        matched[:, i + 1] = valid[:, i] & matched[rows, par] & (tokens[:, i] == argmax[rows, par])
        depth[:, i + 1] = depth[rows, par] + 1
    score = torch.where(matched, depth * (k1 + 1) - torch.arange(k1, device=device)[None], -1)
    greedy_end = score.argmax(1)  # deepest matching node, lowest index on ties

    # ---- sampling: recursive rejection over the tree, nodes in index order -----------
    cur = torch.zeros(bsz, dtype=torch.long, device=device)
    residual = probs[:, 0].clone()  # [B, V]
    for i in range(k):
        tried = valid[:, i] & (parents[:, i] == cur)
        t = tokens[:, i : i + 1]
        p_t = residual.gather(1, t).squeeze(1)
        accept = tried & (uniforms_accept[:, i].to(torch.float32) * residual.sum(-1) < p_t)
        reject = tried & ~accept
        residual = torch.where(reject[:, None], residual.scatter(1, t, 0.0), residual)
        residual = torch.where(accept[:, None], probs[:, i + 1], residual)
        cur = torch.where(accept, i + 1, cur)
    p_cur = probs[rows, cur]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_cur)  # rounding guard
    sampled = sample_from_probs(residual, uniforms_sample)

    end = torch.where(is_greedy, greedy_end, cur)  # [B] the path's last node
    final = torch.where(is_greedy, argmax[rows, end], sampled)

    # ---- the path: ancestors of `end` in index order ----------------------------------
    safe_parents = torch.where(valid, parents, node[None])  # padding: any in-range parent
    on_path = batch_ancestor_mask(safe_parents)[rows, end]  # [B, K+1], root included
    num_accepted = on_path.sum(1) - 1
    order = torch.where(on_path, torch.arange(k1, device=device)[None], k1 + 1).sort(1).values
    slot = torch.arange(k1, device=device)[None]
    accepted_nodes = torch.where(slot <= num_accepted[:, None], order, -1)  # [0, n_1 .. n_a, -1 ..]
    path_tokens = torch.cat([torch.zeros(bsz, 1, dtype=torch.long, device=device), tokens], 1)  # by node
    drafted = path_tokens.gather(1, _shift_left(accepted_nodes).clamp(min=0))  # token of n_{j+1} at j
    out = torch.where(slot < num_accepted[:, None], drafted, PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return TreeRejectionOutput(out, num_accepted, accepted_nodes, num_accepted + 1)


def _shift_left(nodes: torch.Tensor) -> torch.Tensor:
    """``[B, K+1]`` -> the same rows shifted one to the left (last column ``-1``)."""
    return torch.cat([nodes[:, 1:], torch.full_like(nodes[:, :1], -1)], 1)
