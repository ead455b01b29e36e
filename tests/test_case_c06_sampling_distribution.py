"""C6 Sampling distribution, through the whole runtime (../shared/cases/correctness.md).

The kernel-level statistical tests live in ``test_rejection_sampler.py``; this file proves
that the *runtime path* is lossless: per-request uniforms, the drafters' processed
probabilities q (draft model, early exit, EAGLE heads; EAGLE-3's q over its reduced draft
vocabulary, mapped to target ids), the n-gram and suffix drafters' one-hot q
(suffix with its global tree on: drafts from other requests' sampled outputs; suffix
candidate *trees*, n-gram continuation *trees*, EAGLE heads' static trees of top-r
candidates and EAGLE-2 dynamic trees, verified by the tree sampler's recursive rejection), padded
verify batches and the engine's bookkeeping.

Toy model: a 2-layer random Llama with a 64-token vocabulary (so chi-square cells are
well filled with a few hundred samples), ``ignore_eos`` so every request emits exactly
``MAX_TOKENS`` tokens. With k=4 the first verify step carries 4 drafts (positions 2..5)
plus the bonus slot (position 6); position 1 comes from the prefill, positions 7-8 from
later steps with fewer drafts (capped by max_tokens), whose rows are padded.

Reference: the exact target distribution of every emitted token, recomputed
independently with Hugging Face ``transformers`` on the sampled sequence (teacher
forcing) and the request's processors (``process_logits``). For position ``n`` the
tokens of different samples are independent given their prefixes, so

    O - E = sum_i (onehot(t_i) - p_i(. | prefix_i))

is a sum of martingale differences with covariance ``sum_i diag(p_i) - p_i p_i^T``; the
quadratic form ``(O-E)^T Cov^-1 (O-E)`` (Pearson's statistic when all ``p_i`` are equal) is
chi-square distributed, and the forms of different positions add up (martingale
increments are uncorrelated). Two statistics per drafter and setting: the per-position
marginals, and each position conditional on the previous token. Every run is seeded, so
the test is deterministic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from helpers import build_tiny_model, drafter_spec, make_session
from specc import SamplingParams, Session
from specc.outputs import SpecMetrics
from specc.runtime.sampling import process_logits

V = 64  # toy vocabulary (ids 0..2 are the tokenizer's specials; harmless with ignore_eos)
K = 4
MAX_TOKENS = 8
N = 480  # samples per drafter and setting (one batch)
P_MIN = 1e-3
MIN_EXPECTED = 5.0
LM_HEAD_STD = 0.2  # logits std ~1.6: at temperature 0.7 the top-p 0.5 set still holds several tokens

SETTINGS = {
    "t0.7_top_p0.5": dict(temperature=0.7, top_p=0.5),
    "top_k2": dict(top_k=2),
    "t1.3": dict(temperature=1.3),
}
METHODS = ["ngram", "draft_model", "early_exit", "draft_equals_target", "suffix", "eagle", "eagle3", "suffix_tree",
           "ngram_tree", "eagle_tree", "eagle_dynamic_tree"]


def _build_toy(out_dir: Path, tokenizer, seed: int) -> Path:
    """The tiny Llama with a V-token vocabulary and a flatter distribution (LM_HEAD_STD)."""
    return build_tiny_model("llama", tokenizer, out_dir, seed, vocab_size=V, lm_head_std=LM_HEAD_STD)


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory, smollm2_tokenizer) -> tuple[Path, Path]:
    """(target, a different drafter of the same vocabulary)."""
    return (_build_toy(tmp_path_factory.mktemp("c6_target"), smollm2_tokenizer, 71),
            _build_toy(tmp_path_factory.mktemp("c6_drafter"), smollm2_tokenizer, 72))


@pytest.fixture(scope="module")
def reference_model(toy_dirs):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(toy_dirs[0], torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def toy_heads(tmp_path_factory, toy_dirs) -> dict[str, Path]:
    """Random EAGLE and EAGLE-3 heads for the toy target; the EAGLE-3 head's draft
    vocabulary holds 32 of the 64 tokens (q is zero on the others)."""
    from transformers import AutoConfig

    from eagle_checkpoints import write_eagle3_checkpoint, write_eagle_checkpoint
    from specc.models.llama import ModelConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(toy_dirs[0]))
    root = tmp_path_factory.mktemp("c6_heads")
    return {"eagle": write_eagle_checkpoint(root / "eagle", config, std=0.3),
            "eagle3": write_eagle3_checkpoint(root / "eagle3", config, draft_vocab_size=32, layer_ids=[0, 1, 2])}


def _spec_config(method: str, dirs: tuple[Path, Path], heads: dict[str, Path]) -> dict:
    target, other = dirs
    if method in heads:
        return drafter_spec(method, K, heads[method])
    if method == "eagle_tree":  # a static tree of the head's top-2 candidates (deterministic, one-hot q)
        return drafter_spec("eagle", K, heads["eagle"], speculative_token_tree="[(0,), (1,), (0, 0), (0, 1)]")
    if method == "eagle_dynamic_tree":  # EAGLE-2's per-row trees (depth 2, topk 2: the best 4 of 6)
        return drafter_spec("eagle3", K, heads["eagle3"], eagle_dynamic_tree=dict(depth=2, topk=2))
    if method == "draft_equals_target":
        return drafter_spec("draft_model", K, target)
    if method == "suffix_tree":  # candidate trees: the tree sampler's recursive rejection
        return drafter_spec("suffix", K, suffix_decoding_propose_tree=True)
    if method == "ngram_tree":  # the seed's several earlier continuations merged into trees
        return drafter_spec("ngram", K, ngram_propose_tree=True)
    return drafter_spec(method, K, other)  # draft_model: the other toy drafts


def _session(method: str, dirs, heads) -> Session:
    return make_session(dirs[0], _spec_config(method, dirs, heads), max_model_len=128, max_num_seqs=N)


def _sample(session: Session, prompt: list[int], setting: dict, seed0: int, use_speculation=True):
    params = [SamplingParams(**setting, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed0 + i)
              for i in range(N)]
    outs = session.generate([prompt] * N, params, use_speculation=use_speculation)
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in outs)
    metrics = SpecMetrics()
    for o in outs:
        metrics.add(o.metrics.spec)
    return np.array([o.token_ids for o in outs], dtype=np.int64), metrics


@torch.inference_mode()
def _reference_probs(model, prompt: list[int], tokens: np.ndarray, setting: dict) -> np.ndarray:
    """``[N, MAX_TOKENS, V]`` float64: the target's processed distribution at every
    emitted position, given the sample's own prefix (teacher forcing)."""
    uniq, inverse = np.unique(tokens, axis=0, return_inverse=True)
    seqs = torch.cat([torch.tensor(prompt).expand(len(uniq), -1), torch.from_numpy(uniq)], dim=1)
    n0 = len(prompt) - 1
    raw = []
    for i in range(0, len(seqs), 256):
        logits = model(seqs[i : i + 256]).logits.float()
        raw.append(logits[:, n0 : n0 + MAX_TOKENS])
    raw = torch.cat(raw).reshape(-1, V)
    rows = raw.shape[0]
    p = SamplingParams(**setting)
    processed = process_logits(
        raw,
        torch.full((rows,), float(p.temperature)),
        torch.full((rows,), int(p.top_k), dtype=torch.long),
        torch.full((rows,), float(p.top_p)),
    )
    probs = torch.softmax(processed.double(), dim=-1).reshape(len(uniq), MAX_TOKENS, V).numpy()
    return probs[inverse.reshape(-1)]


