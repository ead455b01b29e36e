"""EAGLE / EAGLE-3 heads (specc.models.eagle, eagle3, eagle_checkpoint): shapes, the
published checkpoint layouts, round trip, refused checkpoints, and the head's math
against a plain-torch reference written from the layouts' key names."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eagle_checkpoints import read_tensors, write_eagle3_checkpoint, write_eagle_checkpoint
from specc.models.eagle import EagleHead
from specc.models.eagle3 import Eagle3Head
from specc.models.eagle_checkpoint import load_eagle_head, save_eagle_head
from specc.models.loader import load_model


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir).model


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, target):
    return write_eagle_checkpoint(tmp_path_factory.mktemp("eagle"), target.config)


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, target):
    return write_eagle3_checkpoint(tmp_path_factory.mktemp("eagle3"), target.config, layer_ids=[0, 1, 2])


def _pairs(target, head, n: int = 7, seed: int = 0):
    """Random tokens ``[1, n]``, positions ``0..n-1`` and fused target features of a
    direct target forward over them."""
    from specc.models.kv_cache import KVCache

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, n + 1), generator=g)
    pos = torch.arange(n)[None]
    cache = KVCache.for_model(target.config, 1, 64)
    out = target(ids[:, :n], pos, cache, hidden_layers=head.hidden_layers)
    hidden = torch.stack([out.hidden_states[i] for i in head.hidden_layers], dim=2)
    return ids[:, 1:], pos, head.fuse(hidden), hidden


# ------------------------------------------------------------------------------ shapes
def test_head_shapes(target, eagle_dir, eagle3_dir):
    c = target.config
    h1 = load_eagle_head(eagle_dir, target)
    h3 = load_eagle_head(eagle3_dir, target)
    assert isinstance(h1, EagleHead) and isinstance(h3, Eagle3Head)
    assert h1.hidden_layers == (c.num_hidden_layers,) and h3.hidden_layers == (0, 1, 2)
    for head in (h1, h3):
        ids, pos, feats, hidden = _pairs(target, head)
        assert hidden.shape == (1, 7, len(head.hidden_layers), c.hidden_size)
        assert feats.shape == (1, 7, c.hidden_size)
        cache = head.make_cache(1, 64)
        assert cache.num_layers == 1 and cache.head_dim == c.head_dim
        out = head(ids, feats, pos, cache, kv_len=7)
        assert out.shape == (1, 7, c.hidden_size) and out.dtype == torch.float32
        logits = head.compute_logits(out[:, -1])
        assert logits.shape == (1, c.vocab_size) and logits.dtype == torch.float32
    # EAGLE-3 scores only its draft vocabulary: -inf elsewhere, finite exactly where t2d marks
    logits = h3.compute_logits(torch.randn(2, c.hidden_size))
    assert torch.equal(torch.isfinite(logits[0]), h3.t2d)
    assert h3.draft_vocab_size == 512


def test_heads_share_target_modules(target, eagle_dir, eagle3_dir):
    for head in (load_eagle_head(eagle_dir, target), load_eagle_head(eagle3_dir, target)):
        names = set(head.state_dict())
        assert not any("embed_tokens" in n for n in names)  # shared, not copied
        assert head.target.embed_tokens is target.model.embed_tokens
    assert "lm_head.weight" not in load_eagle_head(eagle_dir, target).state_dict()  # EAGLE: the target's


# ------------------------------------------------------------------------------ reference math
def _rope(x, pos, theta):
    """HF rotate-half RoPE; x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    f = pos[:, None].float() * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _ref_layer(w, p, x_attn, residual, c):
    """One Llama layer from checkpoint tensors ``w`` with prefix ``p``: attention reads
    ``x_attn`` [T, in] (already normed as the layout says), adds ``residual``."""
    t, d, nh, kvh = x_attn.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
    pos = torch.arange(t)
    q = _rope((x_attn @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d), pos, c.rope_theta)
    k = _rope((x_attn @ w[p + "self_attn.k_proj.weight"].T).view(t, kvh, d), pos, c.rope_theta)
    v = (x_attn @ w[p + "self_attn.v_proj.weight"].T).view(t, kvh, d)
    k, v = k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, nh * d)
    x = residual + a @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
    mlp = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T))
    return x + mlp @ w[p + "mlp.down_proj.weight"].T


