"""`Session.generate` on tiny random-weight models: prompt forms, per-request params and
errors, batch == solo, stop strings and streaming, sampling seeds, outputs and metrics,
config errors."""

from __future__ import annotations

import json
import math

import pytest

from specc import SamplingParams, Session
from specc.config import ConfigError

from spec_drafters import OracleDrafter

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
LONG = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _cfg(folder, **kw) -> dict:
    cfg = {"target": str(folder), "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
           "batch_buckets": [1, 2, 4], "sampling": {"max_tokens": 5}, "enforce_eager": True}
    cfg.update(kw)
    return cfg


@pytest.fixture(scope="module")
def llama(tiny_llama_dir) -> Session:
    return Session(_cfg(tiny_llama_dir), verbose=False)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir) -> Session:
    return Session(_cfg(tiny_qwen2_dir), verbose=False)


def _template_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _solo(session, prompt, params=GREEDY, **kw):
    (out,) = session.generate([prompt], params, **kw)
    assert out.finish_reason != "error", out.error
    return out


# -- prompt forms -------------------------------------------------------------------------
def test_string_prompt_is_plain_encoding(llama):
    (out,) = llama.generate("The capital of France is", GREEDY)
    assert out.prompt_token_ids == llama.tokenizer.encode("The capital of France is")
    assert out.prompt == "The capital of France is"
    assert out.finish_reason in ("length", "stop") and out.token_ids


def test_conversation_gets_chat_template(llama):
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}]
    (out,) = llama.generate(conv, GREEDY)
    assert out.prompt_token_ids == _template_ids(llama.tokenizer, conv)
    # and the template really was applied (the plain text encoding is shorter)
    assert len(out.prompt_token_ids) > len(llama.tokenizer.encode("You are terse. Hi there!"))


def test_chat_true_on_strings_equals_a_user_turn(llama):
    text = "Write a haiku about caches."
    (out,) = llama.generate(text, GREEDY, chat=True)
    conv = [{"role": "user", "content": text}]
    assert out.prompt_token_ids == _template_ids(llama.tokenizer, conv)
    assert out.token_ids == _solo(llama, conv).token_ids
    # chat=True leaves token-id prompts alone
    (ids_out,) = llama.generate([[5, 6, 7]], GREEDY, chat=True)
    assert ids_out.prompt_token_ids == [5, 6, 7]


def test_token_id_prompt(llama):
    ids = llama.tokenizer.encode("Once upon a time")
    (out,) = llama.generate(ids, GREEDY)  # one tokenized prompt, not len(ids) prompts
    assert out.prompt_token_ids == ids
    assert out.token_ids == _solo(llama, "Once upon a time").token_ids


def test_mixed_list_equals_solo(llama):
    conv = [{"role": "user", "content": "Hello!"}]
    prompts = ["A string prompt", conv, [100, 200, 300, 400], [{"role": "user", "content": "Bye"}]]
    outs = llama.generate(prompts, GREEDY)
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs):
        solo = _solo(llama, p)
        assert o.prompt_token_ids == solo.prompt_token_ids
        assert o.token_ids == solo.token_ids and o.text == solo.text
    assert outs[1].prompt_token_ids == _template_ids(llama.tokenizer, conv)
    assert outs[2].prompt_token_ids == [100, 200, 300, 400]


def test_empty_batch_and_bad_prompt_types(llama):
    assert llama.generate([], GREEDY) == []
    with pytest.raises(TypeError, match="prompts must be"):
        llama.generate(5, GREEDY)
    good, bad = llama.generate(["fine", 5], GREEDY)
    assert good.finish_reason in ("length", "stop")
    assert bad.finish_reason == "error" and "got int" in bad.error


# -- sampling params per call / per prompt ------------------------------------------------
def test_one_params_for_all_vs_one_per_prompt(llama):
    prompts = ["alpha beta", "gamma", [7, 8, 9]]
    shared = llama.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in shared] == [6, 6, 6]
    per = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 9, 4)]
    outs = llama.generate(prompts, per)
    assert [len(o.token_ids) for o in outs] == [2, 9, 4]
    assert all(o.finish_reason == "length" for o in outs)
    for s, o in zip(shared, outs):  # greedy: a shorter run is a prefix of a longer one
        n = min(len(s.token_ids), len(o.token_ids))
        assert s.token_ids[:n] == o.token_ids[:n]


