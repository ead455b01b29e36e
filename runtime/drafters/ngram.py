"""N-gram drafter: prompt lookup decoding.

Prompt lookup decoding (A. Saxena, 2023, https://github.com/apoorvumang/prompt-lookup-decoding),
vLLM's ``method: ngram``: the drafter's history is the request's prompt followed by every
token emitted so far. To propose, take the last ``n`` tokens of that history for ``n``
from ``prompt_lookup_max`` down to ``prompt_lookup_min``; find the most recent earlier
occurrence of that n-gram (one that ends before the final position, so the match is not
the suffix itself); propose the tokens that followed it. The longest ``n`` with a match
wins; among its matches the most recent one (largest end position). At most
``min(num_speculative_tokens, max_num_tokens)`` tokens are proposed, fewer when the
history ends first; ``[]`` when nothing matches.

Implementation: one vectorised pass that grows the match length. ``cand`` holds the end
positions ``j < L-1`` whose last ``t`` tokens equal the last ``t`` tokens of the history;
going from ``t`` to ``t+1`` keeps the candidates with ``tokens[j-t] == tokens[L-1-t]``.
The matches for every ``n`` are therefore found in ``prompt_lookup_max`` numpy filter
steps over a shrinking candidate array (about 10-50 us for an 8k-token history).

Trees (``ngram_propose_tree``, specc's own option; vLLM's n-gram proposer drafts chains):
the longest matched n-gram usually occurs more than once, and its occurrences may have
been followed by different tokens. :meth:`NgramProposer.propose_tree` takes the
continuations (up to the same ``limit`` tokens each) of its :data:`TREE_MAX_MATCHES` most
recent occurrences and merges them into one token tree, shared prefixes merged
(:func:`merge_continuations`): a trie whose node counts how many continuations pass
through it, expanded best-first by that count (the empirical probability of the path
given the matched n-gram, as suffix decoding scores its candidates), ties to the
shallower node, then to the more recent occurrence, until ``limit`` nodes, the chain's
budget. When the n-gram occurred once, or all its occurrences went on alike, the tree is
the chain proposal; it branches where occurrences went on differently. (Breaking ties
by recency first, which keeps the most recent occurrence's whole chain, measured worse:
``bench/suffix_tree_vs_chain.py``, docs/speculative.md.) Returned as a
:class:`~specc.runtime.drafters.suffix_tree.Candidate` (the suffix drafter's tree
format), packed into a :class:`Proposal` by :func:`~specc.runtime.drafters.base.tree_proposal`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from specc.runtime.drafters.base import Proposal, Proposer, StepBatch, pad_drafts, tree_proposal
from specc.runtime.drafters.suffix_tree import Candidate

__all__ = ["NgramProposer", "NgramDrafter", "TREE_MAX_MATCHES", "merge_continuations"]

#: Most recent occurrences of the matched n-gram whose continuations make a tree (bounds
#: the work for frequent short n-grams).
TREE_MAX_MATCHES = 32


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        num_speculative_tokens: k, the most tokens one proposal returns (>= 1).
        prompt_lookup_min: shortest n-gram to match (>= 1).
        prompt_lookup_max: longest n-gram to match (>= prompt_lookup_min).
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= "
                f"prompt_lookup_min ({prompt_lookup_min})"
            )
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.prompt_lookup_min = int(prompt_lookup_min)
        self.prompt_lookup_max = int(prompt_lookup_max)

    def propose(
        self, token_ids: Sequence[int] | np.ndarray, max_num_tokens: int | None = None
    ) -> list[int]:
        """Propose draft tokens continuing ``token_ids`` (prompt + emitted tokens).

        Args:
            token_ids: the full history, 1-D sequence of ints (list, numpy array, ...).
            max_num_tokens: optional further cap (e.g. tokens left before max_tokens or
                the context limit); ``<= 0`` gives ``[]``.

        Returns:
            Up to ``min(num_speculative_tokens, max_num_tokens)`` token ids (Python ints),
            ``[]`` when no n-gram of length ``prompt_lookup_min..prompt_lookup_max``
            recurs.
        """
        tokens, limit, _, ends = self._match(token_ids, max_num_tokens)
        if ends.size == 0:
            return []
        start = int(ends[-1]) + 1  # the most recent match; <= length - 1: a token follows it
        return [int(x) for x in tokens[start : start + limit]]

    def propose_tree(
        self, token_ids: Sequence[int] | np.ndarray, max_num_tokens: int | None = None
    ) -> Candidate:
        """The continuations of the longest matched n-gram's most recent occurrences
        merged into one token tree (module docstring), at most ``min(k, max_num_tokens)``
        nodes; arguments as :meth:`propose`. An empty candidate when nothing matches;
        ``match_len`` is the n-gram's length."""
        tokens, limit, n, ends = self._match(token_ids, max_num_tokens)
        recent = ends[::-1][:TREE_MAX_MATCHES]
        return merge_continuations([tokens[e + 1 : e + 1 + limit] for e in recent], limit, n)

    def _match(self, token_ids, max_num_tokens) -> tuple[np.ndarray, int, int, np.ndarray]:
        """``(tokens, limit, n, ends)``: the history as an array, the draft limit, and the
        longest n-gram length ``n`` in ``prompt_lookup_min..max`` whose suffix recurs with
        the end positions ``ends`` (ascending) of its earlier occurrences (empty, n 0:
        none, or limit 0)."""
        limit = self.num_speculative_tokens
        if max_num_tokens is not None:
            limit = min(limit, int(max_num_tokens))
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        length = tokens.shape[0]
        best_n, best = 0, np.zeros(0, dtype=np.int64)
        if limit <= 0 or length < self.prompt_lookup_min + 1:
            return tokens, limit, best_n, best

        # Length-1 matches: earlier positions holding the last token.
        cand = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        for t in range(1, self.prompt_lookup_max + 1):
            if t > 1:
                # extend every candidate match one token to the left
                cand = cand[cand >= t - 1]
                cand = cand[tokens[cand - (t - 1)] == tokens[length - t]]
            if cand.size == 0:
                break
            if t >= self.prompt_lookup_min:
                best_n, best = t, cand  # the matches of the longest length so far
        return tokens, limit, best_n, best