def test_eagle_head_matches_reference(target, eagle_dir):
    """EAGLE: feature = target's final norm of its last layer; fc over [embedding; feature]
    (+ bias); layer 0 without input norm; the target's lm_head, no head norm."""
    head = load_eagle_head(eagle_dir, target)
    w, c = read_tensors(eagle_dir), target.config
    ids, pos, feats, hidden = _pairs(target, head)
    f = _rms(hidden[0, :, 0], target.model.norm.weight, c.rms_norm_eps)
    assert torch.allclose(feats[0], f, atol=1e-5)
    emb = target.model.embed_tokens(ids[0])
    x = torch.cat([emb, f], -1) @ w["fc.weight"].T + w["fc.bias"]
    ref = target.lm_head(_ref_layer(w, "layers.0.", x, x, c))
    out = head(ids, feats, pos, head.make_cache(1, 64), kv_len=7)
    assert torch.allclose(head.compute_logits(out)[0], ref, atol=1e-4)


def test_eagle3_head_matches_reference(target, eagle3_dir):
    """EAGLE-3: fc over the concatenated layer states; attention over
    [input_layernorm(embedding); hidden_norm(feature)] with the feature as residual; own
    norm + lm_head over the draft vocabulary, placed at target ids d + d2t[d]."""
    head = load_eagle_head(eagle3_dir, target)
    w, c = read_tensors(eagle3_dir), target.config
    ids, pos, feats, hidden = _pairs(target, head)
    f = hidden[0].reshape(7, -1) @ w["fc.weight"].T
    assert torch.allclose(feats[0], f, atol=1e-5)
    emb = target.model.embed_tokens(ids[0])
    eps = c.rms_norm_eps
    x = torch.cat([_rms(emb, w["midlayer.input_layernorm.weight"], eps),
                   _rms(f, w["midlayer.hidden_norm.weight"], eps)], -1)
    out_ref = _ref_layer(w, "midlayer.", x, f, c)
    draft = _rms(out_ref, w["norm.weight"], eps) @ w["lm_head.weight"].T       # [T, V_draft]
    out = head(ids, feats, pos, head.make_cache(1, 64), kv_len=7)
    assert torch.allclose(out[0], out_ref, atol=1e-4)
    logits = head.compute_logits(out)[0]
    target_ids = torch.arange(512) + w["d2t"]
    assert torch.allclose(logits[:, target_ids], draft, atol=1e-4)
    assert torch.isinf(logits[:, ~w["t2d"]]).all()


# ------------------------------------------------------------------------------ layouts
def test_eagle_layout_variants(tmp_path, target):
    c = target.config
    # no fc.bias, config "bias": false (EAGLE repo's key)
    d = write_eagle_checkpoint(tmp_path / "nobias", target.config, bias=False, write_bias_key=True)
    h = load_eagle_head(d, target)
    assert h.fc.bias is None
    # an embed_tokens copy equal to the target's is dropped (shared)
    emb = target.model.embed_tokens.weight.detach().clone()
    h = load_eagle_head(write_eagle_checkpoint(tmp_path / "emb", target.config, embed=emb), target)
    assert h.embed_tokens is None
    # a different one is kept as the head's own
    h = load_eagle_head(write_eagle_checkpoint(tmp_path / "own", target.config, embed=emb + 1), target)
    assert torch.equal(h.embed(torch.tensor([[3]]))[0, 0], emb[3] + 1)
    assert h.config.num_hidden_layers == 1 and h.config.hidden_size == c.hidden_size