def test_params_none_uses_config_defaults(llama):
    (out,) = llama.generate([[11, 12, 13]])  # config: sampling.max_tokens 5, greedy
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    assert out.token_ids == _solo(llama, [11, 12, 13], SamplingParams(temperature=0, max_tokens=5)).token_ids


def test_wrong_number_of_params_is_a_clear_error(llama):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        llama.generate(["a", "b", "c"], [GREEDY, GREEDY])


# -- per-request errors -------------------------------------------------------------------
BAD_REQUESTS = {
    "empty string": ("", GREEDY, "prompt is empty"),
    "empty ids": ([], GREEDY, "prompt is empty"),
    "too long": (list(range(1, MAX_MODEL_LEN + 1)), GREEDY, f"max_model_len is {MAX_MODEL_LEN}"),
    "temperature -1": ("hi", SamplingParams(temperature=-1), "temperature = -1"),
    "temperature nan": ("hi", SamplingParams(temperature=math.nan), "temperature = nan"),
    "top_p 0": ("hi", SamplingParams(top_p=0), "top_p = 0"),
    "top_p 1.5": ("hi", SamplingParams(top_p=1.5), "top_p = 1.5"),
    "top_k -2": ("hi", SamplingParams(top_k=-2), "top_k = -2"),
    "max_tokens 0": ("hi", SamplingParams(max_tokens=0), "max_tokens = 0"),
    "logprobs 21": ("hi", SamplingParams(logprobs=21), "logprobs = 21"),
    "empty stop": ("hi", SamplingParams(stop=[""]), "stop = ['']"),
    "token id >= vocab": ([5, 10**6, 7], GREEDY, "token id 1000000 is out of range"),
    "negative token id": ([-1, 5], GREEDY, "token id -1 is out of range"),
    "bad message": ([{"role": "user"}], GREEDY, "chat template failed"),
    "mixed ids": ([1, "a"], GREEDY, "a prompt must be"),
}


@pytest.fixture(scope="module")
def good_solo(llama):
    return [_solo(llama, "The first good request"), _solo(llama, [42] * 17)]


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_fails_alone(llama, good_solo, case):
    prompt, params, msg = BAD_REQUESTS[case]
    outs = llama.generate(["The first good request", prompt, [42] * 17], [GREEDY, params, GREEDY])
    bad = outs[1]
    assert bad.finish_reason == "error"
    assert msg in bad.error
    assert bad.token_ids == [] and bad.text == ""
    for o, solo in zip((outs[0], outs[2]), good_solo):
        assert o.finish_reason in ("length", "stop") and o.error is None
        assert o.token_ids == solo.token_ids and o.text == solo.text


def test_prompt_one_below_max_model_len_runs(llama):
    (out,) = llama.generate([list(range(1, MAX_MODEL_LEN))], SamplingParams(temperature=0, max_tokens=10))
    assert out.finish_reason == "length" and len(out.token_ids) == 1


def test_max_model_len_caps_generation(llama):
    ids = list(range(1, MAX_MODEL_LEN - 3))
    (out,) = llama.generate([ids], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(ids) + len(out.token_ids) == MAX_MODEL_LEN


# -- batch == solo --------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_batch_rows_equal_solo_runs(request, model):
    session: Session = request.getfixturevalue(model)
    prompts = [
        [17],  # one-token prompt
        "A medium length prompt about the weather in Paris in spring",
        [{"role": "user", "content": "Tell me a story about a robot."}],
        list(range(300, 360)),  # 60 tokens
        "short",
        list(range(1000, 1013)),
    ]
    # different lengths finish at different steps: slots move; 6 > max_num_seqs=4: admission waits
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 3, 20, 7, 1, 15)]
    batch = session.generate(prompts, params)
    for p, sp, o in zip(prompts, params, batch):
        solo = _solo(session, p, sp)
        assert o.token_ids == solo.token_ids, p
        assert o.text == solo.text
        assert len(o.token_ids) == sp.max_tokens and o.finish_reason == "length"


