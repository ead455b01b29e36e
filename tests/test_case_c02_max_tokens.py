"""C2: max_tokens inside a block (../shared/cases/correctness.md).

Repetitive prompt so n-gram lookup always hits; k in {1, 3, 5}; max_tokens in 1..k+1.
Checked: len(output) == max_tokens (never more, the prompt never yields an end token);
the tokens equal the non-spec prefix; usage counts equal the emitted tokens;
finish_reason "length". Same with a draft-model drafter, and with a drafter that ignores
the engine's per-row cap and always proposes k true tokens (the engine must cut them),
and with the suffix drafter.

The repetitive prompt is a prefix of the tiny model's own greedy trajectory from
``[14090] * 8``, which settles into a 2-token loop: greedy continues that trajectory
exactly, so every history ends in a token seen before (n-gram lookup always hits) and
the drafts are the true continuation.
"""

from __future__ import annotations

import pytest

from helpers import LOOPING_SEEDS, drafter_spec, greedy, make_session
from spec_drafters import CapIgnoringOracle
from specc.session import Session

K_VALUES = (1, 3, 5)
CASES = [(k, m) for k in K_VALUES for m in range(1, k + 2)]
MAX_MODEL_LEN = 128
PROMPT_LEN = 40
TRAJ_LEN = 64


@pytest.fixture(scope="module")
def base(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def prompts(base) -> dict[tuple[int, ...], list[int]]:
    """Repetitive prompts -> their non-spec greedy continuation (24 tokens)."""
    table = {}
    for seed in LOOPING_SEEDS:  # trajectories that loop (see module docstring)
        traj = seed + base.generate([seed], greedy(TRAJ_LEN - len(seed)), use_speculation=False)[0].token_ids
        prompt, rest = traj[:PROMPT_LEN], traj[PROMPT_LEN:]
        ref = base.generate([prompt], greedy(len(rest)), use_speculation=False)[0].token_ids
        assert ref == rest, "greedy must continue its own trajectory"
        # n-gram lookup always hits: every history's last token occurred before
        full = prompt + rest
        assert all(full[j - 1] in full[: j - 1] for j in range(PROMPT_LEN, len(full)))
        table[tuple(prompt)] = rest
    return table


@pytest.fixture(scope="module")
def sessions(tiny_llama_dir, prompts) -> dict[tuple[str, int], Session]:
    out = {}
    for k in K_VALUES:
        for method in ("ngram", "draft_model", "suffix"):
            out[method, k] = make_session(tiny_llama_dir, drafter_spec(method, k, tiny_llama_dir),
                                          max_model_len=MAX_MODEL_LEN)
        out["cap_ignoring", k] = make_session(tiny_llama_dir, proposer=CapIgnoringOracle(k, prompts),
                                              max_model_len=MAX_MODEL_LEN)
    return out


def check_length_cut(out, ref, prompt, truth, m, k):
    assert len(out.token_ids) == m
    assert out.token_ids == ref.token_ids == truth[:m]
    assert out.text == ref.text
    assert out.finish_reason == ref.finish_reason == "length"
    met = out.metrics
    assert met.num_generation_tokens == m
    assert met.num_prompt_tokens == len(prompt)
    assert sum(met.tokens_per_step) == m
    assert len(met.tokens_per_step) == met.num_steps + 1
    assert all(1 <= t <= k + 1 for t in met.tokens_per_step)
    s = met.spec
    assert s.num_accepted_tokens == m - 1 - met.num_steps  # emitted = accepted + one per step
    assert s.num_accepted_tokens <= s.num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix", "cap_ignoring"])
@pytest.mark.parametrize("k,m", CASES)
def test_max_tokens_inside_block(base, prompts, sessions, method, k, m):
    spec = sessions[method, k]
    for prompt, truth in prompts.items():
        prompt = list(prompt)
        out = spec.generate([prompt], greedy(m))[0]
        ref = base.generate([prompt], greedy(m), use_speculation=False)[0]
        check_length_cut(out, ref, prompt, truth, m, k)
        met = out.metrics
        if method != "suffix":
            # drafts are the true continuation, so every proposed draft is accepted (suffix
            # drafts the most frequent continuation, not the most recent: some are wrong)
            assert met.spec.num_accepted_tokens == met.spec.num_draft_tokens
        if method in ("ngram", "suffix"):
            # lookup always hits: only a last step with room for one token goes undrafted
            # (n-gram drafts may be shorter than k: the match ends near the history's end;
            # suffix drafts too: their length follows the match length)
            assert met.spec.num_drafts >= met.num_steps - 1
            assert met.spec.num_drafts >= (1 if m >= 3 else 0)
        else:
            # one verify step carries the m-2 drafts that fit (none when m <= 2)
            assert met.num_steps == (1 if m >= 2 else 0)
            assert met.spec.num_draft_tokens == max(0, m - 2)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix", "cap_ignoring"])
def test_max_tokens_cuts_later_block_in_batch(base, prompts, sessions, method):
    """k=5, rows of one batch with max_tokens 1, 4, 6, 9 (the last ends inside the second
    verify block): every row stops at exactly its max_tokens."""
    k = 5
    spec = sessions[method, k]
    items = list(prompts.items())
    rows = [(items[i % len(items)], m) for i, m in enumerate((1, 4, 6, 9))]
    params = [greedy(m) for _, m in rows]
    prompt_list = [list(p) for (p, _), _ in rows]
    outs = spec.generate(prompt_list, params)
    refs = base.generate(prompt_list, params, use_speculation=False)
    for ((prompt, truth), m), out, ref in zip(rows, outs, refs):
        check_length_cut(out, ref, list(prompt), truth, m, k)
