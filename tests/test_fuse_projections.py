"""``specc.passes.fuse_projections``: horizontal fusion of linears that read one input.

Small hand-written modules (bias / no bias / mixed, a linear on another input, shared
weights, ``.view`` users the strided split pieces cannot serve) and the tiny Llama and
Qwen2-style VerifyPrograms: fewer linear nodes, same outputs and KV writes, names
deterministic across batch sizes, re-export, and one AOTInductor round trip.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM, ModelConfig
from specc.passes.fuse_projections import fuse_projections, fused_name
from specc.passes.signature import export_flat
from specc.runtime.programs import VerifyProgram, flat_kv

LINEAR = torch.ops.aten.linear.default
MAX_LEN = 64


def n_linears(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR)


def attr_targets(gm) -> set[str]:
    return {n.target for n in gm.graph.nodes if n.op == "get_attr"}


def param_names(gm) -> set[str]:
    return {name for name, _ in gm.named_parameters(remove_duplicate=False)}


def assert_outputs_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-5)


# --------------------------------------------------------------------------- naming

def test_fused_name_scheme():
    base = "model.model.layers.0.self_attn"
    assert fused_name([f"{base}.{p}_proj.weight" for p in "qkv"]) == \
        f"{base}.fused__q_proj__k_proj__v_proj.weight"
    assert fused_name([f"{base}.{p}_proj.bias" for p in "qkv"]) == \
        f"{base}.fused__q_proj__k_proj__v_proj.bias"
    assert fused_name(["w1", "w2"]) == "fused__w1__w2"
    assert fused_name(["a.x.weight", "b.y.weight"]) == "fused__a_x__b_y.weight"
    with pytest.raises(ValueError):
        fused_name(["a.weight", "a.weight"])


# --------------------------------------------------------------------------- small modules

class ThreeOnX(nn.Module):
    """a, b, c read x (c's output is flattened with .view(-1)); d reads y."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4, bias=bias)
        self.b = nn.Linear(8, 6, bias=bias)
        self.c = nn.Linear(8, 2, bias=bias)
        self.d = nn.Linear(8, 5, bias=bias)

    def forward(self, x, y):
        return self.a(x), self.b(x) * 2, self.c(x).view(-1), self.d(y)


def small_args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)


@pytest.mark.parametrize("bias", [True, False])
def test_three_linears_on_one_input(bias):
    torch.manual_seed(0)
    mod = ThreeOnX(bias).eval().requires_grad_(False)
    args = small_args()
    gm = export_flat(mod, args)
    ref = gm(*args)
    assert n_linears(gm) == 4

    assert fuse_projections(gm) == 1
    assert n_linears(gm) == 2
    assert_outputs_close(gm(*args), ref)
    assert_outputs_close(gm(*args), mod(*args))

    kinds = ["weight", "bias"] if bias else ["weight"]
    for k in kinds:
        fused = getattr(gm.fused__a__b__c, k)
        assert torch.equal(fused, torch.cat([getattr(mod.a, k), getattr(mod.b, k), getattr(mod.c, k)]))
        assert f"fused__a__b__c.{k}" in attr_targets(gm)
        assert f"d.{k}" in attr_targets(gm)
        for name in "abc":  # unused get_attr nodes and their attributes are gone
            assert f"{name}.{k}" not in attr_targets(gm)
            assert f"{name}.{k}" not in param_names(gm)
    for name in "abc":  # and so are the emptied containers
        assert not hasattr(gm, name)
    # the .view(-1) the strided split piece cannot serve became a reshape
    assert any(n.target is torch.ops.aten.reshape.default for n in gm.graph.nodes)

    ep = torch.export.export(gm, args, strict=False)
    assert_outputs_close(ep.module()(*args), ref)
    assert fuse_projections(gm) == 0  # idempotent


