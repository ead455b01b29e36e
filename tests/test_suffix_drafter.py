"""Suffix decoding (``method: suffix``): config, the drafter's per-request and global
state, and end-to-end greedy equality on the tiny model, the compiled path and SmolLM2.

The data structure is tested against brute-force counts in ``test_suffix_tree.py``; the
correctness cases C2-C8, C11 and C12 run the suffix drafter too.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import LOOPING_SEEDS, drafter_spec, greedy, make_session
from specc.config import ConfigError, load_config
from specc.runtime.drafters.base import StepBatch
from specc.runtime.drafters.suffix import SuffixDrafter
from specc.runtime.drafters.suffix_tree import SuffixTree
from specc.runtime.request import Request
from specc.sampling_params import SamplingParams
from specc.session import Session

K = 4
NO_GLOBAL = dict(suffix_decoding_max_cached_requests=0)


# ------------------------------------------------------------------------------ config
def test_config_defaults_follow_vllm():
    sc = load_config({"target": "x", "speculative_config": {"method": "suffix"}}).speculative_config
    assert (sc.suffix_decoding_max_tree_depth, sc.suffix_decoding_max_cached_requests,
            sc.suffix_decoding_max_spec_factor, sc.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert sc.prompt_lookup_min is None and sc.model is None
    sc = load_config({"target": "x", "speculative_config": {"method": "ngram"}}).speculative_config
    assert sc.suffix_decoding_max_tree_depth is None and sc.suffix_decoding_min_token_prob is None


@pytest.mark.parametrize("field,value,needle", [
    ("suffix_decoding_max_tree_depth", 0, "must be >= 1"),
    ("suffix_decoding_max_cached_requests", -1, "must be >= 0"),
    ("suffix_decoding_max_spec_factor", 0, "must be > 0"),
    ("suffix_decoding_max_spec_factor", float("inf"), "must be a finite number"),
    ("suffix_decoding_min_token_prob", 1.5, "must be <= 1"),
    ("suffix_decoding_min_token_prob", -0.1, "must be >= 0"),
    ("suffix_decoding_max_tree_depth", True, "must be an integer"),
])
def test_config_errors_name_the_field(field, value, needle):
    with pytest.raises(ConfigError) as e:
        load_config({"target": "x", "speculative_config": {"method": "suffix", field: value}})
    assert f"speculative_config.{field} = " in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize("method,extra", [("ngram", {}), ("draft_model", {"num_draft_layers": 1})])
def test_suffix_fields_refused_for_other_methods(method, extra):
    with pytest.raises(ConfigError, match=r"speculative_config.suffix_decoding_min_token_prob = 0.2: "
                                          r"not allowed with method '\w+' \(only with 'suffix'\)"):
        load_config({"target": "x", "speculative_config": dict(method=method, suffix_decoding_min_token_prob=0.2,
                                                               **extra)})
    with pytest.raises(ConfigError, match="prompt_lookup_max = 3: not allowed with method 'suffix'"):
        load_config({"target": "x", "speculative_config": dict(method="suffix", prompt_lookup_max=3)})


def test_example_config():
    from pathlib import Path

    cfg = load_config(Path(__file__).parent.parent / "examples" / "smollm2-suffix.yaml")
    sc = cfg.speculative_config
    assert sc.method == "suffix" and sc.num_speculative_tokens == 4
    assert sc.suffix_decoding_max_tree_depth == 24 and sc.suffix_decoding_max_cached_requests == 10000
    assert load_config(cfg.to_dict()) == cfg


def test_drafter_validates_arguments():
    for kw in (dict(num_speculative_tokens=0), dict(max_cached_requests=-1), dict(max_spec_factor=0.0),
               dict(min_token_prob=2.0), dict(max_tree_depth=0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SuffixDrafter(**{"num_speculative_tokens": K, **kw})


# ------------------------------------------------------------------------------ drafter state
def _request(rid: int, prompt: list[int], output: list[int] | None = None) -> Request:
    return Request(rid, "", list(prompt), SamplingParams(max_tokens=1000), torch.Generator(), frozenset(), 4096,
                   output_token_ids=list(output or []))


def _batch(reqs: list[Request]) -> StepBatch:
    n = len(reqs)
    return StepBatch(reqs, torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n),
                     torch.ones(n, dtype=torch.bool))


def test_per_request_state_follows_prefill_steps_slot_moves_and_finish():
    d = SuffixDrafter(K, max_tree_depth=8)
    a, b = _request(0, [1, 2, 3, 4, 1, 2], [3]), _request(1, [9, 8, 7, 9, 8], [7])
    d.prefill(a, 0)
    d.prefill(b, 1)
    assert d.history(0) == [1, 2, 3, 4, 1, 2, 3] and d.history(1) == [9, 8, 7, 9, 8, 7]
    prop = d.propose(_batch([a, b]), [K, K], torch.zeros(2, K))
    assert prop.draft_probs is None  # deterministic: q one-hot
    assert prop.draft_token_ids[0, :3].tolist() == [4, 1, 2] and prop.draft_token_ids[1, :2].tolist() == [9, 8]
    # a step emits tokens; the trees follow
    a.output_token_ids += [4, 1]
    b.output_token_ids += [5]
    d.on_verified(_batch([a, b]), [1, 0])
    assert d.history(0) == a.all_token_ids and d.history(1) == b.all_token_ids
    # a finishes: its output joins the global tree; b moves into slot 0 and keeps its tree
    d.finish(a)
    d.move_slot(1, 0)
    assert d.num_live == 1 and d.history(1) == b.all_token_ids
    assert d.global_tree.sequence(0) == a.output_token_ids
    with pytest.raises(KeyError):
        d.history(0)
    b.output_token_ids += [6, 7]
    prop = d.propose(_batch([b]), [2], torch.zeros(1, K))  # synced before drafting
    assert d.history(1) == b.all_token_ids and int(prop.num_draft_tokens[0]) <= 2
    d.finish(b)
    assert d.num_live == 0 and len(d.global_tree) == 2


def test_caps_and_adaptive_length():
    d = SuffixDrafter(K, max_tree_depth=24)
    r = _request(0, list(range(20)) + list(range(6)))  # 0..5 recurs: a 6-token match
    d.prefill(r, 0)
    for cap, want in ((0, 0), (1, 1), (3, 3), (K, K)):
        prop = d.propose(_batch([r]), [cap], torch.zeros(1, K))
        assert int(prop.num_draft_tokens[0]) == want
    assert d.candidate(r).token_ids == [6, 7, 8, 9]
    half = SuffixDrafter(16, max_spec_factor=0.5)
    half.prefill(r, 0)
    assert half.candidate(r).token_ids == [6, 7, 8]  # ceil(0.5 * 6) tokens
    r2 = _request(1, [5, 6, 7, 1, 2, 3, 4, 9, 4])  # only [4] recurs (1-token match): 1 token
    d.prefill(r2, 1)
    assert d.candidate(r2).token_ids == [9] and d.candidate(r2).match_len == 1


def test_better_scoring_tree_wins():
    d = SuffixDrafter(K, max_tree_depth=16)
    for rid in range(3):  # the same answer three times in the global tree
        d.finish(_request(rid, [0], [10, 11, 12, 13, 14, 15]))
    r = _request(7, [1, 2, 10, 11, 12, 99, 10, 11])  # own tree: 10 11 -> 12 99 (prob 1/2 each)
    d.prefill(r, 0)
    own = d._live[7].tree.speculate_sequence(0, K, 1.0, 0.1)
    glob = d.global_tree.speculate(r.all_token_ids, K, 1.0, 0.1)
    assert glob.score > own.score
    assert d.candidate(r).token_ids == [12, 13] == glob.token_ids  # 2-token match: 2 tokens
    # no global tree: the request's own candidate
    solo = SuffixDrafter(K, max_tree_depth=16, max_cached_requests=0)
    for rid in range(3):
        solo.finish(_request(rid, [0], [10, 11, 12, 13, 14, 15]))
    assert len(solo.global_tree) == 0
    solo.prefill(r, 0)
    assert solo.candidate(r).token_ids == own.token_ids == [12, 99]


def test_global_tree_evicts_oldest_and_stays_bounded():
    rng = random.Random(0)
    cap, depth = 3, 6
    d = SuffixDrafter(K, max_tree_depth=depth, max_cached_requests=cap)
    outputs, sizes = [], []
    for rid in range(12):
        out = [rng.randrange(8) for _ in range(rng.randrange(5, 40))]
        outputs.append(out)
        d.finish(_request(rid, [0], out))
        sizes.append(len(d.global_tree._count))
        fresh = SuffixTree(depth)
        for i, o in enumerate(outputs[-cap:]):
            fresh.extend(i, o)
        assert len(d.global_tree) == min(rid + 1, cap)
        assert d.global_tree.counts() == fresh.counts()
        assert d.global_tree.num_nodes <= 1 + depth * sum(map(len, outputs[-cap:]))
    # freed nodes are reused: storage stops growing once the cache is full
    assert max(sizes) <= 1 + depth * 3 * 40


def test_new_request_object_under_a_known_id_replaces_the_state():
    d = SuffixDrafter(K)
    d.prefill(_request(5, [1, 2, 3]), 0)
    other = _request(5, [7, 8])
    assert d.candidate(other).token_ids == [] and d.history(5) == [7, 8]


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def suffix_session(tiny_llama_dir) -> Session:
    return make_session(tiny_llama_dir, drafter_spec("suffix", K))


def _looping_prompt(base) -> list[int]:
    seed = LOOPING_SEEDS[0]
    return seed + base.generate([seed], greedy(24), use_speculation=False)[0].token_ids


def test_greedy_equals_non_spec_batch(base, suffix_session):
    tok = base.tokenizer
    prompts = [
        _looping_prompt(base),  # the tiny model's own looping trajectory: suffix drafts accepted
        tok.encode("The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown"),
        tok.encode("Once upon a time"),
        tok.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"),
        tok.encode("one two three one two three one"),
    ]
    params = [greedy(m) for m in (32, 20, 9, 24, 1)]
    outs = suffix_session.generate(prompts, params)
    refs = base.generate(prompts, params, use_speculation=False)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.finish_reason == ref.finish_reason
        assert sum(out.metrics.tokens_per_step) == len(out.token_ids)
    s = outs[0].metrics.spec
    assert s.num_accepted_tokens > 0 and s.mean_acceptance_length > 2
    # the engine told the drafter about every finished request: no tree left behind, and
    # every output joined the global tree
    d = suffix_session.proposer
    assert d.num_live == 0 and len(d.global_tree) >= len(prompts)


def test_global_tree_drafts_a_repeated_request(base, tiny_llama_dir):
    """An answer seen before is drafted from the global tree: the second run of the same
    (non-repetitive) prompt accepts far more than the first, with the same output."""
    s = make_session(tiny_llama_dir, drafter_spec("suffix", K))
    prompt = base.tokenizer.encode("Write a short story about a robot who learns to paint.")
    ref = base.generate([prompt], greedy(32), use_speculation=False)[0]
    first, second = (s.generate([prompt], greedy(32))[0] for _ in range(2))
    assert first.token_ids == second.token_ids == ref.token_ids
    assert second.metrics.spec.num_accepted_tokens > first.metrics.spec.num_accepted_tokens
    assert second.metrics.spec.mean_acceptance_length > 3
    # with the global tree off, the second run drafts exactly as the first
    s0 = make_session(tiny_llama_dir, drafter_spec("suffix", K, **NO_GLOBAL))
    a, b = (s0.generate([prompt], greedy(32))[0] for _ in range(2))
    assert a.token_ids == ref.token_ids and a.metrics.spec == b.metrics.spec


def test_sampled_requests_run(suffix_session):
    """Sampled requests go through rejection sampling with q one-hot (draft_probs None)."""
    prompt = LOOPING_SEEDS[1]
    outs = suffix_session.generate([prompt] * 3, SamplingParams(temperature=0.8, max_tokens=16))
    assert all(len(o.token_ids) == 16 for o in outs)


# ------------------------------------------------------------------------------ compiled path
def test_suffix_compiles_to_the_ngram_programs(tiny_llama_dir):
    """``method: suffix`` is allowed on the compiled path and plans the same programs as
    ngram (the drafts are spec_step inputs); the method stays a program field, so each
    config gets its own artifact. (``test_compiled.py`` runs the suffix drafter on
    compiled programs.)"""
    from specc.artifact import program_config_diff
    from specc.compiler import check_compilable, plan_programs

    base_cfg = dict(target=str(tiny_llama_dir), max_model_len=128, batch_buckets=[1, 2])
    suffix = load_config(dict(base_cfg, speculative_config=drafter_spec("suffix", K)))
    ngram = load_config(dict(base_cfg, speculative_config=drafter_spec("ngram", K)))
    check_compilable(suffix)
    assert plan_programs(suffix) == plan_programs(ngram)
    diff = program_config_diff(ngram.to_dict(), suffix.to_dict())
    assert len(diff) == 1 and diff[0].startswith("speculative_config:") and "'suffix'" in diff[0]
    tuned = dict(base_cfg, speculative_config=drafter_spec("suffix", K, suffix_decoding_max_tree_depth=8))
    assert program_config_diff(suffix.to_dict(), load_config(tuned).to_dict()) == []  # run-time settings


# ------------------------------------------------------------------------------ real model
@pytest.mark.real_model
def test_real_model_greedy_equals_non_spec(smollm2_dir):
    from test_real_model_spec import MAX_NEW, PROMPTS, compare_with_gap_rule

    s = make_session(smollm2_dir, drafter_spec("suffix", K), max_model_len=512)
    refs = s.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2),
                      use_speculation=False)
    outs = s.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for out, ref in zip(outs, refs):
        compared, diverged = compare_with_gap_rule(out.token_ids, ref)
        assert compared > 0
        if diverged is None:
            assert out.text == ref.text and out.finish_reason == ref.finish_reason
    assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0