def test_batch_logprobs_match_solo(llama):
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompts = ["one two three", [9, 99, 999, 9999]]
    batch = llama.generate(prompts, sp)
    for p, o in zip(prompts, batch):
        solo = _solo(llama, p, sp)
        assert len(o.logprobs) == len(o.token_ids)
        for a, b in zip(o.logprobs, solo.logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.top[0][0] == a.token_id  # greedy: the chosen token is the most likely


# -- stop strings and streaming -------------------------------------------------------------
STOP_PROMPT = "Once upon a time, in a land far away"


@pytest.fixture(scope="module")
def stop_case(llama):
    """(full greedy output, a stop string that occurs in its middle).

    The stop string is the text of two consecutive output tokens, so its first part
    arrives one step before it completes: a stream must hold that part back."""
    full = _solo(llama, STOP_PROMPT, LONG)
    text, ids, dec = full.text, full.token_ids, llama._detokenize
    for i in range(8, len(ids) - 8):
        before = dec(ids[:i])
        stop = dec(ids[: i + 2])[len(before):]
        if text.startswith(before) and "\ufffd" not in stop and len(dec(ids[i:i + 1])) >= 1 \
                and text.find(stop) == len(before):
            return full, stop
    pytest.fail("no usable stop string in the greedy output")


def test_stop_string_cuts_text(llama, stop_case):
    full, stop = stop_case
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    (out,) = llama.generate(STOP_PROMPT, sp)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_earliest_stop_string_wins_and_others_unaffected(llama, stop_case):
    full, stop = stop_case
    later = full.text[-4:]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[later, stop])
    other = "An unrelated prompt"
    outs = llama.generate([STOP_PROMPT, other], [sp, LONG])
    assert outs[0].stop_reason == stop and outs[0].text == full.text[: full.text.find(stop)]
    assert outs[1].token_ids == _solo(llama, other, LONG).token_ids
    assert outs[1].finish_reason == "length"


def test_output_cut_inside_a_character_drops_it(llama):
    """max_tokens ending inside a multi-byte character (an emoji is several byte-level
    tokens) must not leave U+FFFD in the text or the stream."""
    import torch

    from specc.runtime.request import Request

    ids = llama.tokenizer.encode("\U0001F30D", add_special_tokens=False)  # the globe emoji
    assert len(ids) > 1 and llama._detokenize(ids[:1]).endswith("\ufffd")

    def request(max_tokens):
        return Request(request_id=0, prompt="p", prompt_token_ids=[1], params=SamplingParams(max_tokens=max_tokens),
                       generator=torch.Generator(), eos_token_ids=frozenset(), max_model_len=64)

    cut = request(1)
    cut.append_tokens(ids[:1], llama._detokenize)
    assert cut.finish_reason == "length" and cut.text == "" and cut.stream_delta() == ""
    whole = request(len(ids) + 1)
    whole.append_tokens(ids[:1], llama._detokenize)
    assert not whole.finished and whole.stream_delta() == ""  # held back while incomplete
    whole.append_tokens(ids[1:], llama._detokenize)
    assert whole.stream_delta() == whole.text == "\U0001F30D"


def test_stop_token_id(llama, stop_case):
    full, _ = stop_case
    tok = full.token_ids[5]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[tok])
    (out,) = llama.generate(STOP_PROMPT, sp)
    first = full.token_ids.index(tok)
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == full.token_ids[: first + 1]


def _stream(session, prompts, params):
    chunks: dict[int, list[str]] = {}
    outs = session.generate(prompts, params, on_text=lambda i, t: chunks.setdefault(i, []).append(t))
    return outs, chunks


def test_streaming_never_shows_text_past_stop(llama, stop_case):
    full, stop = stop_case
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    outs, chunks = _stream(llama, [STOP_PROMPT, "Another one"], [sp, LONG])
    # the stream is append-only: equal to the final text means nothing past the stop was shown
    assert "".join(chunks[0]) == outs[0].text == full.text[: full.text.find(stop)]
    assert "".join(chunks[1]) == outs[1].text
    assert all(chunks[0]) and len(chunks[1]) > 1  # incremental, no empty callbacks


