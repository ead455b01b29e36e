"""Suffix tree of SuffixDecoding against brute-force counts over the raw sequences."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specc.runtime.drafters.suffix_tree import Candidate, SuffixTree, spec_limit


# ------------------------------------------------------------------------------ reference
def occurrences(seqs: list[list[int]], s: tuple[int, ...]) -> int:
    """Start positions of ``s`` in the sequences (never across a sequence's end)."""
    n = len(s)
    return sum(1 for q in seqs for p in range(len(q) - n + 1) if tuple(q[p : p + n]) == s)


def reference_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for q in seqs:
        for p in range(len(q)):
            for n in range(1, min(depth, len(q) - p) + 1):
                key = tuple(q[p : p + n])
                out[key] = out.get(key, 0) + 1
    return out


def continuations(seqs, s: tuple[int, ...], depth: int, min_prob) -> dict[tuple[int, ...], Fraction]:
    """Every continuation c of s held by a depth-bounded trie, with its exact probability
    count(s + c) / count(s), kept when >= min_prob."""
    total = occurrences(seqs, s)
    out = {}
    for q in seqs:
        for p in range(len(q) - len(s) + 1):
            if tuple(q[p : p + len(s)]) != s:
                continue
            for n in range(1, depth - len(s) + 1):
                if p + len(s) + n > len(q):
                    break
                c = tuple(q[p + len(s) : p + len(s) + n])
                if c not in out:
                    prob = Fraction(occurrences(seqs, s + c), total)
                    if prob >= Fraction(min_prob):
                        out[c] = prob
    return out


def reference_scores(seqs, pattern, depth, k, factor, min_prob, tree) -> dict[int, Fraction]:
    """Exact best score per match length m (only lengths with a non-empty candidate)."""
    scores = {}
    for m in range(1, min(depth, len(pattern)) + 1):
        s = tuple(pattern[len(pattern) - m :])
        if occurrences(seqs, s) == 0:
            break
        limit = min(spec_limit(k, factor, m), depth - m)
        conts = {c: p for c, p in continuations(seqs, s, depth, min_prob).items() if len(c) <= limit}
        if limit <= 0 or not conts:
            continue
        if tree:
            scores[m] = sum(sorted(conts.values(), reverse=True)[:limit])
        else:  # best chain: prefix sums of probabilities along c
            scores[m] = max(sum(conts[c[:i]] for i in range(1, len(c) + 1)) for c in conts)
    return scores


def check_candidate(cand: Candidate, seqs, pattern, depth, k, factor, min_prob, tree) -> None:
    scores = reference_scores(seqs, pattern, depth, k, factor, min_prob, tree)
    best = max(scores.values(), default=Fraction(0))
    assert cand.score == pytest.approx(float(best), abs=1e-9)
    if not scores:
        assert len(cand) == 0 and cand.match_len == 0
        return
    m = cand.match_len
    assert m in scores and float(scores[m]) == pytest.approx(float(best), abs=1e-9)
    s = tuple(pattern[len(pattern) - m :])
    limit = min(spec_limit(k, factor, m), depth - m)
    assert 1 <= len(cand) <= limit
    paths: list[tuple[int, ...]] = []
    for i, (tok, parent, prob) in enumerate(zip(cand.token_ids, cand.parents, cand.probs)):
        assert -1 <= parent < i
        path = (paths[parent] if parent >= 0 else ()) + (tok,)
        paths.append(path)
        assert prob == pytest.approx(occurrences(seqs, s + path) / occurrences(seqs, s), abs=1e-12)
        assert prob >= min_prob
    assert len(set(paths)) == len(paths)  # no node twice
    if not tree:
        assert cand.parents == list(range(-1, len(cand) - 1))


# ------------------------------------------------------------------------------ strategies
seqs_st = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=3)


def build(seqs: list[list[int]], depth: int, chunk: int = 3) -> SuffixTree:
    """A tree over ``seqs``, each appended ``chunk`` tokens at a time (incremental)."""
    tree = SuffixTree(depth)
    for i, q in enumerate(seqs):
        tree.extend(i, [])
        for j in range(0, len(q), chunk):
            tree.extend(i, q[j : j + chunk])
    return tree


# ------------------------------------------------------------------------------ structure
@settings(max_examples=150, deadline=None)
@given(seqs=seqs_st, depth=st.integers(1, 6), chunk=st.integers(1, 5))
def test_counts_equal_reference(seqs, depth, chunk):
    tree = build(seqs, depth, chunk)
    assert tree.counts() == reference_counts(seqs, depth)
    assert tree.num_tokens == sum(map(len, seqs)) == tree.count([])
    assert tree.num_nodes <= 1 + len(reference_counts(seqs, depth))  # unique tails are implicit
    for i, q in enumerate(seqs):
        assert tree.sequence(i) == q
        for n in range(1, min(depth, len(q)) + 1):
            assert tree.count(q[-n:]) == occurrences(seqs, tuple(q[-n:]))


