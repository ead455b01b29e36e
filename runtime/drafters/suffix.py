"""Suffix drafter: SuffixDecoding as an engine proposer (``method: suffix``).

SuffixDecoding (G. Oliaro et al., arXiv 2411.04975; vLLM / Arctic Inference
``method: suffix``) drafts from two suffix trees (:mod:`~specc.runtime.drafters.suffix_tree`):

* a per-request tree over the request's prompt + output, built at admission and updated
  after every step with the tokens the step emitted;
* a global tree over the outputs of earlier requests: a request's output joins it when
  the request finishes; it holds at most ``max_cached_requests`` outputs and evicts the
  oldest output first (0 turns it off).

Each step the context's last ``max_tree_depth`` tokens are matched in both trees and the
candidate with the higher score (expected accepted tokens under the count model; ties:
the per-request one) is proposed. Speculation length adapts to the match length:
``min(k, ceil(max_spec_factor * match_len))`` tokens, each with count-based probability
``>= min_token_prob``.

By default the drafter proposes the best-scoring *chain* (``SuffixTree.speculate(tree=False)``).
With ``propose_tree`` (config ``suffix_decoding_propose_tree``) it proposes the paper's
candidate *tree* (``tree=True``: the ``limit`` most probable continuations, best-first) as
a token tree (``Proposal.parents``), verified in one pass under the tree attention mask
(:mod:`specc.passes.tree_mask`; compiled: ``tree_step``). Deterministic: q is one-hot
(``draft_probs`` None), so rejection sampling stays lossless. With the global tree on,
a request's drafts depend on which requests finished before it: outputs are unchanged
for greedy requests and equal in distribution for sampled ones, but a seeded sampled
request reproduces its tokens only with the same cache contents (set
``suffix_decoding_max_cached_requests: 0`` for per-request trees only).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import count

from specc.runtime.drafters.base import Proposal, Proposer, StepBatch, pad_drafts, tree_proposal
from specc.runtime.drafters.suffix_tree import Candidate, SuffixTree
from specc.runtime.request import Request

__all__ = ["SuffixDrafter"]

_SEQ = 0  # the one sequence of a per-request tree


@dataclass
class _Live:
    """A running request's tree over ``request.prompt_token_ids + output_token_ids[:synced]``."""

    request: Request
    tree: SuffixTree
    synced: int = 0  # output tokens already in the tree


class SuffixDrafter(Proposer):
    """The ``suffix`` method (module docstring).

    Per-request state is keyed by ``request_id`` (a new Request object under a known id
    replaces the old state), so a slot move needs nothing. Hooks: ``prefill`` builds the
    request's tree, ``on_verified`` appends the emitted tokens, ``finish`` moves the
    output into the global tree and drops the request's tree.

    Args:
        num_speculative_tokens: k, the most tokens one proposal returns (>= 1).
        max_tree_depth: longest context suffix matched, and depth of the trees (>= 1).
        max_cached_requests: outputs the global tree holds (>= 0; 0: no global tree).
        max_spec_factor: draft at most ``ceil(factor * match_len)`` tokens (> 0).
        min_token_prob: never draft a token of lower count-based probability (0..1).
        propose_tree: propose the candidate tree instead of the best chain (compiled:
            verified by the artifact's ``tree_step`` programs).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, propose_tree: bool = False):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        super().__init__(num_speculative_tokens)
        self.max_tree_depth = int(max_tree_depth)
        self.max_cached_requests = int(max_cached_requests)
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.propose_tree = bool(propose_tree)
        self.global_tree = SuffixTree(self.max_tree_depth)
        self._cached: deque[int] = deque()  # global tree sequence ids, oldest first
        self._next_id = count()
        self._live: dict[int, _Live] = {}

    # -- engine hooks --------------------------------------------------------------------
    def prefill(self, request: Request, slot: int) -> None:
        self._sync(request)

    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms) -> Proposal:
        cands = [self.candidate(req, cap) if cap > 0 else Candidate()
                 for req, cap in zip(batch.requests, max_drafts)]
        if self.propose_tree:
            return tree_proposal(cands)
        ids, num = pad_drafts([c.token_ids for c in cands])
        return Proposal(ids, num, None)

    def on_verified(self, batch: StepBatch, num_accepted: list[int], accepted_paths=None) -> None:
        """Append each request's emitted tokens (the accepted path's tokens and the
        final token) to its tree; ``accepted_paths`` is not needed for that."""
        for req in batch.requests:
            if req.request_id in self._live:
                self._sync(req)

    def finish(self, request: Request) -> None:
        """The request's output joins the global tree (evicting the oldest output when
        full); its own tree is dropped."""
        self._live.pop(request.request_id, None)
        if self.max_cached_requests == 0 or not request.output_token_ids:
            return
        if len(self._cached) == self.max_cached_requests:
            self.global_tree.remove(self._cached.popleft())
        seq_id = next(self._next_id)
        self.global_tree.extend(seq_id, request.output_token_ids)
        self._cached.append(seq_id)

    # -- drafting ------------------------------------------------------------------------
    def candidate(self, request: Request, max_tokens: int | None = None) -> Candidate:
        """The chain (with ``propose_tree``: the tree) proposed for ``request`` now: the
        better-scoring of the per-request and global trees' candidates (ties:
        per-request), at most ``min(k, max_tokens)`` tokens."""
        limit = self.num_speculative_tokens if max_tokens is None else min(self.num_speculative_tokens, max_tokens)
        live = self._sync(request)
        args = (limit, self.max_spec_factor, self.min_token_prob)
        own = live.tree.speculate_sequence(_SEQ, *args, tree=self.propose_tree)
        if not self._cached:
            return own
        other = self.global_tree.speculate(self._context_tail(request), *args, tree=self.propose_tree)
        return other if other.score > own.score else own

    def history(self, request_id: int) -> list[int]:
        """Tokens in a running request's tree (its prompt + output as of the last sync).
        Raises KeyError for a request not running."""
        return self._live[request_id].tree.sequence(_SEQ)

    @property
    def num_live(self) -> int:
        """Requests whose trees are held."""
        return len(self._live)

    def _sync(self, request: Request) -> _Live:
        """The request's state with every emitted token in its tree (created on first use)."""
        live = self._live.get(request.request_id)
        if live is None or live.request is not request:
            live = self._live[request.request_id] = _Live(request, SuffixTree(self.max_tree_depth))
            live.tree.extend(_SEQ, request.prompt_token_ids)
        out = request.output_token_ids
        if live.synced < len(out):
            live.tree.extend(_SEQ, out[live.synced :])
            live.synced = len(out)
        return live

    def _context_tail(self, request: Request) -> list[int]:
        """The last max_tree_depth tokens of prompt + output, without copying the whole."""
        d, out = self.max_tree_depth, request.output_token_ids
        if len(out) >= d:
            return out[-d:]
        return request.prompt_token_ids[len(out) - d :] + out