def test_mixed_bias_fuses_per_kind():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4, bias=True)
            self.b = nn.Linear(8, 4, bias=True)
            self.c = nn.Linear(8, 4, bias=False)
            self.d = nn.Linear(8, 4, bias=False)
            self.e = nn.Linear(8, 4, bias=False)

        def forward(self, x, y):
            return self.a(x) + self.c(x), self.b(x) - self.d(x) * self.e(y)

    torch.manual_seed(0)
    mod = Mixed().eval().requires_grad_(False)
    args = small_args()
    gm = export_flat(mod, args)
    ref = gm(*args)
    assert fuse_projections(gm) == 2  # {a, b} with biases, {c, d} without; e is on y
    assert n_linears(gm) == 3
    assert {"fused__a__b.weight", "fused__a__b.bias", "fused__c__d.weight", "e.weight"} <= attr_targets(gm)
    assert_outputs_close(gm(*args), ref)


def test_shared_weights_survive():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4, bias=False)
            self.b = nn.Linear(8, 6, bias=False)
            self.c = nn.Linear(8, 3, bias=False)
            self.e = nn.Linear(8, 4, bias=False)
            self.e.weight = self.a.weight  # tied

        def forward(self, x, y):
            # x: {a, b} fuse; y: {a, b, c} fuse; e (tied to a) alone on x * 3 keeps
            # reading the shared weight, so that attribute must survive
            return (self.a(x) * self.b(x)[..., :4], self.a(y) + self.b(y)[..., 2:6],
                    self.e(x * 3) + self.c(y)[..., :1])

    torch.manual_seed(0)
    mod = Shared().eval().requires_grad_(False)
    args = small_args()
    gm = export_flat(mod, args)
    ref = gm(*args)
    before = n_linears(gm)
    groups = fuse_projections(gm)
    # x: {a, b}; y: {a, b, c} -> fused__a__b, fused__a__b__c; x*3: e alone
    assert groups == 2
    assert n_linears(gm) == before - 3
    assert_outputs_close(gm(*args), ref)
    # the tied weight is still read by the unfused e-linear: its get_attr and attribute stay
    # (export names the shared tensor once, after one of its aliases: here e.weight, so
    # the fused names read fused__e__b and fused__e__b__c)
    tied = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in ("a.weight", "e.weight")
            and n.users]
    assert len(tied) == 1 and tied[0].target in param_names(gm)
    assert sum(t.startswith("fused__") for t in attr_targets(gm)) == 2
    assert "b.weight" not in param_names(gm) and "c.weight" not in param_names(gm)
    ep = torch.export.export(gm, args, strict=False)
    assert_outputs_close(ep.module()(*args), ref)


def test_same_group_on_two_inputs_shares_one_attribute():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4)
            self.b = nn.Linear(8, 6)

        def forward(self, x, y):
            return self.a(x), self.b(x), self.a(y) * self.b(y)[..., :4]

    torch.manual_seed(0)
    mod = Twice().eval().requires_grad_(False)
    args = small_args()
    gm = export_flat(mod, args)
    ref = gm(*args)
    assert fuse_projections(gm) == 2
    assert n_linears(gm) == 2
    fused_nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("fused__")]
    assert sorted({n.target for n in fused_nodes}) == ["fused__a__b.bias", "fused__a__b.weight"]
    assert not any(t.startswith(("a.", "b.")) for t in param_names(gm))
    assert_outputs_close(gm(*args), ref)


# --------------------------------------------------------------------------- tiny models

def tiny_config(kind: str) -> ModelConfig:
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if kind == "qwen2":
        return ModelConfig(**common, attention_bias=True, model_type="qwen2", tie_word_embeddings=True)
    return ModelConfig(**common)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    cfg = tiny_config(request.param)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    if cfg.attention_bias:  # nn.Linear's init is not zero, but make the biases matter
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_()
    return cfg, model


