"""``specc.passes.pretranspose_weights``: linears become NN matmuls over ``[K, N]`` weights.

Small hand-written modules (bias / no bias, 2-D and 3-D inputs, a weight shared by two
linears, a weight tied to an embedding under each ``shared`` mode, a weight with another
reader) and the tiny Llama and Qwen2-style VerifyPrograms: no linear left, same outputs
and KV writes, names and tensors deterministic across batch sizes / T, re-export,
composition with ``fuse_projections``, and one AOTInductor round trip of the program as
``specc.compiler`` exports it (symbolic kv_len), run at two kv_lens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM, ModelConfig
from specc.passes.fuse_projections import fuse_projections
from specc.passes.pretranspose_weights import pretranspose_weights, transposed_name
from specc.passes.signature import export_flat
from specc.runtime.programs import VerifyProgram, flat_kv

LINEAR = torch.ops.aten.linear.default
MATMUL = torch.ops.aten.matmul.default
EMBEDDING = torch.ops.aten.embedding.default
MAX_LEN = 64


def count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def attr_targets(gm) -> set[str]:
    return {n.target for n in gm.graph.nodes if n.op == "get_attr"}


def param_names(gm) -> set[str]:
    return {name for name, _ in gm.named_parameters(remove_duplicate=False)}


def assert_outputs_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-5)


def assert_transposed(gm, mod, names):
    for n in names:
        w = mod.get_parameter(n)
        wt = gm.get_parameter(transposed_name(n))
        assert wt.shape == (w.shape[1], w.shape[0]) and wt.is_contiguous()
        assert torch.equal(wt, w.t())
        assert wt.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- small modules

class Small(nn.Module):
    """a: bias, 3-D input; b: no bias, 2-D input; c: bias, 2-D input; s: one weight read
    by two linears (the module and a functional call on another input)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 6, bias=False)
        self.c = nn.Linear(8, 5)
        self.s = nn.Linear(8, 3, bias=False)

    def forward(self, x, y):
        return (self.a(x), self.b(y) * 2, self.c(y), self.s(x) + 1,
                F.linear(y, self.s.weight).view(-1))


def small_args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 8, generator=g), torch.randn(5, 8, generator=g)


def test_transposed_name():
    assert transposed_name("model.model.layers.0.self_attn.q_proj.weight") == \
        "model.model.layers.0.self_attn.q_proj.weight_t"
    assert transposed_name("w") == "w_t"


def test_small_module():
    torch.manual_seed(0)
    mod = Small().eval().requires_grad_(False)
    args = small_args()
    gm = export_flat(mod, args)
    ref = gm(*args)
    assert count(gm, LINEAR) == 5

    assert pretranspose_weights(gm) == 5
    assert count(gm, LINEAR) == 0 and count(gm, MATMUL) == 5
    assert_outputs_close(gm(*args), ref)
    assert_outputs_close(gm(*args), mod(*args))

    assert_transposed(gm, mod, ["a.weight", "b.weight", "c.weight", "s.weight"])
    for name in "abcs":  # the old weights are gone, the biases stay as they were
        assert f"{name}.weight" not in param_names(gm) and f"{name}.weight" not in attr_targets(gm)
        assert f"{name}.weight_t" in attr_targets(gm)
    assert {"a.bias", "c.bias"} <= attr_targets(gm)
    # the shared weight: one get_attr node, one tensor, read by both matmuls
    s_nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "s.weight_t"]
    assert len(s_nodes) == 1 and len(s_nodes[0].users) == 2
    # the original module is untouched
    assert isinstance(mod.a.weight, nn.Parameter) and mod.a.weight.shape == (4, 8)

    ep = torch.export.export(gm, args, strict=False)
    assert_outputs_close(ep.module()(*args), ref)
    assert pretranspose_weights(gm) == 0  # idempotent: no linear left


def test_existing_different_attribute_is_an_error():
    torch.manual_seed(0)
    mod = Small().eval().requires_grad_(False)
    gm = export_flat(mod, small_args())
    gm.a.register_parameter("weight_t", nn.Parameter(torch.zeros(8, 4), requires_grad=False))
    with pytest.raises(RuntimeError, match="a.weight_t"):
        pretranspose_weights(gm)