def test_streaming_with_multi_token_steps(tiny_llama_dir, llama, stop_case):
    """An oracle drafter makes every step emit k+1 tokens, so the stop string lands in
    the middle of a step: the stream and the text must still stop before it."""
    full, stop = stop_case
    truth = {tuple(full.prompt_token_ids): full.token_ids}
    spec = Session(_cfg(tiny_llama_dir), proposer=OracleDrafter(4, truth), verbose=False)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    outs, chunks = _stream(spec, [STOP_PROMPT], sp)
    assert outs[0].text == full.text[: full.text.find(stop)]
    assert "".join(chunks[0]) == outs[0].text
    assert max(outs[0].metrics.tokens_per_step[1:]) > 1
    # no stop: the speculative run equals the plain one, and is streamed whole
    outs, chunks = _stream(spec, [STOP_PROMPT], LONG)
    assert outs[0].token_ids == full.token_ids and "".join(chunks[0]) == full.text
    assert spec.metrics.num_accepted_tokens > 0 and spec.metrics.mean_acceptance_length > 1


# -- sampling ---------------------------------------------------------------------------------
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama):
    (a,) = llama.generate("Sample me", SAMPLED)
    (b,) = llama.generate("Sample me", SAMPLED)
    assert a.token_ids == b.token_ids
    batch = llama.generate(["other", "Sample me", [3, 4, 5]], [GREEDY, SAMPLED, LONG])
    assert batch[1].token_ids == a.token_ids
    greedy = _solo(llama, "Sample me", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert a.token_ids != greedy.token_ids  # the sampling path was taken
    other_seed = SamplingParams(**{**SAMPLED.to_dict(), "seed": 99})
    assert llama.generate("Sample me", other_seed)[0].token_ids != a.token_ids


def test_unseeded_requests_follow_the_session_seed(tiny_llama_dir):
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    s1 = Session(_cfg(tiny_llama_dir, seed=5), verbose=False)
    s2 = Session(_cfg(tiny_llama_dir, seed=5), verbose=False)
    first = [o.token_ids for o in s1.generate(["x", "x"], sp)]
    assert first == [o.token_ids for o in s2.generate(["x", "x"], sp)]
    assert first[0] != first[1]  # each request draws its own seed


def test_seeds_of_any_size_wrap_like_torch(tiny_llama_dir, llama):
    """torch seeds are 64-bit: seeds past 2**64 or below -2**63 (a request's or the session
    stream's) used to fail with torch's "Overflow when unpacking long long"."""
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    big, wrapped = llama.generate(["x", "x"], [SamplingParams(seed=2**70 + 5, **sp), SamplingParams(seed=5, **sp)])
    assert big.error is None and big.token_ids == wrapped.token_ids  # 2**70 + 5 = 5 mod 2**64
    neg, pos = llama.generate(["x", "x"], [SamplingParams(seed=-1, **sp), SamplingParams(seed=2**64 - 1, **sp)])
    assert neg.error is None and neg.token_ids == pos.token_ids  # torch wraps negatives mod 2**64
    huge = Session(_cfg(tiny_llama_dir, seed=2**62), verbose=False)  # session seed stream past 2**64
    (out,) = huge.generate("x", SamplingParams(**sp))
    assert out.error is None and len(out.token_ids) == 6


def test_top_k_and_top_p_restrict_the_choice(llama):
    sp = SamplingParams(temperature=1.5, top_k=3, max_tokens=20, seed=3, logprobs=5, ignore_eos=True)
    (out,) = llama.generate("Restrict me", sp)
    for lp in out.logprobs:
        assert lp.token_id in [t for t, _ in lp.top[:3]]
        assert all(v == -math.inf for _, v in lp.top[3:])  # masked by top-k
    # top_p tiny: only the most likely token survives = greedy
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, seed=3, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llama.generate("Restrict me", nucleus)[0].token_ids == _solo(llama, "Restrict me", greedy).token_ids
    top1 = SamplingParams(temperature=2.0, top_k=1, max_tokens=12, seed=8, ignore_eos=True)
    assert llama.generate("Restrict me", top1)[0].token_ids == _solo(llama, "Restrict me", greedy).token_ids


# -- outputs and metrics ----------------------------------------------------------------------
def test_to_dict_is_json_serialisable(llama):
    sp = SamplingParams(temperature=0.7, max_tokens=5, logprobs=2, seed=1, stop=["zzzz"])
    outs = llama.generate(["json please", ""], [sp, sp])
    for o in outs:
        d = json.loads(json.dumps(o.to_dict()))
        assert set(d) >= {"request_id", "text", "token_ids", "finish_reason", "stop_reason",
                          "error", "logprobs", "metrics"}
        assert d["token_ids"] == o.token_ids and d["finish_reason"] == o.finish_reason
    d = outs[0].to_dict()
    assert len(d["logprobs"]) == len(outs[0].token_ids) and len(d["logprobs"][0]["top"]) == 2
    assert d["metrics"]["spec"]["mean_acceptance_length"] == 1.0
    assert outs[1].to_dict()["error"] and outs[1].to_dict()["finish_reason"] == "error"


def test_metrics(llama):
    prompts = ["metrics one", [1, 2, 3, 4, 5, 6], "three"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 1, 5)]
    for o, prompt in zip(llama.generate(prompts, params), prompts):
        m = o.metrics
        assert m.time_to_first_token > 0
        assert m.total_time >= m.time_to_first_token
        assert m.tokens_per_second > 0
        assert m.num_generation_tokens == len(o.token_ids)
        assert m.num_prompt_tokens == len(o.prompt_token_ids) > 0
        assert sum(m.tokens_per_step) == len(o.token_ids)
        assert m.num_steps == len(o.token_ids) - 1  # non-speculative: one token per step
        assert m.spec.num_drafts == 0


