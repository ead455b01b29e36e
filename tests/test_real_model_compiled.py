"""Compiled programs on the real SmolLM2-135M-Instruct: one program of every kind.

`specc compile` with batch bucket 1 and n-gram k = 4 builds prefill, decode_b1 and
spec_step_b1 (about a minute each on a 2-core CPU); the artifact's greedy
output, speculative and not, must equal the eager non-speculative output under the
real-model rule of test_real_model_spec.py (a divergence is tolerated only where the
eager top-1/top-2 logit gap is below 1e-3: compiled kernels round differently).
"""

from __future__ import annotations

import pytest

from helpers import drafter_spec, make_session
from specc import SamplingParams, Session
from specc.compiler import compile_artifact
from test_real_model_spec import MAX_NEW, PROMPTS, compare_with_gap_rule

pytestmark = pytest.mark.real_model

K = 4


@pytest.fixture(scope="module")
def compiled(smollm2_dir, tmp_path_factory):
    cfg = dict(target=str(smollm2_dir), max_model_len=512, max_num_seqs=1, batch_buckets=[1],
               speculative_config=drafter_spec("ngram", K))
    art = compile_artifact(cfg, tmp_path_factory.mktemp("smollm2") / "build", progress=False)
    return Session(str(art), verbose=False)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    eager = make_session(smollm2_dir, None, max_model_len=512)
    return eager.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2))


@pytest.mark.parametrize("use_speculation", [True, False])
def test_compiled_greedy_equals_eager(compiled, reference, use_speculation):
    # three prompts, max_num_seqs 1: one at a time through bucket 1
    outs = compiled.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                             use_speculation=use_speculation)
    for out, ref in zip(outs, reference):
        compared, diverged = compare_with_gap_rule(out.token_ids, ref)
        if diverged is None:
            assert out.text == ref.text and out.finish_reason == ref.finish_reason
        assert compared > 0
    if use_speculation:
        assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0