def verify_args(cfg, b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.for_model(cfg, b, MAX_LEN)
    for k in flat_kv(cache):  # a non-empty history, so the attention reads old entries
        k[:, :, :10].normal_(generator=g)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    pos = (torch.arange(t) + 10)[None].repeat(b, 1)
    pos[-1, -1] = MAX_LEN  # one padding token, written at the trash position
    return ids, pos, flat_kv(cache)


def clone_kv(kv):
    return tuple(t.clone() for t in kv)


def test_tiny_model_fused_matches_unfused(tiny):
    cfg, model = tiny
    ids, pos, kv = verify_args(cfg, 2, 3)
    gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv))
    L = cfg.num_hidden_layers
    assert n_linears(gm) == 7 * L + 1
    kv_ref = clone_kv(kv)
    ref = gm(ids, pos, *kv_ref)

    assert fuse_projections(gm) == 2 * L
    assert n_linears(gm) == 4 * L + 1
    kv_new = clone_kv(kv)
    out = gm(ids, pos, *kv_new)
    assert_outputs_close(out, ref)
    assert_outputs_close(kv_new, kv_ref)

    names = param_names(gm)
    for i in range(L):
        attn, mlp = f"model.model.layers.{i}.self_attn", f"model.model.layers.{i}.mlp"
        assert f"{attn}.fused__q_proj__k_proj__v_proj.weight" in names
        assert (f"{attn}.fused__q_proj__k_proj__v_proj.bias" in names) == cfg.attention_bias
        assert f"{mlp}.fused__gate_proj__up_proj.weight" in names
        assert not any(n.startswith((f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj",
                                     f"{mlp}.gate_proj", f"{mlp}.up_proj")) for n in names)
        assert f"{attn}.o_proj.weight" in names and f"{mlp}.down_proj.weight" in names

    # re-export of the fused flat graph works and computes the same
    flat_args = (ids, pos, *clone_kv(kv))
    ep = torch.export.export(gm, flat_args, strict=False)
    assert_outputs_close(ep.module()(*flat_args), ref)
    assert_outputs_close(flat_args[2:], kv_ref)


def test_tiny_model_names_and_tensors_deterministic_across_buckets(tiny):
    cfg, model = tiny
    fused = []
    for b, t in ((1, 1), (3, 5)):
        ids, pos, kv = verify_args(cfg, b, t)
        gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv))
        fuse_projections(gm)
        fused.append(dict(gm.named_parameters(remove_duplicate=False)))
    a, b = fused
    assert list(a) == list(b)
    assert any("fused__" in n for n in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_aot_inductor_round_trip(tmp_path):
    cfg = tiny_config("qwen2")  # biases and tied embeddings
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    ids, pos, kv = verify_args(cfg, 2, 3, seed=1)
    gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv))
    kv_ref = clone_kv(kv)
    ref = gm(ids, pos, *kv_ref)
    assert fuse_projections(gm) == 2 * cfg.num_hidden_layers

    ep = torch.export.export(gm, (ids, pos, *kv), strict=False)
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "verify.pt2"),
        inductor_configs={"aot_inductor.package_constants_in_so": False})
    runner = torch._inductor.aoti_load_package(path)
    fqns = runner.get_constant_fqns()
    assert "model.model.layers.0.self_attn.fused__q_proj__k_proj__v_proj.weight" in fqns
    assert "model.model.layers.0.self_attn.fused__q_proj__k_proj__v_proj.bias" in fqns
    assert "model.model.layers.1.mlp.fused__gate_proj__up_proj.weight" in fqns
    assert not any(".q_proj." in f or ".up_proj." in f for f in fqns)
    consts = {**dict(gm.named_parameters(remove_duplicate=False)),
              **dict(gm.named_buffers(remove_duplicate=False))}
    runner.load_constants({f: consts[f] for f in fqns}, check_full_update=True, user_managed=True)

    kv_new = clone_kv(kv)
    out = runner(ids, pos, *kv_new)
    assert_outputs_close(out, ref, atol=1e-4)
    assert_outputs_close(kv_new, kv_ref, atol=1e-5)
