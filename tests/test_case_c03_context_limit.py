"""C3: context limit (../shared/cases/correctness.md).

max_model_len 64, repetitive prompts of 58..63 tokens, k=5, max_tokens 100, alone and
three batched. Checked: prompt + output <= max_model_len (here == 64: nothing else ends
these requests); finish_reason "length"; no crash; equals non-spec; and no forward of
the target or of a drafter puts a real token at or past the limit: every position fed
is either < max_model_len or the cache's trash position (padding), every ``kv_len`` is
<= max_model_len (so no real query or K/V write reached position 64), and each verify
row is a contiguous run of real positions followed only by padding.

Prompts are prefixes of the tiny model's own greedy trajectory from a looping seed, so
greedy continues them exactly and n-gram lookup hits up to the limit. EAGLE / EAGLE-3
(random heads) also check the head's forwards: its draft steps run past the last
verified position and must switch to the trash position at the limit.
"""

from __future__ import annotations

import pytest
import torch

from helpers import LOOPING_SEEDS, drafter_spec, greedy, make_session
from spec_drafters import CapIgnoringOracle
from specc.session import Session

L = 64  # max_model_len
K = 5
MAX_TOKENS = 100  # more than fits: the context limit ends every request
LENGTHS = list(range(58, 64))
METHODS = ["ngram", "draft_model", "early_exit", "suffix", "cap_ignoring", "eagle", "eagle3"]


class ForwardLog:
    """Forward pre-hook recording ``(positions, kv_len, num_layers)`` of every call;
    ``pos_arg``: the index of ``positions`` among the positional arguments (1 for a
    causal LM, 2 for an EAGLE head: ``(input_ids, features, positions, ...)``)."""

    def __init__(self, pos_arg: int = 1):
        self.pos_arg = pos_arg
        self.calls: list[tuple[torch.Tensor, int | None, int | None]] = []

    def __call__(self, module, args, kwargs):
        positions = args[self.pos_arg] if len(args) > self.pos_arg else kwargs["positions"]
        self.calls.append((positions.clone(), kwargs.get("kv_len"), kwargs.get("num_layers")))


@pytest.fixture(scope="module")
def base(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, max_model_len=L)


@pytest.fixture(scope="module")
def trajectories(base) -> list[list[int]]:
    """Greedy trajectories of exactly L tokens (seed + continuation up to the limit)."""
    out = []
    for seed in LOOPING_SEEDS:
        o = base.generate([seed], greedy(MAX_TOKENS), use_speculation=False)[0]
        traj = seed + o.token_ids
        assert len(traj) == L and o.finish_reason == "length"
        out.append(traj)
    return out


@pytest.fixture(scope="module")
def truth(trajectories) -> dict[tuple[int, ...], list[int]]:
    return {tuple(t[:n]): t[n:] for t in trajectories for n in LENGTHS}


@pytest.fixture(scope="module")
def sessions(tiny_llama_dir, truth, tiny_eagle_heads) -> dict[str, tuple[Session, list[ForwardLog]]]:
    out = {}
    for name in METHODS:
        if name == "cap_ignoring":
            s = make_session(tiny_llama_dir, proposer=CapIgnoringOracle(K, truth), max_model_len=L)
        else:
            model_dir = tiny_eagle_heads.get(name, tiny_llama_dir)
            s = make_session(tiny_llama_dir, drafter_spec(name, K, model_dir), max_model_len=L)
        models = [(s.target.model, 1)]
        drafter = getattr(s.proposer, "model", None)
        if drafter is not None and drafter is not s.target.model:
            models.append((drafter, 1))
        if getattr(s.proposer, "head", None) is not None:  # EAGLE: the head's own forwards
            models.append((s.proposer.head, 2))
        logs = []
        for mdl, pos_arg in models:
            log = ForwardLog(pos_arg)
            mdl.register_forward_pre_hook(log, with_kwargs=True)
            logs.append(log)
        out[name] = (s, logs)
    return out


def check_forwards(logs: list[ForwardLog]) -> None:
    assert logs[0].calls, "the target never ran"
    for log in logs:
        for pos, kv_len, _ in log.calls:
            assert bool(((pos < L) | (pos == L)).all()), f"position past the trash slot: {pos}"
            assert kv_len is not None and kv_len <= L, f"kv_len {kv_len} reaches the limit"
            for row in pos.tolist():
                real = [p for p in row if p != L]
                # real positions first and contiguous, then only padding
                assert row[: len(real)] == real
                if real:
                    assert real == list(range(real[0], real[0] + len(real)))
                    assert real[-1] < L
        log.calls.clear()


def check_limit(out, ref, prompt, truth_out):
    assert len(prompt) + len(out.token_ids) <= L
    assert out.token_ids == ref.token_ids == truth_out  # fills the context exactly
    assert len(prompt) + len(out.token_ids) == L
    assert out.text == ref.text
    assert out.finish_reason == ref.finish_reason == "length"
    assert out.metrics.num_generation_tokens == len(out.token_ids)
    assert sum(out.metrics.tokens_per_step) == len(out.token_ids)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", LENGTHS)
def test_context_limit_single(base, trajectories, sessions, method, n):
    spec, logs = sessions[method]
    for logs_ in logs:
        logs_.calls.clear()
    for traj in trajectories:
        prompt = traj[:n]
        out = spec.generate([prompt], greedy(MAX_TOKENS))[0]
        ref = base.generate([prompt], greedy(MAX_TOKENS), use_speculation=False)[0]
        check_limit(out, ref, prompt, traj[n:])
        if method in ("ngram", "cap_ignoring", "draft_model", "suffix") and n <= L - 3:
            # room for at least one draft after the prefill token: it was verified
            assert out.metrics.spec.num_draft_tokens >= 1
    check_forwards(logs)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("lengths", [(58, 60, 63), (59, 61, 62), (63, 58, 61)])
def test_context_limit_batched(base, trajectories, sessions, method, lengths):
    spec, logs = sessions[method]
    for logs_ in logs:
        logs_.calls.clear()
    rows = [(trajectories[i % 2], n) for i, n in enumerate(lengths)]
    prompts = [t[:n] for t, n in rows]
    outs = spec.generate(prompts, greedy(MAX_TOKENS))
    refs = base.generate(prompts, greedy(MAX_TOKENS), use_speculation=False)
    for (traj, n), prompt, out, ref in zip(rows, prompts, outs, refs):
        check_limit(out, ref, prompt, traj[n:])
    check_forwards(logs)