def _quadratic_form(probs: np.ndarray, tokens: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of one group of samples.

    ``probs`` ``[n, V]``: each sample's exact distribution; ``tokens`` ``[n]``. Tokens with
    expected count < MIN_EXPECTED are pooled in one cell (merged into the smallest cell
    if the pool itself is too small)."""
    expected = probs.sum(0)
    big = np.flatnonzero(expected >= MIN_EXPECTED)
    if len(big) == 0:
        return 0.0, 0
    cell = np.full(V, -1)
    cell[big] = np.arange(len(big))
    rest = expected < MIN_EXPECTED
    n_cells = len(big)
    if expected[rest].sum() >= MIN_EXPECTED:
        cell[rest] = n_cells
        n_cells += 1
    else:
        cell[rest] = int(np.argmin(expected[big]))
    if n_cells < 2:
        return 0.0, 0
    onehot = np.zeros((V, n_cells))
    onehot[np.arange(V), cell] = 1.0
    pc = probs @ onehot  # [n, cells]
    observed = np.bincount(cell[tokens], minlength=n_cells).astype(np.float64)
    d = (observed - pc.sum(0))[:-1]
    cov = (np.diag(pc.sum(0)) - pc.T @ pc)[:-1, :-1]
    # cells whose probability is 0 or 1 in every sample have no variance (a deviation
    # there means a zero-probability token was emitted, which the caller checks): use the
    # pseudo-inverse on the remaining directions
    w, vecs = np.linalg.eigh(cov)
    keep = w > 1e-9 * max(w.max(), 1.0)
    if not keep.any():
        return 0.0, 0
    proj = vecs[:, keep].T @ d
    return float(np.sum(proj**2 / w[keep])), int(keep.sum())


def _p_values(probs: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
    """(marginal p-value, conditional-on-previous-token p-value) over all positions."""
    marg, cond = [0.0, 0], [0.0, 0]
    for n in range(MAX_TOKENS):
        s, df = _quadratic_form(probs[:, n], tokens[:, n])
        marg = [marg[0] + s, marg[1] + df]
        if n == 0:
            cond = [cond[0] + s, cond[1] + df]
            continue
        prev = tokens[:, n - 1]
        for g in np.unique(prev):
            sel = prev == g
            if sel.sum() < 2 * MIN_EXPECTED:
                continue
            s, df = _quadratic_form(probs[sel, n], tokens[sel, n])
            cond = [cond[0] + s, cond[1] + df]
    pv = lambda st: 1.0 if st[1] == 0 else float(chi2.sf(st[0], st[1]))  # noqa: E731
    return pv(marg), pv(cond)


@pytest.fixture(scope="module")
def prompt(sessions) -> list[int]:
    """Six seeded samples of the target after the same 4-token seed, then the seed again:
    the n-gram drafter matches the seed (or a later n-gram) and proposes what one of the
    earlier samples continued with, which the target often accepts."""
    seed = [5, 6, 7, 8]
    s, prompt = sessions("ngram"), []
    for j in range(6):
        p = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=j)
        prompt += seed + s.generate([seed], p, use_speculation=False)[0].token_ids
    return prompt + seed


@pytest.fixture(scope="module")
def sessions(toy_dirs, toy_heads):
    cache: dict[str, Session] = {}

    def get(method: str) -> Session:
        if method not in cache:
            cache[method] = _session(method, toy_dirs, toy_heads)
        return cache[method]

    return get


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", METHODS)
def test_runtime_sampling_is_lossless(method, setting, sessions, prompt, reference_model):
    cfg = SETTINGS[setting]
    seed0 = 100_000 * (METHODS.index(method) + 1) + 1_000 * list(SETTINGS).index(setting)
    tokens, metrics = _sample(sessions(method), prompt, cfg, seed0)
    probs = _reference_probs(reference_model, prompt, tokens, cfg)

    # the runtime really speculated: drafts were verified on (almost) every request
    assert metrics.num_draft_tokens >= N, (method, setting, metrics)
    if method == "draft_equals_target":
        # drafter == target with equal settings: q == p, so every draft is accepted
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens, metrics
    elif setting == "t1.3":
        # both the accept path and the recovered-token path ran
        assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens, (method, metrics)

    # no emitted token lies outside the target's top-k / top-p set
    p_emitted = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    bad = np.argwhere(p_emitted <= 0)
    assert len(bad) == 0, f"{len(bad)} emitted tokens outside the kept set, e.g. sample/pos {bad[:3].tolist()}"

    p_marg, p_cond = _p_values(probs, tokens)
    assert p_marg > P_MIN, (method, setting, p_marg)
    assert p_cond > P_MIN, (method, setting, p_cond)