def merge_continuations(continuations: Sequence[Sequence[int]], limit: int, match_len: int = 0) -> Candidate:
    """Merge token sequences that all follow one context into a token tree.

    The sequences (most recent first) form a trie, shared prefixes merged; a node's count
    is how many sequences pass through it. The tree keeps the ``limit`` nodes picked
    best-first: the highest count among the children of the nodes kept so far; ties go
    to the shallower node, then to the node first reached by the more recent sequence
    (so sequences that share nothing give a breadth-first tree: every sequence's first
    token, then their second tokens, ...). Parents precede children.

    Returns:
        a :class:`Candidate` (``parents`` -1 = the context; ``probs`` the count over the
        number of sequences, a path probability that never grows along a path); empty
        when there is no token.
    """
    kids: list[dict[int, int]] = [{}]  # trie node 0: the context
    token, count, first = [-1], [0], [0]  # per trie node: token, sequences through it, first sequence
    for rank, seq in enumerate(continuations):
        node = 0
        for t in seq:
            child = kids[node].get(int(t))
            if child is None:
                child = kids[node][int(t)] = len(token)
                kids.append({})
                token.append(int(t))
                count.append(0)
                first.append(rank)
            count[child] += 1
            node = child
    total = max(len(continuations), 1)
    # (-count, depth, first sequence, trie node, parent's index in the tree)
    heap = [(-count[c], 1, first[c], c, -1) for c in kids[0].values()]
    heapq.heapify(heap)
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    while heap and len(tokens) < limit:
        neg, depth, _, node, parent = heapq.heappop(heap)
        tokens.append(token[node])
        parents.append(parent)
        probs.append(-neg / total)
        for c in kids[node].values():
            heapq.heappush(heap, (-count[c], depth + 1, first[c], c, len(tokens) - 1))
    return Candidate(tokens, parents, probs, match_len if tokens else 0)


class NgramDrafter(Proposer):
    """The ``ngram`` method as an engine proposer: :class:`NgramProposer` over each
    request's prompt + emitted tokens, on the host. Deterministic (q is one-hot), so it
    ignores the uniforms and returns no draft probabilities.

    ``propose_tree`` (config ``ngram_propose_tree``): propose each row's merged
    continuation tree (:meth:`NgramProposer.propose_tree`) as a token tree
    (``Proposal.parents``), verified in one pass under the tree attention mask (eager
    verify only; the compiler refuses it)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 propose_tree: bool = False):
        super().__init__(num_speculative_tokens)
        self.lookup = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        self.propose_tree = bool(propose_tree)

    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms) -> Proposal:
        rows = zip(batch.requests, max_drafts)
        if self.propose_tree:
            return tree_proposal([self.lookup.propose_tree(req.all_token_ids, cap) if cap > 0 else Candidate()
                                  for req, cap in rows])
        ids, num = pad_drafts([self.lookup.propose(req.all_token_ids, cap) if cap > 0 else []
                               for req, cap in rows])
        return Proposal(ids, num, None)
