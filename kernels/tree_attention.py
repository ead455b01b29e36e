"""Tree attention: the torch reference (used on CPU and in tests).

A tree verify pass (SpecInfer, Miao et al. 2024, "SpecInfer: Accelerating Large Language
Model Serving with Tree-based Speculative Inference and Verification", §4.1 "tree-based
parallel decoding"; Medusa, Cai et al. 2024, "tree attention") feeds the ``N = K + 1``
nodes of a token tree (:mod:`specc.runtime.token_tree`; node 0 = the request's last
token) through the target in one forward. Each node must attend exactly to what it would
see in a sequence along its own root-to-node path: the whole cached prefix plus its
ancestors and itself, never its siblings or other branches. With the K/V of node ``m``
written at cache position ``prefix_len + m`` (:mod:`specc.passes.tree_mask`: every node
its own slot) that is, for query node ``i`` of row ``b``:

* prefix keys ``j < prefix_lens[b]``: all visible;
* tree keys ``j = prefix_lens[b] + m`` (``0 <= m < N``): visible iff
  ``tree_mask[b, i, m]`` (the ancestor-or-self mask for real nodes; the engine's padding
  nodes see only the root, :class:`specc.passes.tree_mask.TreeAttention`);
* nothing else (stale entries beyond the tree, tree keys at or past the cache length).

Output: ``softmax(q k^T * scale + mask) v`` over those keys, per query head, with
grouped-query attention (query head ``h`` reads KV head ``h // (H // KVH)``, as
``models/llama.py`` does through ``scaled_dot_product_attention(enable_gqa=True)``).

Shapes and dtypes (``B`` rows, ``H`` query heads, ``KVH`` KV heads, ``N`` tree nodes,
``S`` cache positions, ``D`` head size):

* ``q`` ``[B, H, N, D]`` float (float32, bfloat16 or float16), RoPE applied;
* ``k_cache``, ``v_cache`` ``[B, KVH, S, D]``, ``q``'s dtype: the prefix's K/V at
  ``[0, prefix_lens[b])`` and node ``m``'s at ``prefix_lens[b] + m`` (the layout of
  :class:`specc.models.kv_cache.KVCache`, or its first ``kv_len`` positions);
* ``prefix_lens`` ``[B]`` int64, ``0 <= prefix_lens[b] <= S``;
* ``tree_mask`` ``[B, N, N]`` bool, ``[b, i, m]``: node ``i`` sees node ``m``
  (:func:`specc.runtime.token_tree.batch_ancestor_mask` of the parents for a plain tree);
* out ``[B, H, N, D]`` in ``q``'s dtype.

Every query row must see at least one key (a node sees itself, the root sees itself):
a row that sees none gives NaN, as in ``scaled_dot_product_attention``.

The reference expands the compact mask to the dense ``[B, N, S]`` key mask
(:func:`expand_tree_mask`, also the dense mask the eager verify passes the model) and
runs the same ``scaled_dot_product_attention`` call as ``models/llama.py``'s
``Attention``: on the same inputs its output is the model's, bit for bit (tested). The
Triton kernel (:mod:`specc.kernels.tree_attention_triton`) reads the same compact inputs
and never builds the dense mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["check_tree_attention_inputs", "expand_tree_mask", "tree_attention"]


def expand_tree_mask(prefix_lens: torch.Tensor, tree_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The dense key mask of a tree verify: ``[B, N, kv_len]`` bool, True = visible.

    Key ``j`` is visible to node ``i`` of row ``b`` iff ``j < prefix_lens[b]``, or
    ``j = prefix_lens[b] + m`` with ``0 <= m < N`` and ``tree_mask[b, i, m]``.

    Args:
        prefix_lens: ``[B]`` int64, where each row's node 0 sits in the cache.
        tree_mask: ``[B, N, N]`` bool.
        kv_len: keys ``[0, kv_len)`` (tree keys at or past it are dropped).
    """
    bsz, n, _ = tree_mask.shape
    key = torch.arange(kv_len, device=tree_mask.device)[None, None]  # [1, 1, kv_len]
    rel = key - prefix_lens[:, None, None]  # the key's node index when 0 <= rel < N
    in_tree = (rel >= 0) & (rel < n)
    vis = tree_mask.gather(2, rel.clamp(0, n - 1).expand(bsz, n, kv_len))  # [B, N, kv_len]
    return (rel < 0) | (in_tree & vis)


def check_tree_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                prefix_lens: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """Static checks (shapes, dtypes, devices; no tensor values read) shared by the
    reference and the Triton kernel. Raises ValueError naming the argument."""
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, H, N, D] and k_cache [B, KVH, S, D], got {tuple(q.shape)} "
                         f"and {tuple(k_cache.shape)}")
    bsz, heads, n, d = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[0] != bsz or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not fit q {tuple(q.shape)}: "
                         "need [B, KVH, S, D] with q's B and D")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if tuple(prefix_lens.shape) != (bsz,) or prefix_lens.dtype != torch.int64:
        raise ValueError(f"prefix_lens must be int64 [B]=[{bsz}], got {prefix_lens.dtype} "
                         f"{tuple(prefix_lens.shape)}")
    if tuple(tree_mask.shape) != (bsz, n, n) or tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be bool [B, N, N]=[{bsz}, {n}, {n}], got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)}")
    if not q.is_floating_point() or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache, v_cache must share one float dtype, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("prefix_lens", prefix_lens),
                    ("tree_mask", tree_mask)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must be on one device")


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of the ``N`` tree nodes over the cached prefix plus their visible tree
    nodes (module docstring: semantics, shapes, dtypes).

    Args:
        q: ``[B, H, N, D]`` queries of the tree nodes.
        k_cache, v_cache: ``[B, KVH, S, D]``, prefix and tree K/V.
        prefix_lens: ``[B]`` int64, the cache position of each row's node 0.
        tree_mask: ``[B, N, N]`` bool, node ``i`` sees node ``m``.
        scale: softmax scale (default ``1 / sqrt(D)``).

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit
            (:func:`check_tree_attention_inputs`).
    """
    check_tree_attention_inputs(q, k_cache, v_cache, prefix_lens, tree_mask)
    mask = expand_tree_mask(prefix_lens, tree_mask, k_cache.shape[2])
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask[:, None], scale=scale,
                                          enable_gqa=q.shape[1] != k_cache.shape[1])
