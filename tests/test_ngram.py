"""N-gram (prompt lookup) drafter against a plain reference matcher."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import reference_ngram
from specc.runtime.drafters.ngram import NgramProposer


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
