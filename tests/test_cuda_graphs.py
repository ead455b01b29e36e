"""CUDA-graph replay of the step programs (runtime/cuda_graphs.py).

On a CPU the capture seam is :func:`call_directly` ("replay" = call the runner on the
static buffers), which checks everything but the capture itself: kv_len buckets, static
buffers (values copied in, KV views bound as they are, key_positions per bucket), the
graphs a session builds, and a compiled session whose steps go through the graphed
path generating what the direct path generates. The capture is checked against the
direct runner call only where CUDA is available.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import drafter_spec, greedy
from specc.runtime.cuda_graphs import GraphedProgram, StepGraphs, call_directly, kv_bucket, kv_len_buckets

INPUTS = ["input_ids", "positions", "kv_0", "kv_1", "key_positions", "uniforms", "num_rows"]


def test_kv_len_buckets():
    assert kv_len_buckets(2048) == [256, 512, 1024, 2048]
    assert kv_len_buckets(1000) == [256, 512, 1000]
    assert kv_len_buckets(256) == [256]
    assert kv_len_buckets(160) == [160]
    assert kv_len_buckets(100, smallest=32) == [32, 64, 100]


def test_kv_bucket_rounds_up():
    b = kv_len_buckets(1000)
    assert [kv_bucket(n, b) for n in (1, 256, 257, 512, 513, 1000)] == [256, 256, 512, 512, 1000, 1000]
    with pytest.raises(ValueError, match="largest kv_len bucket is 1000"):
        kv_bucket(1001, b)


class _Recorder:
    """A runner that records its arguments and returns fresh outputs from them."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, *args):
        self.calls.append(args)
        ids, pos, kv0, kv1, keys, u, n = args
        return ids * 2, keys.sum().reshape(1), u + n


def _example(b=2, t=3):
    return {"input_ids": torch.zeros(b, t, dtype=torch.long), "positions": torch.full((b, t), 99),
            "uniforms": torch.zeros(b, 5), "num_rows": torch.tensor(b)}


def test_graphed_program_static_buffers_and_buckets():
    kv = (torch.zeros(2, 1, 8, 4), torch.zeros(2, 1, 8, 4))
    run = _Recorder()
    g = GraphedProgram(run, INPUTS, kv, _example(), kv_len_buckets(600), call_directly)
    g.capture_all()
    assert list(g._replays) == [600, 512, 256] and not run.calls  # largest first; direct: nothing runs
    buffers = dict(g.static)
    ids = torch.arange(6).view(2, 3)
    out = g({"input_ids": ids, "positions": ids, "uniforms": torch.ones(2, 5), "num_rows": torch.tensor(1),
             "key_positions": "ignored: the bucket's arange is bound"}, needed_keys=300)
    args = run.calls[-1]
    assert args[2] is kv[0] and args[3] is kv[1]                       # KV views bound, not copied
    assert torch.equal(args[4], torch.arange(512))                     # 300 keys -> bucket 512
    assert all(a is buffers[n] for n, a in zip(INPUTS, args) if n in buffers)  # same static buffers
    assert torch.equal(buffers["input_ids"], ids) and int(buffers["num_rows"]) == 1  # values copied in
    assert torch.equal(out[0], ids * 2) and torch.equal(out[2], torch.full((2, 5), 2.0))
    g({"input_ids": ids, "positions": ids, "uniforms": torch.ones(2, 5), "num_rows": torch.tensor(2)}, 40)
    assert len(run.calls[-1][4]) == 256 and len(run.calls) == 2


def test_graphed_program_buffers_are_clones():
    ex = _example()
    g = GraphedProgram(_Recorder(), INPUTS, (torch.zeros(1), torch.zeros(1)), ex, [256])
    g({"input_ids": torch.ones(2, 3, dtype=torch.long), "positions": torch.ones(2, 3, dtype=torch.long),
       "uniforms": torch.ones(2, 5), "num_rows": torch.tensor(2)}, 1)
    assert int(ex["input_ids"].sum()) == 0  # the example is not written through


def test_step_graphs_cover_every_group_start():
    prog = lambda name, kind, b, t: SimpleNamespace(name=name, kind=kind, batch=b, tokens=t,  # noqa: E731
                                                     inputs=INPUTS, runner=_Recorder(), drafts_in_graph=False)
    programs = SimpleNamespace(buckets=[1, 2, 4],
                               decode={b: prog(f"decode_b{b}", "decode", b, 1) for b in (1, 2, 4)},
                               spec_step={b: prog(f"spec_step_b{b}", "spec_step", b, 3) for b in (1, 2, 4)})
    views = {}

    def kv_views(slot0, b):
        return views.setdefault((slot0, b), (torch.zeros(b, 1), torch.zeros(b, 1)))

    sg = StepGraphs(programs, kv_views, num_slots=6, max_model_len=300, trash_pos=300, capture=call_directly)
    assert sorted(sg.graphs) == sorted([(f"{kind}_b{b}", s) for kind in ("decode", "spec_step")
                                        for b, starts in ((1, (0, 4)), (2, (0, 4)), (4, (0,))) for s in starts])
    assert list(sg.graphs)[0] == ("spec_step_b4", 0)  # largest first: sizes the shared pool
    g = sg.graphs["spec_step_b2", 4]
    assert g.kv[0] is views[4, 2][0] and g.kv_buckets == [256, 300]
    assert g.static["input_ids"].shape == (2, 3) and g.static["uniforms"].shape == (2, 5)
    assert bool((g.static["positions"] == 300).all())  # warm-up rows write the trash position only


