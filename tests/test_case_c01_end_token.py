"""C1: end token inside an accepted block (../shared/cases/correctness.md).

Greedy, oracle drafter (everything accepted), k in {1, 2, 5, 8}. Non-spec greedy runs
first; the token it produced at offset p (1..k+1, the bonus slot included) of a verify
block is then declared the end token, either through ``stop_token_ids`` or as the
tokenizer's EOS. Checked: the output stops at the FIRST end token wherever it falls in
the block; it equals non-spec with the same settings; finish_reason "stop"; the stream
never carries text past the end token (the concatenated stream equals the final text);
the request keeps exactly prompt + output tokens.

Blocks are exact because the oracle's drafts are all accepted: output index 0 comes
from the prefill, then step j (0-based) emits indices 1 + j(k+1) .. (j+1)(k+1), so the
token at output index 1 + (p-1) + m(k+1) sits at offset p of the (m+1)-th verify block.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from helpers import drafter_spec, find_block_end, greedy, greedy_truth, make_session, oracle_table, patched
from spec_drafters import OracleDrafter
from specc.session import Session

K_VALUES = (1, 2, 5, 8)
TRUTH_LEN = 64
PROMPTS = [
    "The quick brown fox",
    "Hello world, this is a test",
    "one two three one two three one two three",
    "In a hole in the ground there lived",
    "def fibonacci(n):",
    "Speculative decoding drafts several tokens and verifies them",
    "Lorem ipsum dolor sit amet",
    "1, 2, 3, 4, 5,",
]
CASES = [(k, p) for k in K_VALUES for p in range(1, k + 2)]


@contextmanager
def record_requests(session: Session):
    """Within the block, the speculative engine of ``session`` records the Request objects
    it runs into the yielded list."""
    seen: list = []
    orig = session.engine.run

    def run(requests, on_step=None):
        seen.extend(requests)
        return orig(requests, on_step)

    with patched(session.engine, "run", run):
        yield seen


@pytest.fixture(scope="module")
def truth(base) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, non-spec greedy output) per prompt, ignoring EOS."""
    return greedy_truth(base, PROMPTS, TRUTH_LEN, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle_sessions(tiny_llama_dir, truth) -> dict[int, Session]:
    table = oracle_table(truth)
    return {k: make_session(tiny_llama_dir, proposer=OracleDrafter(k, table)) for k in K_VALUES}


def find_end(truth, eos_ids, k: int, p: int, later_block: bool):
    """A (prompt, output, index) whose output token at ``index`` is its first occurrence and
    sits at offset p of a verify block (the first block, or one of the next five)."""
    return find_block_end(truth, eos_ids, k, p, range(1, 6) if later_block else range(0, 1))


def run_pair(spec: Session, base: Session, prompt, params):
    """Spec run (streamed, requests recorded) and non-spec run of one prompt."""
    chunks: list[str] = []
    with record_requests(spec) as reqs:
        out = spec.generate([prompt], params, on_text=lambda i, t: chunks.append(t))[0]
    ref = base.generate([prompt], params, use_speculation=False)[0]
    return out, ref, chunks, reqs


def check_block_stop(out, ref, chunks, reqs, prompt, truth_out, i, k, p, stop_tok, tokenizer):
    expected = truth_out[: i + 1]
    # stops at the first end token, wherever it falls in the block
    assert out.token_ids == expected
    assert out.token_ids.count(stop_tok) == 1 and out.token_ids[-1] == stop_tok
    # equals non-spec with the same settings
    assert ref.token_ids == expected
    assert out.text == ref.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert out.finish_reason == ref.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # the end really fell at offset p of a fully accepted block
    tps = out.metrics.tokens_per_step
    assert tps[0] == 1 and all(t == k + 1 for t in tps[1:-1]), tps
    assert tps[-1] == p, tps
    assert sum(tps) == len(out.token_ids)
    # nothing after the end token is streamed
    assert "".join(chunks) == out.text
    # the request keeps prompt + output, and K/V for all but its last token
    (req,) = reqs
    assert req.all_token_ids == list(prompt) + expected
    assert req.num_tokens == len(prompt) + len(out.token_ids)
    assert req.num_computed == req.num_tokens - 1


@pytest.mark.parametrize("later_block", [False, True], ids=["first_block", "later_block"])
@pytest.mark.parametrize("k,p", CASES)
def test_stop_token_in_accepted_block(base, truth, oracle_sessions, k, p, later_block):
    spec = oracle_sessions[k]
    prompt, truth_out, i = find_end(truth, spec.eos_token_ids, k, p, later_block)
    stop_tok = truth_out[i]
    params = greedy(TRUTH_LEN, stop_token_ids=[stop_tok])
    out, ref, chunks, reqs = run_pair(spec, base, prompt, params)
    check_block_stop(out, ref, chunks, reqs, prompt, truth_out, i, k, p, stop_tok, spec.tokenizer)


@pytest.mark.parametrize("k,p", CASES)
def test_eos_token_in_accepted_block(base, truth, oracle_sessions, k, p):
    """Same, with the end token declared as the tokenizer's EOS (the eos path of the stop
    checks); with ignore_eos the request runs past it."""
    spec = oracle_sessions[k]
    prompt, truth_out, i = find_end(truth, spec.eos_token_ids, k, p, later_block=False)
    stop_tok = truth_out[i]
    saved = (spec.eos_token_ids, base.eos_token_ids)
    spec.eos_token_ids = base.eos_token_ids = frozenset(saved[0] | {stop_tok})
    try:
        out, ref, chunks, reqs = run_pair(spec, base, prompt, greedy(TRUTH_LEN))
        check_block_stop(out, ref, chunks, reqs, prompt, truth_out, i, k, p, stop_tok, spec.tokenizer)
        past = spec.generate([prompt], greedy(TRUTH_LEN, ignore_eos=True))[0]
        assert past.token_ids == truth_out and past.finish_reason == "length"
    finally:
        spec.eos_token_ids, base.eos_token_ids = saved


def test_batch_rows_stop_at_different_offsets(base, truth, oracle_sessions):
    """k=5, four requests in one batch, each with its own end token at a different offset
    of a different block: every row stops at its own first end token and equals non-spec."""
    k = 5
    spec = oracle_sessions[k]
    picks = [find_end(truth, spec.eos_token_ids, k, p, later) for p, later in
             ((1, True), (3, False), (5, True), (6, False))]
    prompts = [pr for pr, _, _ in picks]
    params = [greedy(TRUTH_LEN, stop_token_ids=[out[i]]) for _, out, i in picks]
    streams: dict[int, list[str]] = {}
    outs = spec.generate(prompts, params, on_text=lambda j, t: streams.setdefault(j, []).append(t))
    refs = base.generate(prompts, params, use_speculation=False)
    for j, ((_, truth_out, i), o, r) in enumerate(zip(picks, outs, refs)):
        assert o.token_ids == r.token_ids == truth_out[: i + 1]
        assert o.text == r.text
        assert o.finish_reason == "stop" and o.stop_reason == truth_out[i]
        assert "".join(streams.get(j, [])) == o.text


@pytest.fixture(scope="module")
def draft_model_sessions(tiny_llama_dir) -> dict[int, Session]:
    return {k: make_session(tiny_llama_dir, drafter_spec("draft_model", k, tiny_llama_dir)) for k in (2, 5)}


@pytest.mark.parametrize("k,p", [(k, p) for k in (2, 5) for p in range(1, k + 2)])
def test_stop_token_with_draft_model(base, truth, draft_model_sessions, k, p):
    """A real drafter (draft model == target, so greedy drafts are all accepted): same
    properties as with the oracle."""
    spec = draft_model_sessions[k]
    prompt, truth_out, i = find_end(truth, spec.eos_token_ids, k, p, later_block=True)
    stop_tok = truth_out[i]
    out, ref, chunks, reqs = run_pair(spec, base, prompt, greedy(TRUTH_LEN, stop_token_ids=[stop_tok]))
    check_block_stop(out, ref, chunks, reqs, prompt, truth_out, i, k, p, stop_tok, spec.tokenizer)


@pytest.mark.parametrize("k", (5, 8))
def test_first_of_several_end_tokens_in_one_block(base, truth, oracle_sessions, k):
    """Two end tokens inside the same accepted block (a repeated token, or two declared
    ids listed latest-first): the output stops at the first one."""
    spec = oracle_sessions[k]
    eos = spec.eos_token_ids
    found_repeat = found_pair = None
    for prompt, out in truth:
        for m in range(0, (len(out) - 2) // (k + 1)):
            block = list(range(1 + m * (k + 1), 1 + (m + 1) * (k + 1)))
            for x, i in enumerate(block):
                if out[i] in out[:i] or out[i] in eos:
                    continue
                later = [j for j in block[x + 1:] if out[j] == out[i]]
                if later and found_repeat is None:
                    found_repeat = (prompt, out, i, [out[i]])
                firsts = [j for j in block[x + 1:] if out[j] not in out[:j] and out[j] not in eos]
                if firsts and found_pair is None:
                    found_pair = (prompt, out, i, [out[firsts[-1]], out[i]])
    assert found_pair is not None, "test data: no block with two first-occurrence tokens"
    for found in (found_repeat, found_pair):
        if found is None:  # no token repeats inside one block in this data
            continue
        prompt, out_true, i, stops = found
        params = greedy(TRUTH_LEN, stop_token_ids=stops)
        out = spec.generate([prompt], params)[0]
        ref = base.generate([prompt], params, use_speculation=False)[0]
        assert out.token_ids == ref.token_ids == out_true[: i + 1]
        assert out.finish_reason == "stop" and out.stop_reason == out_true[i]
        assert out.metrics.tokens_per_step[-1] == (i - 1) % (k + 1) + 1
