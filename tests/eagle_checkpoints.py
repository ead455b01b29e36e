"""Synthetic EAGLE / EAGLE-3 checkpoints in the published layouts, for tests.

The tensors are written by key name and shape from the layouts themselves (SafeAILab/EAGLE
``cnets1.py`` / ``cnets.py``, vLLM ``llama_eagle.py`` / ``llama_eagle3.py``), never from
specc's modules, so loading them proves key-name compatibility. Random weights, N(0, std).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HEAD_INTERMEDIATE = 96  # the head's MLP width (free: a head need not match the target's)


def head_config(target_config, **extra) -> dict:
    """A Llama ``config.json`` for a one-layer head over ``target_config`` (a ModelConfig)."""
    c = target_config
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": HEAD_INTERMEDIATE, "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "pad_token_id": None,
        **extra,
    }


def _attn_mlp(prefix: str, c, in_features: int, g: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    h, d = c.hidden_size, c.head_dim
    shapes = {
        "self_attn.q_proj.weight": (c.num_attention_heads * d, in_features),
        "self_attn.k_proj.weight": (c.num_key_value_heads * d, in_features),
        "self_attn.v_proj.weight": (c.num_key_value_heads * d, in_features),
        "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
        "mlp.gate_proj.weight": (HEAD_INTERMEDIATE, h),
        "mlp.up_proj.weight": (HEAD_INTERMEDIATE, h),
        "mlp.down_proj.weight": (h, HEAD_INTERMEDIATE),
    }
    return {f"{prefix}{k}": torch.randn(s, generator=g) * std for k, s in shapes.items()}


def _norm(h: int, g: torch.Generator) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(h, generator=g)


def write_eagle_checkpoint(folder: Path, config, *, bias: bool = True, write_bias_key: bool = False,
                           embed: torch.Tensor | None = None, seed: int = 0, std: float = 0.1) -> Path:
    """An EAGLE (EAGLE-1/2) head for a target of ``config`` (a ModelConfig): ``fc.weight``
    [H, 2H] (+ ``fc.bias``), ``layers.0.*`` without ``input_layernorm``; ``embed``: also
    write ``embed_tokens.weight``; ``write_bias_key``: put ``"bias"`` in config.json."""
    c = config
    g = torch.Generator().manual_seed(seed)
    h = c.hidden_size
    sd = {"fc.weight": torch.randn(h, 2 * h, generator=g) * std}
    if bias:
        sd["fc.bias"] = torch.randn(h, generator=g) * std
    sd.update(_attn_mlp("layers.0.", c, h, g, std))
    sd["layers.0.post_attention_layernorm.weight"] = _norm(h, g)
    if embed is not None:
        sd["embed_tokens.weight"] = embed
    extra = {"bias": bias} if write_bias_key else {}
    return _write(folder, sd, head_config(c, **extra))


def write_eagle3_checkpoint(folder: Path, config, *, draft_vocab_size: int = 512, layer_ids=None,
                            in_eagle_config: bool = False, seed: int = 0, std: float = 0.1) -> Path:
    """An EAGLE-3 head for a target of ``config``: ``fc.weight`` [H, 3H], ``midlayer.*`` (q/k/v over 2H),
    ``norm.weight``, ``lm_head.weight`` [draft_vocab_size, H], ``d2t``/``t2d`` for a random
    sorted subset of the target vocabulary; ``layer_ids`` written as vLLM's
    ``eagle_aux_hidden_state_layer_ids`` (top level, or in ``eagle_config``)."""
    c = config
    g = torch.Generator().manual_seed(seed)
    h, v = c.hidden_size, c.vocab_size
    kept = torch.randperm(v, generator=g)[:draft_vocab_size].sort().values   # target ids, increasing
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[kept] = True
    sd = {"fc.weight": torch.randn(h, 3 * h, generator=g) * std}
    sd.update(_attn_mlp("midlayer.", c, 2 * h, g, std))
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        sd[f"midlayer.{name}.weight"] = _norm(h, g)
    sd["norm.weight"] = _norm(h, g)
    sd["lm_head.weight"] = torch.randn(draft_vocab_size, h, generator=g) * 0.5
    sd["d2t"] = kept - torch.arange(draft_vocab_size)
    sd["t2d"] = t2d
    extra = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab_size,
             "target_hidden_size": h}
    if layer_ids is not None:
        key = "eagle_aux_hidden_state_layer_ids"
        extra.update({"eagle_config": {key: list(layer_ids)}} if in_eagle_config else {key: list(layer_ids)})
    return _write(folder, sd, head_config(c, **extra))


def _write(folder: Path, sd: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in sd.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def write_echo_eagle_checkpoint(folder: Path, config, *, scale: float = 0.3, seed: int = 0) -> Path:
    """An EAGLE head that mostly passes the target's feature through (``fc`` = ``[scale *
    random | I]``, attention and MLP outputs scaled by ``scale``), so its first draft is
    mostly the target's own last prediction again. The tiny random targets' greedy output
    repeats tokens often, so such drafts are accepted at times (also at position 2):
    acceptance paths, and catch-ups over several pairs, get exercised with random weights."""
    write_eagle_checkpoint(folder, config, seed=seed)
    sd = read_tensors(folder)
    h = config.hidden_size
    sd["fc.weight"] = torch.cat([sd["fc.weight"][:, :h] * scale, torch.eye(h)], dim=1)
    sd["fc.bias"] = sd["fc.bias"] * scale
    for key in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        sd[key] = sd[key] * scale
    return _write(folder, sd, json.loads((folder / "config.json").read_text()))
