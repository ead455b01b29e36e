"""N-gram (prompt lookup) drafter against a plain reference matcher."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import reference_ngram
from specc.runtime.drafters.ngram import TREE_MAX_MATCHES, NgramProposer, merge_continuations


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 6),
    lookup=st.tuples(st.integers(1, 5), st.integers(0, 3)),
    cap=st.one_of(st.none(), st.integers(-1, 7)),
    as_array=st.booleans(),
)
def test_matches_reference(tokens, k, lookup, cap, as_array):
    lo, extra = lookup
    hi = lo + extra
    proposer = NgramProposer(k, lo, hi)
    arg = np.asarray(tokens, dtype=np.int64) if as_array else tokens
    got = proposer.propose(arg, max_num_tokens=cap)
    assert got == reference_ngram(tokens, k, lo, hi, cap)
    assert all(type(x) is int for x in got)


def test_random_longer_contexts_match_reference():
    rng = np.random.default_rng(0)
    for _ in range(200):
        length = int(rng.integers(0, 400))
        vocab = int(rng.integers(2, 20))
        tokens = rng.integers(0, vocab, size=length).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 9))
        assert NgramProposer(k, lo, hi).propose(tokens) == reference_ngram(tokens, k, lo, hi)


def test_edge_cases():
    p = NgramProposer(3, 1, 3)
    assert p.propose([]) == []
    assert p.propose([5]) == []
    assert p.propose([5, 6]) == []  # no earlier occurrence of 6
    assert p.propose([5, 5]) == [5]  # match at 0, followed by the last token
    assert p.propose(np.array([], dtype=np.int64)) == []
    # shorter than n: only the short n-grams can match
    assert NgramProposer(3, 3, 3).propose([1, 2, 3]) == []
    assert NgramProposer(3, 2, 2).propose([1, 2, 1, 2]) == [1, 2]
    # the suffix itself is not a match; the most recent earlier one is
    assert p.propose([1, 2, 9, 1, 2, 7, 1, 2]) == [7, 1, 2]
    # longest n wins over a more recent shorter match
    assert p.propose([4, 1, 2, 8, 5, 2, 9, 4, 1, 2]) == [8, 5, 2]
    # match ending right before the final position: proposal cut by the context end
    assert p.propose([7, 7, 7, 7]) == [7]
    assert p.propose([3, 1, 2, 1, 2]) == [1, 2]
    # max_num_tokens cap
    ctx = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer(5, 1, 2).propose(ctx) == [3, 4, 5, 6, 1]
    assert NgramProposer(5, 1, 2).propose(ctx, max_num_tokens=2) == [3, 4]
    assert NgramProposer(5, 1, 2).propose(ctx, max_num_tokens=0) == []
    assert NgramProposer(5, 1, 2).propose(ctx, max_num_tokens=99) == [3, 4, 5, 6, 1]
    # prompt_lookup_min excludes shorter matches
    assert NgramProposer(3, 2, 3).propose([1, 9, 1]) == []


def test_invalid_config():
    with pytest.raises(ValueError):
        NgramProposer(0, 1, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 3, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 1, 2).propose(np.zeros((2, 2), dtype=np.int64))


def test_c11_history_grows_step_by_step():
    """C11 shape: drafts on prompt + emitted history equal the reference at every step."""
    phrase = [11, 12, 13, 14, 15, 16, 17]
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 50, size=9).tolist() + phrase + rng.integers(0, 50, size=5).tolist() + phrase[:3]
    proposer = NgramProposer(5, 1, 4)
    history = list(prompt)
    hits = 0
    for step in range(64):
        drafts = proposer.propose(history)
        assert drafts == reference_ngram(history, 5, 1, 4)
        hits += bool(drafts)
        # pretend a target accepted some drafts and added one token
        n_acc = step % (len(drafts) + 1)
        history += drafts[:n_acc] + [int(rng.integers(0, 50))]
    assert hits > 0


# ----------------------------------------------------------------------- n-gram trees


def _reference_tree(tokens, k, lo, hi, cap=None):
    """Obviously-correct ``ngram_propose_tree``: the longest recurring n-gram suffix, the
    continuations of its most recent occurrences (``TREE_MAX_MATCHES``), every distinct
    path prefix counted, then nodes picked one by one among those whose parent path is
    picked: most continuations first, then the shallower, then the more recent first
    occurrence. Returns ``([(path tuple, count)] in pick order, number of continuations)``."""
    limit = k if cap is None else min(k, cap)
    if limit <= 0:
        return [], 0
    n_len = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n_len < n + 1:
            continue
        suffix = tokens[n_len - n :]
        starts = [s for s in range(n_len - n - 1, -1, -1) if tokens[s : s + n] == suffix]
        if starts:
            break
    else:
        return [], 0
    conts = [tokens[s + n : s + n + limit] for s in starts[:TREE_MAX_MATCHES]]
    count, first = {}, {}
    for rank, c in enumerate(conts):
        for d in range(1, len(c) + 1):
            count[tuple(c[:d])] = count.get(tuple(c[:d]), 0) + 1
            first.setdefault(tuple(c[:d]), rank)
    picked = []
    while len(picked) < limit:
        have = {p for p, _ in picked}
        ready = [p for p in count if p not in have and (len(p) == 1 or p[:-1] in have)]
        if not ready:
            break
        best = min(ready, key=lambda p: (-count[p], len(p), first[p]))
        picked.append((best, count[best]))
    return picked, len(conts)


def _paths(cand):
    """The candidate's nodes as root-to-node token tuples, in node order."""
    out = []
    for t, p in zip(cand.token_ids, cand.parents):
        assert p < len(out)  # parents precede children (-1: the context)
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    k=st.integers(1, 8),
    lookup=st.tuples(st.integers(1, 4), st.integers(0, 2)),
    cap=st.one_of(st.none(), st.integers(0, 9)),
)
def test_tree_matches_reference(tokens, k, lookup, cap):
    lo, hi = lookup[0], lookup[0] + lookup[1]
    proposer = NgramProposer(k, lo, hi)
    cand = proposer.propose_tree(tokens, max_num_tokens=cap)
    want, total = _reference_tree(tokens, k, lo, hi, cap)
    assert _paths(cand) == [p for p, _ in want]
    assert len(set(_paths(cand))) == len(cand)  # shared prefixes merged: no duplicate path
    assert all(type(t) is int for t in cand.token_ids)
    assert cand.probs == pytest.approx([c / total for _, c in want])
    chain = proposer.propose(tokens, max_num_tokens=cap)
    assert bool(chain) == bool(len(cand))  # drafts at the same positions as the chain
    if all(p == 1.0 for p in cand.probs):  # every occurrence went on alike: the chain
        assert cand.token_ids == chain


