"""The interface every proposer (drafter) implements, and the batch view it receives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specc.runtime.request import Request


@dataclass
class StepBatch:
    """The live requests of one step, in slot order (request i sits in KV slot i).

    Per-row sampling settings are tensors so drafters apply the same processors as the
    target (the contract that keeps rejection sampling lossless).
    """

    requests: list[Request]
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, <= 0 = off
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    is_greedy: torch.Tensor  # [B] bool

    @property
    def size(self) -> int:
        return len(self.requests)


@dataclass
class Proposal:
    """Draft tokens for one step: a chain per row, or a token tree per row.

    ``draft_token_ids[b, i]`` for ``i >= num_draft_tokens[b]`` is padding. ``draft_probs``
    is the drafter's processed distribution q at each draft position, or None for a
    deterministic drafter (q is one-hot at the draft token: n-gram, suffix).

    ``parents`` None: each row's drafts are a chain. Else each row's drafts are the nodes
    ``1..num_draft_tokens[b]`` of a token tree (:mod:`specc.runtime.token_tree`; node 0 is
    the request's last token): ``parents[b, i]`` is the parent node of draft ``i`` (node
    ``i + 1``), in ``0..i``; padding entries may hold any value in that range. Trees are
    verified by ``Engine._verify_tree`` (compiled: ``tree_step``) and need
    ``draft_probs`` None. The engine may keep only the first ``n`` nodes of a row (its
    cap), which is still a tree.
    """

    draft_token_ids: torch.Tensor  # [B, K] int64
    num_draft_tokens: torch.Tensor  # [B] int64, 0..K
    draft_probs: torch.Tensor | None = None  # [B, K, V] float32
    parents: torch.Tensor | None = None  # [B, K] int64, parent node of draft i, 0..i

    @property
    def width(self) -> int:
        return self.draft_token_ids.shape[1]


class Proposer(ABC):
    """A drafting method. The engine calls, per request and step, in this order:
    ``prefill`` once at admission, then each step ``propose`` → target verify →
    ``on_verified``; ``move_slot`` when a request changes KV slot; ``finish`` once when
    the request is done.

    A proposer that drafts from the target's hidden states (EAGLE) lists them in
    ``hidden_layers`` (HF numbering: 0 = embeddings, i = output of decoder layer i-1,
    before the final norm); the eager engine then hands them over after every target
    forward (prompt chunks and verify passes) through ``on_target_hidden_states``, before
    ``prefill`` / ``on_verified``. Empty (the default): the engine asks for none.
    """

    hidden_layers: tuple[int, ...] = ()
    #: True for the stand-in of a drafter that runs inside the compiled ``spec_step``
    #: (:class:`~specc.runtime.drafters.in_graph.InGraphDrafter`): its proposals carry
    #: only the per-row draft counts.
    drafts_in_graph: bool = False

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens

    def on_target_hidden_states(self, slot0: int, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target's hidden states of one forward over slots ``slot0 .. slot0 + B - 1``.

        Args:
            positions: ``[B, T]`` int64, the position of each input token (padding at the
                cache's trash position; positions of drafts that end up rejected are
                included: they lie at or beyond the request's ``num_computed`` afterwards;
                after a *tree* verify only the accepted path's states come, at the
                sequence positions the path takes).
            hidden: ``[B, T, len(hidden_layers), hidden_size]`` in the model dtype, in the
                order of ``hidden_layers``.
        """

    def prefill(self, request: Request, slot: int) -> None:
        """Prepare per-request state after the target's prefill (default: nothing)."""

    @abstractmethod
    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms: torch.Tensor) -> Proposal:
        """Propose up to ``max_drafts[b]`` tokens after each request's last token.

        Args:
            batch: the live requests in slot order.
            max_drafts: per row, the most draft tokens worth verifying (0..k).
            uniforms: ``[B, k]`` float32 in [0, 1) from each request's generator, for a
                drafter that samples; a deterministic drafter ignores them.
        """

    def on_verified(self, batch: StepBatch, num_accepted: list[int], accepted_paths: list[list[int]] | None = None) -> None:
        """Called after accept/reject with each row's accepted draft count.

        After a tree proposal the engine also passes ``accepted_paths``: per row the
        accepted draft indices + 1 (tree node numbers), in path order, so draft ``j`` of
        the row's proposal was accepted iff ``j + 1`` is listed. A proposer that proposes
        trees must accept this keyword; chain proposals never get it.
        """

    def move_slot(self, src: int, dst: int) -> None:
        """The request in slot ``src`` moved to slot ``dst`` (its old slot is free)."""

    def finish(self, request: Request) -> None:
        """``request`` finished and its slot is being freed (before any ``move_slot`` into
        it); also for a request that finished at its prefill token, so before any
        ``prefill`` call. Drop per-request state here (default: nothing)."""


def pad_drafts(drafts: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ragged per-row draft lists into ``([B, K] int64, [B] int64)`` (pad value 0)."""
    k = width if width is not None else max((len(d) for d in drafts), default=0)
    ids = torch.zeros(len(drafts), k, dtype=torch.long)
    for b, d in enumerate(drafts):
        if d:
            ids[b, : len(d)] = torch.tensor(d, dtype=torch.long)
    return ids, torch.tensor([len(d) for d in drafts], dtype=torch.long)


class DraftTree(Protocol):
    """One row's token tree as a drafter builds it (e.g.
    :class:`specc.runtime.drafters.suffix_tree.Candidate`): ``token_ids[i]`` follows the
    context when ``parents[i] == -1``, else ``token_ids[parents[i]]`` (``parents[i] < i``)."""

    token_ids: list[int]
    parents: list[int]


def tree_proposal(trees: Sequence[DraftTree]) -> Proposal:
    """Pack per-row draft trees into a tree :class:`Proposal`: node ``i + 1`` is
    ``trees[b].token_ids[i]``, its parent node ``trees[b].parents[i] + 1`` (the context,
    -1, becomes the root, node 0). Padding entries of ``parents`` are chain-like (``i``),
    in range. The one format conversion every tree-proposing drafter uses."""
    ids, num = pad_drafts([t.token_ids for t in trees])
    parents = torch.arange(ids.shape[1]).repeat(len(trees), 1)
    for b, t in enumerate(trees):
        if t.parents:
            parents[b, : len(t.parents)] = torch.tensor(t.parents, dtype=torch.long) + 1
    return Proposal(ids, num, None, parents)