def test_incremental_append_equals_one_shot():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5]
    one = SuffixTree(4)
    one.extend("a", seq)
    step = SuffixTree(4)
    for t in seq:
        step.extend("a", [t])
    assert one.counts() == step.counts() == reference_counts([seq], 4)
    assert step.count([1, 2]) == 3 and step.count([1, 2, 3]) == 2 and step.count([2, 3, 1, 2]) == 1
    assert step.count([1, 2, 3, 1, 2]) == 0  # longer than max_depth: not held


@settings(max_examples=150, deadline=None)
@given(seqs=seqs_st, depth=st.integers(1, 6), drop=st.lists(st.booleans(), min_size=3, max_size=3))
def test_remove_equals_fresh_tree(seqs, depth, drop):
    tree = build(seqs, depth)
    kept = []
    for i, q in enumerate(seqs):
        if drop[i]:
            tree.remove(i)
        else:
            kept.append(q)
    fresh = build(kept, depth)
    assert tree.counts() == fresh.counts() == reference_counts(kept, depth)
    assert tree.num_tokens == fresh.num_tokens
    # a node left with one occurrence stays a branch (not re-compressed), so the removal
    # tree may store more nodes than a fresh one, never more than one per substring
    assert fresh.num_nodes <= tree.num_nodes <= 1 + len(reference_counts(kept, depth))
    # the best-child caches were invalidated where needed: same drafts as a fresh tree
    pattern = (kept[0] if kept else [0])[-3:]
    for tree_mode in (False, True):
        a = tree.speculate(pattern, 4, 1.0, 0.0, tree=tree_mode)
        b = fresh.speculate(pattern, 4, 1.0, 0.0, tree=tree_mode)
        assert a.score == pytest.approx(b.score) and a.match_len == b.match_len


def test_removed_nodes_are_reused():
    tree = SuffixTree(5)
    tree.extend(0, [1, 2, 3, 4, 5, 6, 7])
    high = len(tree._count)
    tree.remove(0)
    assert tree.num_nodes == 1 and tree.num_tokens == 0 and tree.counts() == {}
    tree.extend(1, [9, 8, 7, 6, 5, 4, 3])
    assert len(tree._count) == high  # the freed ids were reused, the lists did not grow
    with pytest.raises(KeyError):
        tree.remove(0)


# ------------------------------------------------------------------------------ matching
@settings(max_examples=200, deadline=None)
@given(seqs=seqs_st, pattern=st.lists(st.integers(0, 4), max_size=8), depth=st.integers(1, 6))
def test_longest_suffix_match(seqs, pattern, depth):
    tree = build(seqs, depth)
    want = 0
    for m in range(1, min(depth, len(pattern)) + 1):
        if occurrences(seqs, tuple(pattern[len(pattern) - m :])) == 0:
            break
        want = m
    assert tree.longest_match(pattern) == want
    assert [m for m, _ in tree.matches(pattern)] == list(range(1, want + 1))


# ------------------------------------------------------------------------------ speculation
@settings(max_examples=300, deadline=None)
@given(
    seqs=seqs_st,
    pattern=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    depth=st.integers(1, 7),
    k=st.integers(1, 6),
    factor=st.sampled_from([0.3, 0.5, 1.0, 2.0]),
    min_prob=st.sampled_from([0.0, 0.1, 0.25, 0.5]),
    tree_mode=st.booleans(),
)
def test_candidate_against_brute_force(seqs, pattern, depth, k, factor, min_prob, tree_mode):
    tree = build(seqs, depth)
    cand = tree.speculate(pattern, k, factor, min_prob, tree=tree_mode)
    check_candidate(cand, seqs, pattern, depth, k, factor, min_prob, tree_mode)


@settings(max_examples=150, deadline=None)
@given(seqs=seqs_st, depth=st.integers(1, 7), k=st.integers(1, 6), min_prob=st.sampled_from([0.0, 0.1, 0.3]))
def test_own_sequence_fast_path_equals_walk(seqs, depth, k, min_prob):
    tree = build(seqs, depth)
    for i, q in enumerate(seqs):
        for tree_mode in (False, True):
            assert (tree.speculate_sequence(i, k, 1.0, min_prob, tree=tree_mode)
                    == tree.speculate(q, k, 1.0, min_prob, tree=tree_mode))


@settings(max_examples=150, deadline=None)
@given(seqs=seqs_st, pattern=st.lists(st.integers(0, 3), min_size=1, max_size=6), k=st.integers(1, 6))
def test_best_path_of_tree(seqs, pattern, k):
    """best_path: the chain inside the tree with the highest summed probability, never
    better than the best chain over the whole trie (which the chain mode returns)."""
    tree = build(seqs, 6)
    cand = tree.speculate(pattern, k, 1.0, 0.1, tree=True)
    path = cand.best_path()
    if not len(cand):
        assert path == []
        return
    # brute force over the tree's own nodes
    chains = []
    for i in range(len(cand)):
        toks, score, j = [], 0.0, i
        while j >= 0:
            toks.append(cand.token_ids[j])
            score += cand.probs[j]
            j = cand.parents[j]
        chains.append((score, toks[::-1]))
    best = max(score for score, _ in chains)
    assert path in [toks for score, toks in chains if score == pytest.approx(best)]
    chain = tree.speculate(pattern, k, 1.0, 0.1)
    assert chain.score >= best - 1e-9