K = 2
MAX_MODEL_LEN = 300  # kv buckets 256, 300: the test's longest request crosses 256 keys


@pytest.fixture(scope="module")
def artifact(tiny_llama_dir, tmp_path_factory):
    from specc.compiler import compile_artifact

    cfg = dict(target=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=2, batch_buckets=[2],
               speculative_config=drafter_spec("ngram", K))
    return compile_artifact(cfg, tmp_path_factory.mktemp("art") / "build", progress=False)


def test_graphed_session_generates_as_direct(artifact, tiny_llama_dir, monkeypatch):
    """The graphed step path (direct "replay" on CPU) against the direct path: greedy and
    seeded sampling, batch 2, a request crossing the 256-key bucket."""
    from transformers import AutoTokenizer

    from specc import SamplingParams, Session
    import specc.runtime.replay as replay

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "One fish, two fish, red fish, blue fish. This one has a little star. " * 20
    ids = tok.encode(text)
    prompts = [ids[:250], ids[3:40]]
    params = [greedy(12, logprobs=2), SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7)]
    direct = Session(str(artifact), verbose=False)
    assert direct.engine.graphs is None
    want = [direct.generate(prompts, p) for p in params]
    monkeypatch.setattr(replay, "use_cuda_graphs", lambda device: True)
    graphed = Session(str(artifact), verbose=False)
    assert graphed.engine.graphs is graphed.baseline_engine.graphs is not None  # captured once per session
    assert graphed.engine.graphs.kv_buckets == [256, 300]
    got = [graphed.generate(prompts, p) for p in params]
    for w, g in zip(want, got):
        assert [o.token_ids for o in g] == [o.token_ids for o in w]
    assert len(want[0][0].token_ids) == 12


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_compile_for_cuda_without_gpu_is_a_config_error(tiny_llama_dir, tmp_path):
    from specc.compiler import compile_artifact
    from specc.config import ConfigError

    with pytest.raises(ConfigError, match="no CUDA device is available"):
        compile_artifact(dict(target=str(tiny_llama_dir), device="cuda"), tmp_path / "build", progress=False)
    assert not (tmp_path / "build").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_direct_call(tiny_llama_dir, tmp_path):
    """On a GPU: a captured decode/spec_step graph gives the direct runner call's outputs."""
    from specc.compiler import compile_artifact, step_example_inputs
    from specc.models.kv_cache import KVCache
    from specc.runtime.cuda_graphs import capture_cuda_graph
    from specc.runtime.programs import flat_kv
    from specc.artifact import open_artifact
    from specc.runtime.replay import ProgramSet

    cfg = dict(target=str(tiny_llama_dir), device="cuda", max_model_len=MAX_MODEL_LEN, batch_buckets=[2],
               speculative_config=drafter_spec("ngram", K))
    programs = ProgramSet(open_artifact(compile_artifact(cfg, tmp_path / "build", progress=False)), "cuda")
    from transformers import AutoConfig
    from specc.models.llama import ModelConfig

    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_llama_dir))
    for prog in (programs.decode[2], programs.spec_step[2]):
        caches = [KVCache.for_model(mc, 2, MAX_MODEL_LEN, torch.float32, "cuda") for _ in range(2)]
        for c in caches:
            for t in (*c.k, *c.v):
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(0)))
        gen = torch.Generator().manual_seed(1)
        values = {"input_ids": torch.randint(0, 100, (2, prog.tokens), generator=gen),
                  "positions": torch.arange(40, 40 + prog.tokens).repeat(2, 1),
                  **step_example_inputs(2, prog.tokens - 1, "cpu")}
        values["num_draft_tokens"].fill_(prog.tokens - 1)
        values["uniforms"].uniform_(generator=gen)
        g = GraphedProgram(prog.runner, prog.inputs, flat_kv(caches[0]), values, [256, MAX_MODEL_LEN],
                           capture_cuda_graph, torch.cuda.graph_pool_handle())
        g.capture_all()
        got = [o.clone() for o in g(values, needed_keys=40 + prog.tokens)]
        kv = iter(flat_kv(caches[1]))
        args = [next(kv) if n.startswith("kv_") else torch.arange(256, device="cuda") if n == "key_positions"
                else values[n].cuda() for n in prog.inputs]
        want = prog.runner(*args)
        for a, b in zip(got, want):
            assert torch.equal(a, b), prog.name
        for a, b in zip(flat_kv(caches[0]), flat_kv(caches[1])):
            assert torch.equal(a, b), f"{prog.name}: KV writes differ"
