"""``specc.passes.small_m_gemv``: few-row bf16 and fp32 linears become ``specc::small_m_linear``.

* a small bf16 module: every linear with static rows <= max_rows is rewritten, the graph
  computes what ``F.linear`` does up to bf16 rounding; fp32 ones too (to fp32 rounding);
  fp16 linears, symbolic row counts and rows past the limit are left alone;
* AOTInductor compiles a graph calling the op (a proxy-executor extern call) with its
  constants kept out of the package, and the loaded package computes the reference;
* the tiny bf16 Llama VerifyProgram after fusion + this pass matches the unpassed graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specc.kernels.small_m_gemv import kernel_available, small_m_linear_reference
from specc.passes.fuse_projections import fuse_projections
from specc.passes.packed_weights import uses_packed_weights
from specc.passes.signature import export_flat
from specc.passes.small_m_gemv import small_m_gemvs
from specc.runtime.programs import VerifyProgram
from test_pretranspose_weights import MAX_LEN, clone_kv, tiny_model, verify_args

LINEAR = torch.ops.aten.linear.default
needs_kernel = pytest.mark.skipif(not kernel_available(), reason="no AVX512_BF16 or no C++ toolchain: no gemv default")
OP = torch.ops.specc.small_m_linear.default


def count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


class TwoLinears(nn.Module):
    def __init__(self, k: int = 40, n: int = 24, dtype=torch.bfloat16):
        super().__init__()
        self.a = nn.Linear(k, n).to(dtype)
        self.b = nn.Linear(n, k, bias=False).to(dtype)

    def forward(self, x):
        return self.b(torch.relu(F.linear(x, self.a.weight, self.a.bias)))


def _bf16_close(got, want):
    tol = 4 * 2 ** -8 * want.float().abs().clamp_min(1.0)
    assert ((got.float() - want.float()).abs() <= tol).all()


@pytest.mark.parametrize("shape", [(40,), (1, 40), (5, 40), (1, 5, 40), (2, 8, 40)])
def test_rewrites_bf16_linears(shape):
    torch.manual_seed(len(shape))
    mod = TwoLinears().eval()
    x = torch.randn(*shape).bfloat16()
    gm = export_flat(mod, (x,))
    assert small_m_gemvs(gm) == 2 and count(gm, LINEAR) == 0 and count(gm, OP) == 2
    with torch.no_grad():
        want = F.linear(torch.relu(small_m_linear_reference(x, mod.a.weight, mod.a.bias)), mod.b.weight)
        (got,) = gm(x)
    _bf16_close(got, want)
    torch.export.export(gm, (x,))  # re-exports


def test_rewrites_fp32_linears():
    torch.manual_seed(0)
    mod = TwoLinears(dtype=torch.float32).eval()
    x = torch.randn(3, 40)
    gm = export_flat(mod, (x,))
    assert small_m_gemvs(gm) == 2 and count(gm, LINEAR) == 0
    with torch.no_grad():
        (got,) = gm(x)
        torch.testing.assert_close(got, mod(x), rtol=1e-5, atol=1e-5)


def test_leaves_fp16_symbolic_and_wide_linears():
    gm = export_flat(TwoLinears(dtype=torch.float16).eval(), (torch.randn(3, 40).half(),))
    assert small_m_gemvs(gm) == 0 and count(gm, LINEAR) == 2
    gm = export_flat(TwoLinears().eval(), (torch.randn(17, 40).bfloat16(),))
    assert small_m_gemvs(gm) == 0
    assert small_m_gemvs(gm, max_rows=32) == 0  # capped by the bf16 kernel's 16 rows
    gm = export_flat(TwoLinears(dtype=torch.float32).eval(), (torch.randn(41, 40),))
    assert small_m_gemvs(gm) == 0  # past fp32's 40 rows
    gm = export_flat(TwoLinears(dtype=torch.float32).eval(), (torch.randn(8, 5, 40),))
    assert small_m_gemvs(gm, max_rows=16) == 0 and small_m_gemvs(gm) == 2  # 40 rows: the fp32 limit
    gm = export_flat(TwoLinears().eval(), (torch.randn(1, 6, 40).bfloat16(),),
                     ({1: torch.export.Dim("t", min=2, max=32)},))
    assert small_m_gemvs(gm) == 0
    with pytest.raises(ValueError):
        small_m_gemvs(gm, max_rows=0)


def test_aoti_calls_the_op(tmp_path):
    """The compiled package calls the op by name (proxy executor) on weights bound at load."""
    mod = TwoLinears().eval()
    x = torch.randn(1, 5, 40).bfloat16()
    gm = export_flat(mod, (x,))
    small_m_gemvs(gm)
    with torch.no_grad():
        ep = torch.export.export(gm, (x,))
        path = torch._inductor.aoti_compile_and_package(
            ep, package_path=str(tmp_path / "p.pt2"), inductor_configs={"aot_inductor.package_constants_in_so": False})
        (want,) = gm(x)
    runner = torch._inductor.aoti_load_package(path)
    consts = {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}
    runner.load_constants(consts, check_full_update=True, user_managed=True)
    (got,) = runner(x)
    torch.testing.assert_close(got, want)


def test_tiny_bf16_verify_program_matches():
    cfg, model = tiny_model("qwen2")
    model = model.to(torch.bfloat16)
    ids, pos, kv = verify_args(cfg, 1, 5)
    kv = tuple(t.bfloat16() for t in kv)
    keys = torch.arange(24)
    args = (ids, pos, kv, keys)
    dyn = (None, None, (None,) * len(kv), {0: torch.export.Dim("kv_len", min=2, max=MAX_LEN)})
    gm = export_flat(VerifyProgram(model, MAX_LEN), args, dyn)
    plain = export_flat(VerifyProgram(model, MAX_LEN), args, dyn)
    fuse_projections(gm)
    n_linears = count(gm, LINEAR)
    assert small_m_gemvs(gm) == n_linears > 0 and count(gm, LINEAR) == 0
    kv_a, kv_b = clone_kv(kv), clone_kv(kv)
    with torch.no_grad():
        got = gm(ids, pos, *kv_a, keys)
        want = plain(ids, pos, *kv_b, keys)
    for g, w in zip(got, want):
        if g.is_floating_point():
            _bf16_close(g, w)
        else:
            torch.testing.assert_close(g, w)
    for a, b in zip(kv_a, kv_b):
        _bf16_close(a, b)


@needs_kernel
def test_bf16_artifact_with_gemv_is_lossless(tiny_qwen2_dir, tmp_path):
    """The default bf16 artifact where the kernel builds: ``specc compile`` picks
    ``gemv`` (decode and spec_step call the op and carry no packed weights, prefill keeps
    oneDNN-packed linears); every greedy token, speculative or not, is the reference
    model's argmax up to bf16 rounding (as tests/test_packed_weights.py)."""
    from transformers import AutoModelForCausalLM

    from helpers import drafter_spec, greedy
    from specc import Session
    from specc.compiler import compile_artifact
    from test_packed_weights import assert_reference_argmax

    cfg = dict(target=str(tiny_qwen2_dir), dtype="bfloat16", max_model_len=96, max_num_seqs=1,
               batch_buckets=[1], speculative_config=drafter_spec("ngram", 3))
    art = compile_artifact(cfg, tmp_path / "build", progress=False)
    compiled = Session(str(art), verbose=False)
    manifest = compiled.artifact.manifest
    assert manifest["linear_passes"] == "gemv"
    packed = {p["kind"]: bool(p["packed_constants"]) for p in manifest["programs"]}
    assert packed == {"prefill": uses_packed_weights(torch.bfloat16, "cpu"), "decode": False, "spec_step": False}
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], [17, 4, 4, 17, 4, 4, 17]]
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, torch_dtype=torch.bfloat16).eval()
    for use_speculation in (True, False):
        outs = compiled.generate(prompts, greedy(12), use_speculation=use_speculation)
        assert_reference_argmax(ref, prompts, [o.token_ids for o in outs], use_speculation)