def test_frequency_and_min_token_prob_cut():
    # after [7]: 1 follows 6 times, 2 three times, 3 once (plus the context's own [7] at the end)
    seq = [7, 1] * 6 + [7, 2] * 3 + [7, 3] + [7]
    tree = SuffixTree(4)
    tree.extend(0, seq)
    total = seq.count(7)  # 11 occurrences of [7]
    cand = tree.speculate([9, 7], 3, 1.0, 0.0, tree=True)  # [9, 7] unseen: match length 1
    assert cand.match_len == 1 and cand.token_ids == [1] and cand.probs == [6 / total]
    cand = tree.speculate([9, 7], 3, 3.0, 0.0, tree=True)  # factor 3: 3 tokens
    assert cand.token_ids[:3] == [1, 7, 2] or cand.token_ids[:3] == [1, 7, 1]
    assert sorted(cand.probs, reverse=True) == cand.probs and cand.probs[0] == 6 / total
    # min_token_prob 0.3: only 1 (6/11) passes at the first level; 2 (3/11) and 3 (1/11) are cut
    cand = tree.speculate([9, 7], 5, 5.0, 0.3, tree=True)
    assert 2 not in [t for t, p in zip(cand.token_ids, cand.parents) if p == -1]
    assert all(p >= 0.3 for p in cand.probs)
    # a threshold above every continuation: nothing
    assert len(tree.speculate([9, 7], 5, 5.0, 0.9)) == 0


def test_adaptive_length_follows_match_length():
    seq = list(range(10)) + [50] + list(range(10))  # 0..9 twice
    tree = SuffixTree(24)
    tree.extend(0, seq)
    for m in range(1, 6):
        pattern = [99] + list(range(10 - m - 3, 10 - 3))  # last m tokens match, [99] not
        cand = tree.speculate(pattern, 16, 1.0, 0.1)
        assert cand.match_len == m
        assert len(cand) == m  # ceil(1.0 * m) tokens, all certain (prob 1/2: two occurrences)
        cand = tree.speculate(pattern, 16, 0.5, 0.1)
        assert len(cand) == spec_limit(16, 0.5, m) == -(-m // 2)
    assert spec_limit(4, 1.0, 10) == 4 and spec_limit(4, 0.1, 30) == 3 and spec_limit(4, 0.5, 0) == 0


def test_longer_match_wins_ties_and_depth_bounds_continuations():
    tree = SuffixTree(3)
    tree.extend(0, [1, 2, 3, 4])
    # [1, 2] matches (length 2), but only depth - 2 = 1 more token is held below it
    # ([3], score 1); its suffix [2] reaches 2 tokens deeper: [3, 4] scores 2 and wins
    assert tree.speculate([1, 2], 1, 4.0, 0.0).match_len == 2
    cand = tree.speculate([1, 2], 4, 4.0, 0.0)
    assert cand.match_len == 1 and cand.token_ids == [3, 4]
    # full-depth match: no continuation held below it, shorter matches are used
    assert tree.speculate([1, 2, 3], 4, 4.0, 0.0).match_len < 3
    # equal scores: the longer match is kept
    tree = SuffixTree(8)
    tree.extend(0, [5, 6, 7, 8])
    cand = tree.speculate([5, 6], 1, 1.0, 0.0)
    assert cand.match_len == 2 and cand.token_ids == [7]


def test_chain_beats_greedy_when_the_frequent_branch_dies():
    # after [0]: 1 is most frequent (5/9) but is followed by a different token each time;
    # 2 (4/9) is followed by 3 4 every time
    seq = [t for x in range(10, 15) for t in (0, 1, x)] + [0, 2, 3, 4] * 4
    tree = SuffixTree(8)
    tree.extend(0, seq)
    pattern = [5, 0]
    greedy_first = tree.speculate(pattern, 3, 3.0, 0.0, tree=True).token_ids[0]
    assert greedy_first == 1
    chain = tree.speculate(pattern, 3, 3.0, 0.0)
    assert chain.token_ids == [2, 3, 4]  # 3 * 4/9 beats 5/9 + 1/9 + 1/9 (1, then 10..14, ...)
    assert chain.score == pytest.approx(3 * 4 / 9)


def test_empty_and_invalid():
    tree = SuffixTree(4)
    assert tree.speculate([], 4) == Candidate() and tree.speculate([1, 2], 4).score == 0
    assert tree.longest_match([1]) == 0 and tree.matches([]) == []
    tree.extend(0, [1])
    assert len(tree.speculate([1], 4)) == 0  # the context's own last token: nothing follows
    assert Candidate().best_path() == []
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)
    with pytest.raises(KeyError):
        tree.speculate_sequence("missing", 4)
