"""Tree accept/reject (specc.kernels.tree_rejection_sampler).

Greedy: exact cases. Chains: equal to the chain sampler on the same uniforms. Sampling:
losslessness checked statistically. The toy target is a table ``f(context) -> p`` over
V = 4 tokens (a seeded Dirichlet draw per context), so the true distribution of the first
two generated tokens is ``f(())[a] * f((a,))[b]``. Each trial generates two tokens by
speculative steps, each step over a fresh random tree (random shape of up to 5 nodes,
random tokens from a skewed distribution, sibling duplicates included) whose logits are ``log f`` of each node's path;
the 16 joint cells are compared with a chi-square test.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specc.kernels.rejection_sampler import rejection_sample
from specc.kernels.tree_rejection_sampler import tree_rejection_sample
from test_rejection_sampler import _logits_with_argmax

V = 4
P_MIN = 1e-3
# draft tokens come from a skewed distribution: with uniform drafts a sampler that forgot to
# zero rejected tokens would still pass (its biases cancel over the draft token)
DRAFT_SKEW = [0.55, 0.25, 0.15, 0.05]


def _greedy(logits, tokens, parents, nd=None):
    b, k = tokens.shape
    nd = torch.full((b,), k) if nd is None else nd
    return tree_rejection_sample(logits, tokens, parents, nd, torch.ones(b, dtype=torch.bool),
                                 torch.rand(b, k), torch.rand(b))


def test_greedy_picks_deepest_matching_path():
    #      0            argmax at node: 0 -> 7, 1 -> 3, 2 -> 8, 3 -> 9, 4 -> 5
    #    1(7)  2(7)     two children carry 7: the second one leads deeper
    #    3(4)  4(8)
    logits = _logits_with_argmax([[7, 3, 8, 9, 5]])
    tokens = torch.tensor([[7, 7, 4, 8]])
    parents = torch.tensor([[0, 0, 1, 2]])
    out = _greedy(logits, tokens, parents)
    assert out.num_accepted.tolist() == [2]
    assert out.accepted_nodes[0].tolist() == [0, 2, 4, -1, -1]
    assert out.output_token_ids[0].tolist() == [7, 8, 5, -1, -1]


def test_greedy_no_match_and_padding():
    logits = _logits_with_argmax([[1, 2, 3, 4], [1, 2, 3, 4]])
    tokens = torch.tensor([[5, 6, 7], [1, 2, 3]])
    parents = torch.tensor([[0, 0, 1], [0, 1, 2]])
    out = _greedy(logits, tokens, parents, nd=torch.tensor([3, 1]))  # row 1: nodes 2, 3 padding
    assert out.num_accepted.tolist() == [0, 1]
    assert out.output_token_ids.tolist() == [[1, -1, -1, -1], [1, 2, -1, -1]]
    assert out.accepted_nodes.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1]]


@pytest.mark.parametrize("greedy", [True, False])
def test_chain_equals_chain_sampler(greedy):
    torch.manual_seed(0)
    b, k, vocab = 512, 4, 6
    logits = torch.randn(b, k + 1, vocab) * 2
    drafts = torch.randint(0, vocab, (b, k))
    drafts[: b // 2] = logits[: b // 2, :k].argmax(-1)  # half the rows mostly accepted
    nd = torch.randint(0, k + 1, (b,))
    is_greedy = torch.full((b,), greedy)
    ua, us = torch.rand(b, k), torch.rand(b)
    chain = rejection_sample(logits, drafts, nd, None, is_greedy, ua, us)
    tree = tree_rejection_sample(logits, drafts, torch.arange(k).expand(b, k), nd, is_greedy, ua, us)
    assert torch.equal(tree.output_token_ids, chain.output_token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)


def test_bad_parents_refused():
    with pytest.raises(ValueError, match="parents"):
        _greedy(torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0, 2]]))


# ---------------------------------------------------------------------------- sampling
@lru_cache(maxsize=None)
def _f(context: tuple[int, ...]) -> tuple[float, ...]:
    rng = np.random.default_rng(hash(context) % (2**32) + 7)
    return tuple(rng.dirichlet(np.full(V, 0.8)))


def _random_tree(rng, k):
    n = int(rng.integers(0, k + 1))
    parents = [int(rng.integers(0, i + 1)) for i in range(n)]
    tokens = [int(t) for t in rng.choice(V, size=n, p=DRAFT_SKEW)]
    return parents, tokens


def _step(contexts, rng, k, gen):
    """One speculative step for each context; returns the emitted token lists."""
    b = len(contexts)
    logits = torch.full((b, k + 1, V), -30.0)
    tok = torch.zeros(b, k, dtype=torch.long)
    par = torch.arange(k).repeat(b, 1)
    nd = torch.zeros(b, dtype=torch.long)
    for r, ctx in enumerate(contexts):
        parents, tokens = _random_tree(rng, k)
        paths = [()]
        for i, (p, t) in enumerate(zip(parents, tokens)):
            paths.append(paths[p] + (t,))
        for i, path in enumerate(paths):
            logits[r, i] = torch.log(torch.tensor(_f(ctx + path), dtype=torch.float32))
        tok[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        par[r, : len(parents)] = torch.tensor(parents, dtype=torch.long)
        nd[r] = len(tokens)
    out = tree_rejection_sample(logits, tok, par, nd, torch.zeros(b, dtype=torch.bool),
                                torch.rand(b, k, generator=gen), torch.rand(b, generator=gen))
    return [row[: n + 1] for row, n in zip(out.output_token_ids.tolist(), out.num_accepted.tolist())]


def test_sampling_is_lossless():
    trials, k = 6000, 5
    rng, gen = np.random.default_rng(1), torch.Generator().manual_seed(2)
    seqs: list[tuple[int, ...]] = [()] * trials
    while any(len(s) < 2 for s in seqs):
        todo = [i for i, s in enumerate(seqs) if len(s) < 2]
        for i, emitted in zip(todo, _step([seqs[i] for i in todo], rng, k, gen)):
            seqs[i] = seqs[i] + tuple(emitted)
    observed = np.zeros(V * V)
    for s in seqs:
        observed[s[0] * V + s[1]] += 1
    expected = np.array([_f(())[a] * _f((a,))[b] for a in range(V) for b in range(V)]) * trials
    assert chisquare(observed, expected).pvalue > P_MIN


@pytest.mark.parametrize("children", [[0, 1, 2], [2, 0], [1, 1, 3]])
def test_sibling_tries_are_lossless(children):
    """Root with several children (one trial per row, one step): the first emitted token
    is distributed as p, whichever siblings were tried."""
    trials, k = 20000, len(children)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    gen = torch.Generator().manual_seed(3)
    logits = torch.log(p).expand(trials, k + 1, V).clone()
    tokens = torch.tensor(children).expand(trials, k)
    out = tree_rejection_sample(logits, tokens, torch.zeros(trials, k, dtype=torch.long),
                                torch.full((trials,), k), torch.zeros(trials, dtype=torch.bool),
                                torch.rand(trials, k, generator=gen), torch.rand(trials, generator=gen))
    observed = np.bincount(out.output_token_ids[:, 0].numpy(), minlength=V)
    assert chisquare(observed, p.numpy() * trials).pvalue > P_MIN