def test_eagle3_layer_ids(tmp_path, target):
    # eagle_config.eagle_aux_hidden_state_layer_ids, any order -> increasing (vLLM's collection order)
    d = write_eagle3_checkpoint(tmp_path / "cfg", target.config, layer_ids=[2, 0, 1], in_eagle_config=True)
    assert load_eagle_head(d, target).hidden_layers == (0, 1, 2)
    # the config field overrides the checkpoint
    assert load_eagle_head(d, target, layer_ids=[0, 2, 1]).hidden_layers == (0, 1, 2)
    # vLLM's default (2, L//2, L-3) does not fit a 2-layer target: a clear error
    d = write_eagle3_checkpoint(tmp_path / "none", target.config)
    with pytest.raises(ValueError, match=r"default layers.*outside \[0, 2\].*eagle_aux_hidden_state_layer_ids"):
        load_eagle_head(d, target)
    with pytest.raises(ValueError, match=r"2 layer ids, but fc.weight \(64, 192\) takes 192 = 3 x hidden_size"):
        load_eagle_head(d, target, layer_ids=[0, 1])
    with pytest.raises(ValueError, match="repeat a layer"):
        load_eagle_head(d, target, layer_ids=[1, 1, 2])


def test_default_layer_ids():
    from specc.models.eagle3 import default_layer_ids
    assert default_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_layer_ids(32) == (2, 16, 29)  # Llama-3-8B


# ------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_round_trip(tmp_path, target, eagle_dir, eagle3_dir, kind):
    src = eagle_dir if kind == "eagle" else eagle3_dir
    head = load_eagle_head(src, target)
    out = save_eagle_head(head, tmp_path / "saved")
    back = load_eagle_head(out, target, method=kind)
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() == read_tensors(src).keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert back.hidden_layers == head.hidden_layers
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == target.config.hidden_size


# ------------------------------------------------------------------------------ refused
def _rewrite(folder, drop=(), replace=None):
    from safetensors.torch import save_file
    sd = read_tensors(folder)
    for k in drop:
        sd.pop(k)
    sd.update(replace or {})
    save_file(sd, str(folder / "model.safetensors"))


def test_missing_key_listed(tmp_path, target):
    d = write_eagle_checkpoint(tmp_path / "e", target.config)
    _rewrite(d, drop=["layers.0.mlp.up_proj.weight", "fc.bias"], replace={"layers.0.extra": torch.zeros(1)})
    (d / "config.json").write_text((d / "config.json").read_text().replace('"vocab_size"', '"bias": true, "vocab_size"'))
    with pytest.raises(ValueError, match=r"missing keys \['fc.bias', 'layers.0.mlp.up_proj.weight'\].*"
                                         r"unexpected keys \['layers.0.extra'\]"):
        load_eagle_head(d, target)


def test_wrong_shape_names_key_and_shapes(tmp_path, target):
    d = write_eagle3_checkpoint(tmp_path / "e3", target.config, layer_ids=[0, 1, 2])
    _rewrite(d, replace={"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"midlayer.self_attn.q_proj.weight: checkpoint \(64, 64\), "
                                         r"expected \(64, 128\)"):
        load_eagle_head(d, target)


def test_pickle_only_refused_with_conversion(tmp_path, target):
    d = write_eagle_checkpoint(tmp_path / "e", target.config)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model.bin\).*never unpickles.*"
                                         r"save_file\(torch.load\('pytorch_model.bin'"):
        load_eagle_head(d, target)


def test_hidden_size_and_kind_mismatch(tmp_path, target, eagle3_dir):
    d = write_eagle_checkpoint(tmp_path / "e", target.config)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128, "head_dim": 16}))
    with pytest.raises(ValueError, match="hidden_size 128 differs from the target's 64"):
        load_eagle_head(d, target)
    with pytest.raises(ValueError, match="holds an EAGLE-3 head.*set speculative_config.method: eagle3"):
        load_eagle_head(eagle3_dir, target, method="eagle")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_eagle_head(tmp_path / "nope", target)


def test_inconsistent_d2t_refused(tmp_path, target):
    d = write_eagle3_checkpoint(tmp_path / "e3", target.config, layer_ids=[0, 1, 2])
    d2t = read_tensors(d)["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft id 1 -> the target id of draft id 0
    _rewrite(d, replace={"d2t": d2t})
    with pytest.raises(ValueError, match="d2t maps two draft ids to the same target id"):
        load_eagle_head(d, target)
