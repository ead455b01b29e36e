"""specc.sampling_params.SamplingParams."""

from __future__ import annotations

import json
import math

import pytest

from specc.config import SamplingDefaults
from specc.sampling_params import MAX_LOGPROBS, SamplingParams


def test_vllm_defaults():
    p = SamplingParams()
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.max_tokens == 16
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.seed is None and p.logprobs is None
    assert p.validate() is p
    assert not p.is_greedy


def test_stop_normalised():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=["x"]).stop == ["x"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]


def test_post_init_never_raises():
    p = SamplingParams(temperature=-1, top_p=5, top_k="x", max_tokens=0, stop=3, logprobs=99)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        p.validate()


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0),
        dict(temperature=2),
        dict(top_p=1e-6),
        dict(top_p=1),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_k=50),
        dict(max_tokens=1),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(stop=["a", "b"], stop_token_ids=[0, 2]),
        dict(seed=0),
        dict(seed=-5),
        dict(ignore_eos=True),
    ],
)
def test_valid(kw):
    SamplingParams(**kw).validate()


@pytest.mark.parametrize(
    "kw, needles",
    [
        (dict(temperature=-0.5), ["temperature = -0.5", ">= 0"]),
        (dict(temperature=math.nan), ["temperature = nan", "finite"]),
        (dict(temperature=math.inf), ["temperature = inf", "finite"]),
        (dict(temperature="hot"), ["temperature = 'hot'"]),
        (dict(top_p=0), ["top_p = 0", "0 < top_p <= 1"]),
        (dict(top_p=1.01), ["top_p = 1.01", "0 < top_p <= 1"]),
        (dict(top_p=-1), ["top_p = -1"]),
        (dict(top_k=-2), ["top_k = -2", "0 / -1"]),
        (dict(top_k=2.0), ["top_k = 2.0", "integer"]),
        (dict(top_k=True), ["top_k = True", "integer"]),
        (dict(max_tokens=0), ["max_tokens = 0", ">= 1"]),
        (dict(max_tokens=1.5), ["max_tokens = 1.5", "integer"]),
        (dict(logprobs=-1), ["logprobs = -1", f"<= {MAX_LOGPROBS}"]),
        (dict(logprobs=MAX_LOGPROBS + 1), [f"logprobs = {MAX_LOGPROBS + 1}", f"<= {MAX_LOGPROBS}"]),
        (dict(stop=""), ["stop = ['']", "non-empty"]),
        (dict(stop=["ok", ""]), ["stop = ['ok', '']", "non-empty"]),
        (dict(stop=[1]), ["stop = [1]"]),
        (dict(stop=5), ["stop = 5"]),
        (dict(stop_token_ids=[-1]), ["stop_token_ids = [-1]", ">= 0"]),
        (dict(stop_token_ids=["a"]), ["stop_token_ids = ['a']"]),
        (dict(ignore_eos="yes"), ["ignore_eos = 'yes'"]),
        (dict(seed=1.5), ["seed = 1.5", "integer"]),
    ],
)
def test_invalid(kw, needles):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kw).validate()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg


def test_all_problems_reported():
    with pytest.raises(ValueError) as info:
        SamplingParams(temperature=-1, top_p=0, max_tokens=0).validate()
    msg = str(info.value)
    assert "temperature" in msg and "top_p" in msg and "max_tokens" in msg


@pytest.mark.parametrize(
    "kw, greedy",
    [
        (dict(temperature=0.0), True),
        (dict(temperature=0), True),
        (dict(temperature=1.0, top_k=1), True),
        (dict(temperature=0.7), False),
        (dict(temperature=0.7, top_k=2), False),
        (dict(temperature=1.0, top_k=-1), False),
    ],
)
def test_is_greedy(kw, greedy):
    assert SamplingParams(**kw).is_greedy is greedy


def test_from_defaults():
    d = SamplingDefaults(temperature=0.5, top_p=0.8, top_k=20, max_tokens=64, seed=7)
    p = SamplingParams.from_defaults(d)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.5, 0.8, 20, 64, 7)
    assert p.stop == [] and p.logprobs is None
    p = SamplingParams.from_defaults(d, max_tokens=3, stop="x", temperature=0.0)
    assert p.max_tokens == 3 and p.stop == ["x"] and p.is_greedy and p.top_k == 20


def test_from_config_defaults_is_greedy():
    p = SamplingParams.from_defaults(SamplingDefaults())
    assert p.is_greedy and p.max_tokens == 128
    p.validate()


def test_from_defaults_unknown_override():
    with pytest.raises(TypeError, match="max_new_tokens"):
        SamplingParams.from_defaults(SamplingDefaults(), max_new_tokens=3)


def test_to_dict_json():
    d = SamplingParams(stop="s", seed=1, logprobs=2).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["stop"] == ["s"]