# -- config errors ------------------------------------------------------------------------------
def test_config_errors_raise_config_error(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown field 'max_num_seq'"):
        Session(_cfg(tiny_llama_dir, max_num_seq=3), verbose=False)
    with pytest.raises(ConfigError, match="does not exist"):
        Session(_cfg(tmp_path / "no_such_model"), verbose=False)
    with pytest.raises(ConfigError, match="neither an existing path nor|embedded model"):
        Session(_cfg("not-a-model-name"), verbose=False)
    with pytest.raises(ConfigError, match="num_draft_layers = 2: must be between 1 and 1"):
        Session(_cfg(tiny_llama_dir, speculative_config={"method": "draft_model", "num_draft_layers": 2}),
                verbose=False)
    with pytest.raises(ConfigError, match=r"speculative_config\.model"):
        Session(_cfg(tiny_llama_dir, speculative_config={"method": "draft_model", "model": str(tmp_path / "x")}),
                verbose=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"target: {tiny_llama_dir}\nmax_model_len: 8\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: max_model_len = 8: must be >= 16"):
        Session(str(bad), verbose=False)
    with pytest.raises(ConfigError, match="config file not found"):
        Session(str(tmp_path / "missing.yaml"), verbose=False)


def test_kv_cache_that_cannot_be_allocated_is_a_config_error(tiny_llama_dir, monkeypatch):
    from specc.models import kv_cache

    def no_memory(*args, **kwargs):  # what torch's CPU allocator raises
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(kv_cache.KVCache, "__init__", no_memory)
    with pytest.raises(ConfigError, match=r"max_model_len = 128, max_num_seqs = 4: the KV cache .* GiB.*"
                                          r"lower max_model_len or max_num_seqs"):
        Session(_cfg(tiny_llama_dir), verbose=False)


def test_max_model_len_beyond_the_models_positions_is_a_config_error(tiny_llama_dir):
    # the tiny models are built with max_position_embeddings = 2048
    with pytest.raises(ConfigError, match=r"max_model_len = 4096 exceeds the target's max_position_embeddings = 2048"):
        Session(dict(_cfg(tiny_llama_dir), max_model_len=4096), verbose=False)


def test_unavailable_device_is_a_config_error(tiny_llama_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    with pytest.raises(ConfigError, match="device = 'cuda'"):
        Session(_cfg(tiny_llama_dir, device="cuda"), verbose=False)
