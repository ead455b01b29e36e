"""oneDNN-packed weights for bf16 CPU programs (passes/packed_weights.py).

* lower_packed maps every packed constant back to the artifact constant it was made
  from (incl. transposed sources), and a program bound through bind_constants computes
  what the same program computes with plain weights;
* a bf16 artifact of the tiny Qwen2 (tied embedding / lm_head, q/k/v biases; n-gram,
  bucket 1) binds one packed copy per weight for all its programs, the embedding gather
  reads the tied weight with the strides the compiled code expects, and every greedy
  token, speculative or not, is the reference model's argmax up to bf16 rounding.

Skipped where oneDNN has no native bf16 (no AVX-512 BF16 / AMX): there the compiler
lowers bf16 programs without packing.
"""

from __future__ import annotations

import pytest
import torch

from helpers import drafter_spec, greedy, make_session
from specc import Session
from specc.compiler import compile_artifact
from specc.passes.packed_weights import PackedWeights, bind_constants, lower_packed, uses_packed_weights

pytestmark = pytest.mark.skipif(not uses_packed_weights(torch.bfloat16, "cpu"),
                                reason="oneDNN without native bf16 on this CPU")


class _Tiny(torch.nn.Module):
    """Two linears, a norm weight and a tied embedding / lm_head (the shapes that matter)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = torch.nn.Parameter(torch.randn(96, 40, generator=g) * 0.1)
        self.down_t = torch.nn.Parameter(torch.randn(96, 40, generator=g) * 0.1)  # stored [in, out]
        self.norm = torch.nn.Parameter(torch.rand(40, generator=g) + 0.5)
        self.emb = torch.nn.Parameter(torch.randn(50, 40, generator=g))

    def forward(self, ids):
        x = self.emb[ids] * self.norm
        x = torch.relu(x @ self.up.t()) @ self.down_t
        return x @ self.emb.t()


def test_lower_packed_maps_and_matches_plain(tmp_path):
    m = _Tiny().to(torch.bfloat16).eval()
    ids = torch.tensor([[1, 7, 3, 49, 0]])
    consts = dict(m.named_parameters())
    ep = torch.export.export(m, (ids,))
    packed_map = lower_packed(ep, consts, tmp_path / "p.pt2")
    sources = {(v["source"], v["transpose"], v["packed"]) for v in packed_map.values()}
    assert {s for s in sources if s[2]} == {("up", False, True), ("down_t", True, True), ("emb", False, True)}
    runner = torch._inductor.aoti_load_package(str(tmp_path / "p.pt2"))
    cache = PackedWeights()
    bind_constants(runner, consts, packed_map, cache)
    assert len(cache) == len(sources)
    with torch.no_grad():
        ref = m(ids).float()
    got = runner(ids).float()
    # bf16 outputs: equal up to a couple of bf16 rounding steps of the largest logit
    assert torch.allclose(got, ref, atol=2 * ref.abs().max().item() * 2 ** -8, rtol=0)


def test_bind_constants_needs_a_cache_for_packed_programs():
    class _Runner:
        def get_constant_fqns(self):
            return ["_frozen_param0"]

    with pytest.raises(ValueError, match="PackedWeights"):
        bind_constants(_Runner(), {"w": torch.zeros(2, 2)}, {"_frozen_param0": {"source": "w", "transpose": False, "packed": True}})


@pytest.mark.slow  # ~80 s; CPUs that pack bf16 build specc::small_m_linear too, so the default
# bf16 artifact packs the prefill only (tests/test_small_m_gemv_pass.py); this is the
# all-packed lowering, what a machine where the kernel cannot build gets
def test_bf16_artifact_shares_packed_weights_and_is_lossless(tiny_qwen2_dir, tmp_path):
    """Lowered with ``pretranspose`` (every program packed): one packed copy per weight
    for all programs; every compiled greedy token, speculative or not, is the reference
    model's (transformers, bf16) argmax up to bf16 rounding: bf16 kernels of different
    widths may round a near-tie apart, so exact equality is the fp32 contract
    (tests/test_compiled.py), not this one."""
    from transformers import AutoModelForCausalLM

    spec = drafter_spec("ngram", 3)
    cfg = dict(target=str(tiny_qwen2_dir), dtype="bfloat16", max_model_len=96, max_num_seqs=1,
               batch_buckets=[1], speculative_config=spec)
    art = compile_artifact(cfg, tmp_path / "build", progress=False, linear_passes="pretranspose")
    compiled = Session(str(art), verbose=False)
    maps = [p["packed_constants"] for p in compiled.artifact.manifest["programs"]]
    entries = {(v["source"], v["transpose"], v["packed"], tuple(v.get("stride", ()))) for m in maps
               for v in m.values()}
    assert all(maps) and len(compiled.programs.packed) == len(entries)  # one copy per weight
    assert any(not e[2] and e[3] for e in entries)  # the tied embedding's gather view is exercised
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], [17, 4, 4, 17, 4, 4, 17]]
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, torch_dtype=torch.bfloat16).eval()
    for use_speculation in (True, False):
        outs = compiled.generate(prompts, greedy(12), use_speculation=use_speculation)
        assert_reference_argmax(ref, prompts, [o.token_ids for o in outs], use_speculation)


def assert_reference_argmax(ref, prompts, outputs, label=None) -> None:
    """Every token of ``outputs[i]`` (greedy continuations of ``prompts[i]``) is ``ref``'s
    argmax at its position up to bf16 rounding (4 bf16 steps of the best logit)."""
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        best = logits.max(dim=1).values
        assert (best - chosen <= 4 * best.abs() * 2 ** -8 + 1e-3).all(), (label, best - chosen)
