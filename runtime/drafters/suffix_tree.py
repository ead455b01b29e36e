"""Suffix tree of token sequences for SuffixDecoding.

SuffixDecoding (G. Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications", arXiv 2411.04975; vLLM / Arctic Inference ``method: suffix``)
drafts from suffix trees over earlier tokens: one per request over its prompt and output,
and a global one over the outputs of earlier requests. This module holds the data
structure; :mod:`specc.runtime.drafters.suffix` uses it as a drafter.

The tree is a suffix *trie* bounded by ``max_depth``, as Arctic Inference's is: every
suffix of every sequence is inserted up to ``max_depth`` tokens deep, so a node stands for
one substring ``s`` (the tokens on its root path, ``len(s) <= max_depth``) and its
``count`` is how many times ``s`` occurs in the sequences (at how many start positions;
a sequence never matches across its end into another). The root's count is the number of
tokens. Appending a token to a sequence updates the nodes of the sequence's last
``1..max_depth`` tokens ("active" suffixes): ``O(max_depth)`` per token at most.

Unique tails are not stored node by node. Below a substring that occurs once, every
longer substring on that path occurs once too and has one child; such a node is a *head*:
it keeps a reference ``(sequence, index after its occurrence)`` instead of children, and
the chain below it is read from the sequence (it grows with the sequence for free). A
head becomes a normal node (a *branch*) when a second occurrence reaches it (its own
continuation is then materialized one level, as a new head); a branch left with one
occurrence by :meth:`SuffixTree.remove` stays a branch. In text most substrings of more
than a few tokens are unique, so this stores a few nodes per token instead of about
``max_depth`` (Spec-Bench text, depth 24: 1.7 instead of 21 nodes per token,
``bench/suffix_drafting.py``). Arctic Inference compresses every single-child run (a
suffix tree proper); counts, probabilities and candidates are the same.

Speculation from a context ("pattern"): for every suffix of the pattern of ``m <=
max_depth`` tokens found in the tree (node ``u``), the probability of a continuation
``c`` is ``count(s + c) / count(s)`` (product of the child/parent count ratios along its
path, i.e. the empirical frequency with which ``s`` was followed by ``c``). At most
``min(max_spec_tokens, ceil(max_spec_factor * m))`` tokens are drafted (the speculation
length adapts to the match length, as in the paper), and only tokens whose probability is
``>= min_token_prob``. A candidate's score is the sum of its tokens' probabilities (the
expected number of accepted tokens if the counts were the truth); the best-scoring
candidate over all match lengths wins (ties: the longer match). Two shapes:

* tree (``tree=True``): expanded best-first by probability, as in the paper and Arctic
  Inference; the tokens kept are the ``limit`` most probable continuations;
* chain (``tree=False``): the single root-to-node path of at most ``limit`` tokens with
  the highest score (branch and bound over the same probabilities). It is never worse
  than the best path inside the tree of the same budget (that path is one of the chains
  searched), and is what a chain verifier wants.

Memory is at most ``O(max_depth)`` nodes per token held and usually a few;
:meth:`SuffixTree.remove` frees a sequence's nodes, which is how a bounded global cache
stays bounded.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

__all__ = ["Candidate", "SuffixTree", "spec_limit"]

_ROOT = 0
_DIRTY = -2  # best child unknown after a removal: rescan on demand


def spec_limit(max_spec_tokens: int, max_spec_factor: float, match_len: int) -> int:
    """Most tokens to draft after a match of ``match_len`` tokens:
    ``min(max_spec_tokens, ceil(max_spec_factor * match_len))`` (the ceiling ignores float
    noise: ``0.1 * 30`` gives 3). Arctic Inference floors ``factor * len + offset``
    instead; with the default factor 1.0 both give ``match_len``."""
    return max(0, min(max_spec_tokens, math.ceil(max_spec_factor * match_len - 1e-9)))


@dataclass(frozen=True)
class Candidate:
    """Draft tokens as a tree (a chain is a tree whose parents are ``-1, 0, 1, ...``).

    ``token_ids[i]`` follows the matched context when ``parents[i] == -1``, else it
    follows ``token_ids[parents[i]]`` (``parents[i] < i``). ``probs[i]`` is the
    probability of the whole path to token ``i`` given the matched context (count ratio,
    in (0, 1], never larger than its parent's).
    """

    token_ids: list[int] = field(default_factory=list)  # [N] token ids
    parents: list[int] = field(default_factory=list)  # [N] parent index, -1 = the context
    probs: list[float] = field(default_factory=list)  # [N] path probability
    match_len: int = 0  # tokens of the context's suffix that matched (0: empty candidate)

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def score(self) -> float:
        """Sum of the path probabilities: the expected number of accepted draft tokens
        under the count model (for a tree: summed over all its nodes)."""
        return float(sum(self.probs))

    def best_path(self) -> list[int]:
        """Token ids of the root-to-node chain with the highest score (sum of its path
        probabilities; ties: the node added first). ``[]`` for an empty candidate."""
        if not self.token_ids:
            return []
        chain = [0.0] * len(self.token_ids)
        for i, (p, q) in enumerate(zip(self.parents, self.probs)):
            chain[i] = q + (chain[p] if p >= 0 else 0.0)
        i = max(range(len(chain)), key=chain.__getitem__)
        path = []
        while i >= 0:
            path.append(self.token_ids[i])
            i = self.parents[i]
        return path[::-1]


_EMPTY = Candidate()


class SuffixTree:
    """Suffix trie over token sequences, bounded by ``max_depth``, with unique tails kept
    as references into the sequences (module docstring).

    Nodes are integer ids into flat lists (``_count``, ``_token``, ...); freed ids are
    reused, so the lists never grow beyond the most nodes ever held at once. A node is
    either a *branch* (``_children[u]`` a dict ``{token: child}``) or a *head*
    (``_children[u]`` None, ``_ref[u] = (sequence list, index after its occurrence)``,
    count 1, the chain below it implicit). A *position* ``(u, off)`` is the trie node
    ``off`` tokens below ``u`` along ``u``'s chain (``off > 0`` only for a head).

    Args:
        max_depth: longest substring held, and so the longest context suffix matched (>= 1).

    Raises:
        ValueError: ``max_depth < 1``.
    """

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = int(max_depth)
        self._children: list[dict[int, int] | None] = [{}]  # None: a head (or a free id)
        self._ref: list[tuple[list[int], int] | None] = [None]  # heads: (sequence, next index)
        self._count: list[int] = [0]
        self._token: list[int] = [-1]
        self._depth: list[int] = [0]
        self._best: list[int] = [-1]  # branch: child with the largest (count, -token); -1 none
        self._free: list[int] = []
        self._seqs: dict[Hashable, list[int]] = {}
        # seq -> (node, length) of its suffixes of length 1..max_depth-1: the node at that
        # depth, or a head above it when the suffix lies in the head's implicit chain
        self._active: dict[Hashable, list[tuple[int, int]]] = {}

    # -- contents ------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Nodes stored, the root included (implicit chain nodes are not stored)."""
        return len(self._count) - len(self._free)

    @property
    def num_tokens(self) -> int:
        """Tokens held over all sequences (the root's count)."""
        return self._count[_ROOT]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: Hashable) -> list[int]:
        """The tokens of a sequence (a copy). Raises KeyError for an unknown id."""
        return list(self._seqs[seq_id])

    def counts(self) -> dict[tuple[int, ...], int]:
        """``{substring: occurrences}`` for every trie node but the root, implicit ones
        included (tests, debugging)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(_ROOT, ())]
        while stack:
            node, path = stack.pop()
            kids = self._children[node]
            if kids is None:
                seq, nxt = self._ref[node]
                for t in seq[nxt : nxt + self.max_depth - len(path)]:
                    path += (t,)
                    out[path] = 1
                continue
            for t, c in kids.items():
                out[path + (t,)] = self._count[c]
                stack.append((c, path + (t,)))
        return out

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of ``tokens`` (length <= max_depth) in the sequences; 0 if absent.
        ``count([])`` is the number of tokens held."""
        pos = self._locate([int(t) for t in tokens])
        return 0 if pos is None else self._count_at(pos)

    # -- updates -------------------------------------------------------------------------
    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (ints) to sequence ``seq_id`` (created if new): every new
        suffix up to max_depth is counted. ``O(max_depth)`` per token at most; suffixes
        inside a unique tail cost nothing."""
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        children, count, best, token, depth = self._children, self._count, self._best, self._token, self._depth
        keep = self.max_depth - 1
        for t in tokens:
            t = int(t)
            n = len(seq) + 1  # t will sit at n - 1; appended after the suffixes are counted, so
            count[_ROOT] += 1  # a head's implicit chain (and _branch) never sees it early
            grown = []
            for node, length in [(_ROOT, 0), *active]:  # suffixes of length 0..max_depth-1 grow by t
                if depth[node] < length:  # in a chain: its head may have become a branch since
                    node = self._descend(seq, n - 1 - length, node, length)
                kids = children[node]
                if kids is None or depth[node] < length:
                    grown.append((node, length + 1))  # this suffix's own unique chain grows with seq
                    continue
                child = kids.get(t)
                if child is None:
                    child = kids[t] = self._new_node(t, length + 1, (seq, n))
                elif children[child] is None:
                    self._branch(child)  # a head meets its second occurrence
                count[child] += 1
                b = best[node]
                if b == -1 or (b >= 0 and (count[child] > count[b] or (count[child] == count[b] and t < token[b]))):
                    best[node] = child
                grown.append((child, length + 1))
            seq.append(t)
            active[:] = grown[:keep]

    def remove(self, seq_id: Hashable) -> None:
        """Forget sequence ``seq_id``: uncount its suffixes and free the nodes no other
        sequence uses. ``O(len * max_depth)`` at most. Raises KeyError for an unknown id."""
        seq = self._seqs.pop(seq_id)
        del self._active[seq_id]
        children, count, best = self._children, self._count, self._best
        for start in range(len(seq)):
            node = _ROOT
            count[_ROOT] -= 1
            for t in seq[start : start + self.max_depth]:
                kids = children[node]
                child = kids[t]  # never a head's chain: a head seen here counts only this occurrence
                count[child] -= 1
                if best[node] == child:
                    best[node] = _DIRTY
                if count[child] == 0:  # only this occurrence used it, and so its subtree
                    del kids[t]
                    self._free_subtree(child)
                    break
                node = child

    def _new_node(self, token: int, depth: int, ref: tuple[list[int], int] | None) -> int:
        """A head (``ref`` given) or a branch (``ref`` None) with count 0."""
        kids = None if ref is not None else {}
        if self._free:
            i = self._free.pop()
            self._children[i], self._ref[i], self._count[i] = kids, ref, 0
            self._token[i], self._depth[i], self._best[i] = token, depth, -1
            return i
        self._children.append(kids)
        self._ref.append(ref)
        self._count.append(0)
        self._token.append(token)
        self._depth.append(depth)
        self._best.append(-1)
        return len(self._count) - 1

    def _branch(self, head: int) -> None:
        """Turn a head into a branch whose one child (a new head) continues the head's
        occurrence, if that continues within max_depth."""
        seq, nxt = self._ref[head]
        self._ref[head], self._children[head] = None, {}
        d = self._depth[head] + 1
        if nxt < len(seq) and d <= self.max_depth:
            child = self._new_node(seq[nxt], d, (seq, nxt + 1))
            self._count[child] = 1
            self._children[head][seq[nxt]] = child
            self._best[head] = child

    def _descend(self, seq: list[int], start: int, node: int, length: int) -> int:
        """From ``node`` on the path of ``seq[start : start + length]``, follow branches
        down towards depth ``length``; returns the node reached (a head above ``length``
        when the rest is implicit)."""
        children, depth = self._children, self._depth
        while depth[node] < length and children[node] is not None:
            node = children[node][seq[start + depth[node]]]
        return node

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            i = stack.pop()
            if self._children[i] is not None:
                stack.extend(self._children[i].values())
            self._children[i], self._ref[i] = None, None
            self._free.append(i)

    def _best_child(self, node: int) -> int:
        b = self._best[node]
        if b == _DIRTY:
            kids = self._children[node]
            b = min(kids.values(), key=lambda c: (-self._count[c], self._token[c])) if kids else -1
            self._best[node] = b
        return b

    # -- positions -----------------------------------------------------------------------
    def _locate(self, tokens: list[int]) -> tuple[int, int] | None:
        """Position of ``tokens`` from the root, None if absent (or longer than max_depth)."""
        node, i, n = _ROOT, 0, len(tokens)
        while i < n:
            kids = self._children[node]
            if kids is None:  # a head: the rest must follow its occurrence
                seq, nxt = self._ref[node]
                rest = tokens[i:]
                if self._depth[node] + len(rest) > self.max_depth or seq[nxt : nxt + len(rest)] != rest:
                    return None
                return node, len(rest)
            node = kids.get(tokens[i], -1)
            if node < 0:
                return None
            i += 1
        return node, 0

    def _count_at(self, pos: tuple[int, int]) -> int:
        node, off = pos
        return self._count[node] if off == 0 else 1

    def _chain_tail(self, head: int, off: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens of ``head``'s implicit chain after position ``off``."""
        seq, nxt = self._ref[head]
        room = self.max_depth - self._depth[head] - off
        return seq[nxt + off : nxt + off + min(limit, room)]

    # -- matching ------------------------------------------------------------------------
    def matches(self, pattern: Sequence[int]) -> list[tuple[int, tuple[int, int]]]:
        """``(match_len, position)`` for every suffix of ``pattern`` of 1..max_depth tokens
        that occurs in the tree, shortest first. They are the lengths ``1..longest``: a
        suffix that does not occur has no longer suffix that does."""
        tail = [int(t) for t in pattern[-self.max_depth :]]
        n = len(tail)
        return [(m, self._locate(tail[n - m :])) for m in range(1, self._longest(tail) + 1)]

    def longest_match(self, pattern: Sequence[int]) -> int:
        """Length of the longest suffix of ``pattern`` (at most max_depth) that occurs in
        the tree; 0 if not even its last token does."""
        return self._longest([int(t) for t in pattern[-self.max_depth :]])

    def _longest(self, tail: list[int]) -> int:
        """Longest suffix of ``tail`` in the tree, by binary search (occurring suffixes
        are exactly the lengths ``1..longest``)."""
        lo, hi, n = 0, len(tail), len(tail)  # invariant: lo occurs, every length > hi does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._locate(tail[n - mid :]) is not None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- speculation ---------------------------------------------------------------------
    def speculate(self, pattern: Sequence[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, *, tree: bool = False) -> Candidate:
        """Draft a continuation of ``pattern`` (the context; only its last max_depth
        tokens matter).

        Args:
            pattern: the context's token ids.
            max_spec_tokens: most tokens drafted (>= 0).
            max_spec_factor: after a match of m tokens at most ``ceil(factor * m)`` tokens.
            min_token_prob: tokens whose path probability is lower are never drafted.
            tree: True: the best-first tree (the ``limit`` most probable continuations);
                False: the best-scoring chain (module docstring).

        Returns:
            the best-scoring :class:`Candidate` over all match lengths (ties: the longer
            match); an empty one (score 0, match_len 0) when nothing qualifies.
        """
        tail = [int(t) for t in pattern[-self.max_depth :]]
        n = len(tail)
        longest = self._longest(tail)
        positions = ((m, lambda m=m: self._locate(tail[n - m :])) for m in range(longest, 0, -1))
        return self._speculate(positions, max_spec_tokens, max_spec_factor, min_token_prob, tree)

    def speculate_sequence(self, seq_id: Hashable, max_spec_tokens: int, max_spec_factor: float = 1.0,
                           min_token_prob: float = 0.1, *, tree: bool = False) -> Candidate:
        """:meth:`speculate` with one of the tree's own sequences as the context (a
        request's own tree): its suffixes' positions are known, so nothing is matched.
        Equal to ``speculate(sequence(seq_id), ...)``. Raises KeyError for an unknown id."""
        seq, active = self._seqs[seq_id], self._active[seq_id]  # suffixes of length 1..max_depth-1
        n = len(seq)

        def position(node: int, length: int) -> tuple[int, int]:
            node = self._descend(seq, n - length, node, length)
            return node, length - self._depth[node]

        positions = ((length, lambda u=u, length=length: position(u, length)) for u, length in reversed(active))
        return self._speculate(positions, max_spec_tokens, max_spec_factor, min_token_prob, tree)

    def _speculate(self, positions, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                   tree: bool) -> Candidate:
        """Best candidate over ``positions``: ``(match_len, () -> position)``, longest first."""
        expand = self._tree if tree else self._chain
        best, best_score = _EMPTY, 0.0
        for m, position in positions:
            # the trie holds continuations up to max_depth - m tokens long
            limit = min(spec_limit(max_spec_tokens, max_spec_factor, m), self.max_depth - m)
            if limit <= best_score:  # every probability is <= 1: this match cannot win
                continue
            cand = expand(position(), limit, min_token_prob, m, best_score)
            if cand is not None and cand.score > best_score:
                best, best_score = cand, cand.score
        return best

    def _tree(self, pos: tuple[int, int], limit: int, min_prob: float, match_len: int,
              bound: float = 0.0) -> Candidate | None:
        """Best-first expansion: pop the most probable frontier position (ties: first
        pushed), add its token, push its children with probability >= min_prob. (``bound``
        is unused: a tree's score is known only once built.) None when nothing qualifies."""
        total = self._count_at(pos)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, int, int]] = []  # (-prob, order, node, off, parent index)
        order = 0

        def push(node: int, off: int, parent: int) -> None:
            nonlocal order
            kids = self._children[node]
            if kids is None:  # a head's chain: one child of count 1
                if self._chain_tail(node, off, 1) and 1 / total >= min_prob:
                    heapq.heappush(heap, (-1 / total, order, node, off + 1, parent))
                    order += 1
                return
            for c in kids.values():
                p = self._count[c] / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, c, 0, parent))
                    order += 1

        push(*pos, -1)
        while heap and len(tokens) < limit:
            neg_p, _, node, off, parent = heapq.heappop(heap)
            tokens.append(self._token[node] if off == 0 else self._chain_tail(node, off - 1, 1)[0])
            parents.append(parent)
            probs.append(-neg_p)
            push(node, off, len(tokens) - 1)
        return Candidate(tokens, parents, probs, match_len) if tokens else None

    def _chain(self, pos: tuple[int, int], limit: int, min_prob: float, match_len: int,
               bound: float = 0.0) -> Candidate | None:
        """The chain of <= limit tokens (each with probability >= min_prob) with the
        highest score: depth-first, most frequent child first (so the first chain found
        is the greedy one), pruning a branch when even probability ``p`` for every
        remaining token could not beat the best score (``score + p * left``). A head's
        chain has one continuation (probability ``1 / total`` per token), taken whole.
        Only a chain scoring above ``bound`` is returned (else None)."""
        node, off = pos
        total = self._count_at(pos)
        if self._children[node] is None:  # the match lies in a unique chain: follow it
            tail = self._chain_tail(node, off, limit)
            if not tail or len(tail) <= bound or min_prob > 1.0:
                return None
            return Candidate(tail, list(range(-1, len(tail) - 1)), [1.0] * len(tail), match_len)
        count, children, token = self._count, self._children, self._token
        best_score, best_nodes, best_tail = bound, [], []
        path: list[int] = []

        def visit(u: int, score: float, left: int) -> None:
            nonlocal best_score, best_nodes, best_tail
            if score > best_score:
                best_score, best_nodes, best_tail = score, list(path), []
            if left == 0:
                return
            if children[u] is None:  # a head: its chain is the one continuation
                p = 1 / total
                tail = self._chain_tail(u, 0, left)
                if tail and p >= min_prob and score + p * len(tail) > best_score:
                    best_score, best_nodes, best_tail = score + p * len(tail), list(path), tail
                return
            first = self._best_child(u)
            if first < 0:
                return
            p = count[first] / total
            if p < min_prob or score + p * left <= best_score:
                return  # no sibling is more probable than the first
            path.append(first)
            visit(first, score + p, left - 1)
            path.pop()
            for c in children[u].values():
                p = count[c] / total
                if c == first or p < min_prob or score + p * left <= best_score:
                    continue
                path.append(c)
                visit(c, score + p, left - 1)
                path.pop()

        visit(node, 0.0, limit)
        if not best_nodes and not best_tail:
            return None
        tokens = [token[c] for c in best_nodes] + best_tail
        probs = [count[c] / total for c in best_nodes] + [1 / total] * len(best_tail)
        return Candidate(tokens, list(range(-1, len(tokens) - 1)), probs, match_len)
