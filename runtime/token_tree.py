"""Token trees for tree speculation: draft tokens given as parent indices.

A token tree of ``n`` draft tokens has ``n + 1`` nodes. Node 0 is the *root*: the
request's last token (the first input of the verify pass, already emitted). Nodes
``1..n`` are draft tokens; ``parents[i]`` is the parent node of node ``i + 1`` and must
be smaller than ``i + 1`` (so nodes are topologically ordered and a chain is
``parents = [0, 1, 2, ...]``). A node's token follows its parent's token.

Derived per node (SpecInfer, Miao et al. 2024, "SpecInfer: Accelerating Large Language
Model Serving with Tree-based Speculative Inference and Verification"; Medusa, EAGLE-2):

* ``depth``: tokens between the root and the node (root 0): the node's position offset
  after the root, so its RoPE position is ``root_position + depth``;
* ``ancestor mask`` ``[n+1, n+1]`` bool: ``mask[i, j]`` iff ``j`` is ``i`` or one of
  its ancestors: the attention of node ``i`` among the new nodes;
* ``paths``: the root-to-node node lists; ``leaves``: nodes without children.

Static trees come from config in vLLM's ``speculative_token_tree`` format
(:meth:`TokenTree.from_choices`): a list of tuples, each the path of *child ranks* from
the root to one node (``(0,)`` the root's best child, ``(1,)`` its second, ``(0, 0)`` the
best child of ``(0,)``, ...); vLLM sorts the list breadth-first (by length, then
lexicographically) and that order numbers the nodes; every proper prefix of a path must
be in the list (a node's parent), and ``num_speculative_tokens == len(tree)``.

The batched tensor forms (:func:`batch_depths`, :func:`batch_ancestor_mask`) serve the
verify pass and the tree sampler: ``parents`` ``[B, K]`` int64 padded per row.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["TokenTree", "TokenTreeError", "batch_ancestor_mask", "batch_depths", "chain_parents", "parse_choices"]


class TokenTreeError(ValueError):
    """An invalid token tree (bad parent index, malformed tree string, ...)."""


def chain_parents(n: int) -> list[int]:
    """Parents of a chain of ``n`` drafts: ``[0, 1, ..., n-1]``."""
    return list(range(n))


@dataclass(frozen=True)
class TokenTree:
    """The shape of one token tree (no token ids): ``parents[i]`` is the parent node of
    node ``i + 1``, in ``0..i`` (0 = the root).

    Raises:
        TokenTreeError: a parent index out of ``[0, i]`` or not an int.
    """

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(self.parents))
        for i, p in enumerate(self.parents):
            if isinstance(p, bool) or not isinstance(p, int):
                raise TokenTreeError(f"parents[{i}] = {p!r}: parent indices must be ints")
            if not 0 <= p <= i:
                raise TokenTreeError(
                    f"parents[{i}] = {p}: node {i + 1}'s parent must be in [0, {i}] "
                    "(0 = the root; parents come before their children)")

    @classmethod
    def chain(cls, n: int) -> "TokenTree":
        return cls(tuple(chain_parents(n)))

    @classmethod
    def from_choices(cls, choices: str | Sequence[Sequence[int]]) -> "TokenTree":
        """A static tree from vLLM's ``speculative_token_tree``: a list of child-rank paths
        (or its string form, e.g. ``"[(0,), (1,), (0, 0)]"``). Nodes are numbered in
        breadth-first order, as vLLM sorts them (see :func:`parse_choices`)."""
        paths = parse_choices(choices)
        index = {p: i + 1 for i, p in enumerate(paths)}
        return cls(tuple(index.get(p[:-1], 0) for p in paths))

    @property
    def num_drafts(self) -> int:
        """Draft nodes ``n`` (the root not counted)."""
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """``[n + 1]`` depth of each node (root 0)."""
        d = [0]
        for p in self.parents:
            d.append(d[p] + 1)
        return tuple(d)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``[n + 1]`` the children of each node, in index order."""
        kids: list[list[int]] = [[] for _ in range(self.num_drafts + 1)]
        for i, p in enumerate(self.parents):
            kids[p].append(i + 1)
        return tuple(tuple(k) for k in kids)

    @property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children (the root when there are no drafts)."""
        return tuple(i for i, k in enumerate(self.children) if not k)

    def path(self, node: int) -> tuple[int, ...]:
        """Root-to-``node`` node indices, root excluded (``()`` for the root)."""
        if not 0 <= node <= self.num_drafts:
            raise TokenTreeError(f"node {node} out of range [0, {self.num_drafts}]")
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node - 1]
        return tuple(reversed(out))

    def paths(self) -> tuple[tuple[int, ...], ...]:
        """:meth:`path` of every node, root first."""
        return tuple(self.path(i) for i in range(self.num_drafts + 1))

    def ancestor_mask(self) -> torch.Tensor:
        """``[n + 1, n + 1]`` bool: ``[i, j]`` iff node ``j`` is ``i`` or an ancestor of ``i``."""
        return batch_ancestor_mask(torch.tensor([self.parents], dtype=torch.long).view(1, -1))[0]


def parse_choices(choices: str | Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Validate vLLM's ``speculative_token_tree`` and sort it breadth-first.

    Args:
        choices: a list of paths (tuples or lists of child ranks >= 0), or its Python
            literal string (vLLM's form, ``"[(0,), (0, 0)]"``).

    Returns:
        the paths as tuples sorted by ``(len, path)`` (vLLM's node order).

    Raises:
        TokenTreeError: not a list of non-empty int tuples, a duplicate path, a path whose
            parent (its prefix) is missing, or child ranks that skip one (``(0, 1)``
            without ``(0, 0)``: ranks are the drafter's 1st, 2nd, ... choice).
    """
    if isinstance(choices, str):
        try:
            choices = ast.literal_eval(choices)
        except (ValueError, SyntaxError) as e:
            raise TokenTreeError(f"speculative_token_tree {choices!r} is not a Python list literal: {e}") from None
    if not isinstance(choices, (list, tuple)) or not choices:
        raise TokenTreeError(f"speculative_token_tree must be a non-empty list of paths, got {choices!r}")
    paths = []
    for c in choices:
        if not isinstance(c, (list, tuple)) or not c or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in c):
            raise TokenTreeError(f"speculative_token_tree entry {c!r}: must be a non-empty tuple of child ranks >= 0")
        paths.append(tuple(c))
    seen = set(paths)
    if len(seen) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise TokenTreeError(f"speculative_token_tree lists {dup} twice")
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise TokenTreeError(f"speculative_token_tree entry {p}: its parent {p[:-1]} is missing")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise TokenTreeError(f"speculative_token_tree entry {p}: its elder sibling "
                                 f"{p[:-1] + (p[-1] - 1,)} is missing (child ranks count from 0)")
    return sorted(paths, key=lambda t: (len(t), t))


# ------------------------------------------------------------------------- batched forms
def batch_depths(parents: torch.Tensor) -> torch.Tensor:
    """``parents`` ``[B, K]`` int64 (``parents[b, i]`` in ``0..i``) -> depths ``[B, K + 1]``
    int64 (root 0). Padding nodes need any valid parent (e.g. ``i``)."""
    bsz, k = parents.shape
    depth = torch.zeros(bsz, k + 1, dtype=torch.long, device=parents.device)
    for i in range(k):
        depth[:, i + 1] = depth.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    return depth


def batch_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``parents`` ``[B, K]`` int64 -> ``[B, K + 1, K + 1]`` bool ancestor-or-self mask
    (row ``i``: node ``i``'s path from the root, root included)."""
    bsz, k = parents.shape
    eye = torch.eye(k + 1, dtype=torch.bool, device=parents.device)
    mask = eye.expand(bsz, k + 1, k + 1).clone()
    for i in range(k):
        par_row = mask.gather(1, parents[:, i, None, None].expand(bsz, 1, k + 1)).squeeze(1)
        mask[:, i + 1] |= par_row
    return mask