class Tied(nn.Module):
    """An embedding and an output projection on one tensor (tied), plus an untied linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return (self.head(self.mid(self.embed(ids))),)


def tied_args():
    return (torch.randint(0, 20, (2, 3), generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("shared", ["embedding", "copy", "skip"])
def test_tied_embedding_modes(shared):
    torch.manual_seed(0)
    mod = Tied().eval().requires_grad_(False)
    args = tied_args()
    gm = export_flat(mod, args)
    ref = gm(*args)
    (tied_target,) = {n.args[0].target for n in gm.graph.nodes if n.target is EMBEDDING}

    n = pretranspose_weights(gm, shared=shared)
    assert n == (1 if shared == "skip" else 2)
    assert_outputs_close(gm(*args), ref)
    params = param_names(gm)
    assert "mid.weight_t" in params and "mid.weight" not in params
    emb = next(x for x in gm.graph.nodes if x.target is EMBEDDING)
    if shared == "embedding":  # one tensor, stored transposed; the gather reads it back
        assert count(gm, LINEAR) == 0
        assert transposed_name(tied_target) in params
        assert not {"embed.weight", "head.weight"} & params  # every alias is gone
        assert emb.args[0].target is torch.ops.aten.permute.default
        assert emb.args[0].args[0].target == transposed_name(tied_target)
    elif shared == "copy":  # the embedding keeps the original, lm_head reads a copy
        assert count(gm, LINEAR) == 0
        assert transposed_name(tied_target) in params and tied_target in params
        assert emb.args[0].op == "get_attr" and emb.args[0].target == tied_target
    else:
        assert count(gm, LINEAR) == 1
        assert not any(p.endswith("weight_t") and p != "mid.weight_t" for p in params)
    ep = torch.export.export(gm, args, strict=False)
    assert_outputs_close(ep.module()(*args), ref)


def test_weight_with_another_reader_is_kept_in_embedding_mode():
    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Linear(8, 4, bias=False)

        def forward(self, x):
            return self.p(x) + self.p.weight.sum()

    torch.manual_seed(0)
    mod = Other().eval().requires_grad_(False)
    args = (torch.randn(3, 8),)
    gm = export_flat(mod, args)
    ref = gm(*args)
    assert pretranspose_weights(gm) == 0
    assert count(gm, LINEAR) == 1
    assert pretranspose_weights(gm, shared="copy") == 1
    assert {"p.weight", "p.weight_t"} <= attr_targets(gm)
    assert_outputs_close(gm(*args), ref)


def test_bad_mode():
    gm = export_flat(Small().eval().requires_grad_(False), small_args())
    with pytest.raises(ValueError):
        pretranspose_weights(gm, shared="nope")


# --------------------------------------------------------------------------- tiny models

def tiny_config(kind: str) -> ModelConfig:
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if kind == "qwen2":
        return ModelConfig(**common, attention_bias=True, model_type="qwen2", tie_word_embeddings=True)
    return ModelConfig(**common)


def tiny_model(kind: str, seed: int = 0):
    cfg = tiny_config(kind)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    if cfg.attention_bias:  # make the biases matter
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_()
    return cfg, model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    return tiny_model(request.param)


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


def linear_weight_names(cfg) -> list[str]:
    names = []
    for i in range(cfg.num_hidden_layers):
        names += [f"model.model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [f"model.model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return names


def test_tiny_model_matches_and_reexports(tiny):
    cfg, model = tiny
    ids, pos, kv = verify_args(cfg, 2, 3)
    gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv))
    L = cfg.num_hidden_layers
    kv_ref = clone_kv(kv)
    ref = gm(ids, pos, *kv_ref)

    assert pretranspose_weights(gm) == 7 * L + 1  # lm_head too (tied or not)
    assert count(gm, LINEAR) == 0
    kv_new = clone_kv(kv)
    assert_outputs_close(gm(ids, pos, *kv_new), ref)
    assert_outputs_close(kv_new, kv_ref)

    names = param_names(gm)
    for w in linear_weight_names(cfg):
        assert w not in names and transposed_name(w) in names
    if cfg.tie_word_embeddings:  # one tensor for embedding and lm_head, stored transposed
        heads = [n for n in names if n.endswith("weight_t") and "layers" not in n]
        assert len(heads) == 1 and gm.get_parameter(heads[0]).shape == (cfg.hidden_size, cfg.vocab_size)
        assert "model.model.embed_tokens.weight" not in names and "model.lm_head.weight" not in names
    else:
        assert "model.lm_head.weight_t" in names and "model.model.embed_tokens.weight" in names
    if cfg.attention_bias:
        assert "model.model.layers.0.self_attn.q_proj.bias" in names

    flat_args = (ids, pos, *clone_kv(kv))
    ep = torch.export.export(gm, flat_args, strict=False)
    assert_outputs_close(ep.module()(*flat_args), ref)
    assert_outputs_close(flat_args[2:], kv_ref)


def test_tiny_model_names_and_tensors_deterministic_across_buckets(tiny):
    cfg, model = tiny
    got = []
    for b, t in ((1, 1), (3, 5)):
        ids, pos, kv = verify_args(cfg, b, t)
        gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv))
        pretranspose_weights(gm)
        got.append(dict(gm.named_parameters(remove_duplicate=False)))
    a, b = got
    assert list(a) == list(b)
    assert sum(n.endswith(".weight_t") for n in a) == 7 * cfg.num_hidden_layers + 1
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_after_fuse_projections(tiny):
    cfg, model = tiny
    ids, pos, kv = verify_args(cfg, 2, 3)
    gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv))
    kv_ref = clone_kv(kv)
    ref = gm(ids, pos, *kv_ref)
    L = cfg.num_hidden_layers
    assert fuse_projections(gm) == 2 * L
    assert pretranspose_weights(gm) == 4 * L + 1
    kv_new = clone_kv(kv)
    assert_outputs_close(gm(ids, pos, *kv_new), ref)
    assert_outputs_close(kv_new, kv_ref)
    assert "model.model.layers.0.self_attn.fused__q_proj__k_proj__v_proj.weight_t" in param_names(gm)
    assert "model.model.layers.1.mlp.fused__gate_proj__up_proj.weight_t" in param_names(gm)


def dynamic_verify(cfg, model, b, t, kv_len=24, seed=0):
    """The VerifyProgram as ``specc.compiler.build_program`` exports it: ``key_positions``
    (length kv_len) last, its length symbolic. Returns (gm, flat args, dynamic_shapes)."""
    ids, pos, kv = verify_args(cfg, b, t, seed)
    keys = torch.arange(kv_len)
    dim = torch.export.Dim("kv_len", min=16, max=MAX_LEN)
    no_kv = (None,) * len(kv)
    gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv, keys), (None, None, no_kv, {0: dim}))
    return gm, (ids, pos, *kv, keys), (None, None, *no_kv, {0: dim})


def run_flat(fn, args):
    """``fn`` on ``args`` with the KV tensors cloned: (outputs, the KV after the call)."""
    ids, pos, *kv, keys = args
    kv = clone_kv(kv)
    return fn(ids, pos, *kv, keys), kv


def test_aot_inductor_round_trip_dynamic_kv_len(tmp_path):
    cfg, model = tiny_model("qwen2", seed=1)  # biases and tied embeddings
    gm, args, dyn = dynamic_verify(cfg, model, 2, 3, seed=1)
    ref = {n: run_flat(gm, args[:-1] + (torch.arange(n),)) for n in (24, 40)}
    assert pretranspose_weights(gm) == 7 * cfg.num_hidden_layers + 1
    for n, (out_ref, kv_ref) in ref.items():  # the transformed graph, eager
        out, kv = run_flat(gm, args[:-1] + (torch.arange(n),))
        assert_outputs_close(out, out_ref)
        assert_outputs_close(kv, kv_ref)

    ep = torch.export.export(gm, args, dynamic_shapes=dyn, strict=False)
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "verify.pt2"),
        inductor_configs={"aot_inductor.package_constants_in_so": False})
    runner = torch._inductor.aoti_load_package(path)
    fqns = runner.get_constant_fqns()
    assert "model.model.layers.0.self_attn.q_proj.weight_t" in fqns
    assert "model.model.layers.0.self_attn.q_proj.bias" in fqns
    assert not any(f.endswith(".weight") and "proj" in f for f in fqns)
    assert not any(f in ("model.model.embed_tokens.weight", "model.lm_head.weight") for f in fqns)
    consts = {**dict(gm.named_parameters(remove_duplicate=False)),
              **dict(gm.named_buffers(remove_duplicate=False))}
    runner.load_constants({f: consts[f] for f in fqns}, check_full_update=True, user_managed=True)

    for n, (out_ref, kv_ref) in ref.items():  # two kv_lens, one package
        out, kv = run_flat(runner, args[:-1] + (torch.arange(n),))
        assert_outputs_close(out, out_ref, atol=1e-4)
        assert_outputs_close(kv, kv_ref, atol=1e-5)