def test_tree_merges_several_matches():
    # "1 2" occurs at 0, 4, 8, 13 (most recent first: 8, 4, 0); followed by
    # 8: 3 7 5 ...; 4: 4 8 1 ...; 0: 3 9 1 ...
    history = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 5, 1, 2]
    cand = NgramProposer(4, 1, 3).propose_tree(history)
    # 3 (two occurrences) first, then 4 (depth 1), then 7 (under 3) and 8 (under 4): the
    # depth-2 nodes in recency order of their occurrences (9, under 3, is out of budget)
    assert cand.token_ids == [3, 4, 7, 8] and cand.parents == [-1, -1, 0, 1]
    assert cand.match_len == 2 and cand.probs[0] == pytest.approx(2 / 3)
    assert NgramProposer(4, 1, 3).propose(history) == [3, 7, 5, 1]  # the chain: most recent only
    # a budget of 6 reaches the older occurrence's 9 and the depth-3 nodes
    six = NgramProposer(6, 1, 3).propose_tree(history)
    assert _paths(six) == [(3,), (4,), (3, 7), (4, 8), (3, 9), (3, 7, 5)]
    # shared prefixes are one path: three occurrences that agree give a chain
    agree = [5, 6, 7, 8, 0, 5, 6, 7, 8, 0, 5, 6, 7, 8, 0, 5, 6]
    tree = NgramProposer(3, 2, 2).propose_tree(agree)
    assert tree.token_ids == [7, 8, 0] and tree.parents == [-1, 0, 1] and tree.probs == [1.0, 1.0, 1.0]


def test_tree_of_one_occurrence_is_the_chain():
    history = [4, 1, 2, 8, 5, 2, 9, 4, 1, 2]
    p = NgramProposer(3, 1, 3)
    cand = p.propose_tree(history)
    assert cand.token_ids == p.propose(history) == [8, 5, 2] and cand.parents == [-1, 0, 1]
    assert len(p.propose_tree([5, 6])) == 0 and p.propose_tree([5, 6]).match_len == 0
    assert len(p.propose_tree([1, 2, 1, 2], max_num_tokens=0)) == 0


def test_merge_continuations():
    cand = merge_continuations([[1, 2, 3, 4], [5, 6], [5, 7]], 4)
    assert _paths(cand) == [(5,), (1,), (1, 2), (5, 6)]
    assert cand.probs == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert len(merge_continuations([], 4)) == 0 and len(merge_continuations([[1]], 0)) == 0


def test_tree_uses_the_most_recent_matches_only():
    # the 1-gram "9" occurs TREE_MAX_MATCHES + 5 times; the oldest 5 continuations (token 7)
    # are beyond the cap, the recent ones all continue with 3 then 9
    history = [9, 7] * 5 + [9, 3] * TREE_MAX_MATCHES + [9]
    cand = NgramProposer(2, 1, 1).propose_tree(history)
    assert cand.token_ids == [3, 9] and cand.probs == [1.0, 1.0]
