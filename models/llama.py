"""Llama-family decoder (Llama, SmolLM2, Qwen2) over a static KV cache.

Plain ``nn.Module``s in the gpt-fast style: static shapes, no Python branching on
tensor values, no host syncs, nothing about compilation, buckets or devices. Module
names equal transformers' so an HF safetensors state dict loads as is
(``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
``model.layers.{i}.mlp.{gate,up,down}_proj``, ``model.layers.{i}.input_layernorm``,
``model.layers.{i}.post_attention_layernorm``, ``model.norm``, ``lm_head``).

One forward call = write the K/V of every input token into the cache at its position,
then attend over cache positions ``[0, kv_len)``: key ``j`` is visible to a query at
position ``p`` iff ``j <= p`` (or per an explicit mask, for tree attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache

__all__ = ["ModelConfig", "ModelOutput", "LlamaForCausalLM", "SUPPORTED_MODEL_TYPES", "attention_inputs"]


# --------------------------------------------------------------------------- config

@dataclass(frozen=True)
class _Arch:
    """What differs between the architectures this module implements.

    qkv_bias / o_bias / mlp_bias: None = read from the HF config (``attention_bias``,
    ``mlp_bias``), a bool = fixed by the architecture.
    """

    qkv_bias: bool | None
    o_bias: bool | None
    mlp_bias: bool | None


# model_type -> architecture traits. A new Llama-like architecture (e.g. Gemma 3, which
# also needs norm offsets, an embedding scale, q/k norms and sliding layers) gets a row
# here plus the modules its traits need.
_ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch(qkv_bias=None, o_bias=None, mlp_bias=None),
    "qwen2": _Arch(qkv_bias=True, o_bias=False, mlp_bias=False),
}
SUPPORTED_MODEL_TYPES = tuple(_ARCHITECTURES)
_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Static description of a Llama-family decoder.

    ``rope_scaling`` is None (plain RoPE) or a llama3-style dict with keys
    ``rope_type="llama3"``, ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``. ``attention_bias`` is the q/k/v projection
    bias (True for Qwen2); ``o_proj_bias`` and ``mlp_bias`` are the other Linear biases.
    ``eos_token_ids`` is a tuple (HF configs hold one id or a list).

    Hashable (the dict field is hashed by its items), so it can key caches.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(_unsupported(self.model_type))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        _check_rope_scaling(self.rope_scaling)

    def __hash__(self) -> int:
        vals = tuple(getattr(self, f.name) for f in fields(self))
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in vals))

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """Build from a transformers config (``LlamaConfig``, ``Qwen2Config``, or one
        loaded with ``AutoConfig``).

        Raises:
            ValueError: unsupported ``model_type`` (the message lists the supported ones),
                unsupported RoPE type, activation other than SiLU, partial rotary, or
                Qwen2 sliding-window layers.
        """
        model_type = getattr(hf_config, "model_type", None)
        arch = _ARCHITECTURES.get(model_type)
        if arch is None:
            raise ValueError(_unsupported(model_type))
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{model_type}: hidden_act={act!r} is not supported (only 'silu')")
        layer_types = getattr(hf_config, "layer_types", None) or ()
        if getattr(hf_config, "use_sliding_window", False) or any(
                t != "full_attention" for t in layer_types):
            raise ValueError(f"{model_type}: sliding-window attention layers are not supported")

        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        theta, scaling = _rope_from_hf(hf_config)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias if arch.qkv_bias is None else arch.qkv_bias,
            o_proj_bias=attention_bias if arch.o_bias is None else arch.o_bias,
            mlp_bias=mlp_bias if arch.mlp_bias is None else arch.mlp_bias,
            model_type=model_type,
            max_position_embeddings=int(hf_config.max_position_embeddings),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=tuple(int(i) for i in eos_ids),
        )


def _unsupported(model_type) -> str:
    return (f"model_type {model_type!r} is not supported by specc.models.llama; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def _rope_from_hf(hf_config) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from an HF config, old (``rope_theta`` +
    ``rope_scaling``) or transformers-5 (``rope_parameters``) style."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in params]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {missing}")
        return theta, {"rope_type": "llama3", **{k: params[k] for k in keys}}
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` float32, as transformers computes
    them (default and llama3 types)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None or s.get("rope_type", s.get("type")) == "default":
        return inv_freq
    # llama3 (Llama 3.1): long wavelengths divided by `factor`, short ones kept, the band
    # between them interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# --------------------------------------------------------------------------- modules

@dataclass
class ModelOutput:
    """Result of ``LlamaForCausalLM.forward``.

    logits: ``[B, T, vocab_size]`` float32.
    hidden_states: ``{i: [B, T, hidden_size]}`` in the model dtype, for each requested
        index (0 = embedding output, i = output of decoder layer i-1, before the final norm).
    """

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class RMSNorm(nn.Module):
    """RMS norm computed in float32, as in transformers (weight applied after the cast back)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of RoPE for given absolute positions (HF ``rotate_half`` convention).

    ``inv_freq`` ``[head_dim // 2]`` is a non-persistent float32 buffer; it follows device
    moves but stays float32 when the model is cast to a lower dtype.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def reset_inv_freq(self, device: torch.device | str | None = None) -> None:
        """Recompute ``inv_freq`` (after building the model on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(device or "cpu")

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        out = super()._apply(fn, recurse)
        if inv_freq.dtype == torch.float32 and self.inv_freq.dtype != torch.float32:
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return out

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[B, T]`` int64 -> (cos, sin), each ``[B, T, head_dim]`` in ``dtype``."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                        # [B, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, T, D]``; cos, sin ``[B, T, D]``."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query self-attention that writes K/V into the cache, then reads it.

    ``in_features``: width of the input ``x`` (default ``hidden_size``; EAGLE-3's draft
    layer attends over ``[embedding; feature]``, ``2 * hidden_size``). The output is
    always ``hidden_size`` wide.
    """

    def __init__(self, config: ModelConfig, in_features: int | None = None) -> None:
        super().__init__()
        h, kvh, d, hid = (config.num_attention_heads, config.num_key_value_heads,
                          config.head_dim, config.hidden_size)
        inp = hid if in_features is None else in_features
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(inp, h * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(inp, kvh * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(inp, kvh * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * d, hid, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,            # [B, T, hidden]
        cos: torch.Tensor,          # [B, T, D]
        sin: torch.Tensor,          # [B, T, D]
        write_index: torch.Tensor,  # [B, KVH, T, D] int64: positions broadcast for scatter_
        k_cache: torch.Tensor,      # [B, KVH, S_max, D], written in place
        v_cache: torch.Tensor,      # [B, KVH, S_max, D], written in place
        mask: torch.Tensor,         # [B, 1, T, kv_len] bool, True = visible
        kv_len: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        k_cache.scatter_(2, write_index, k)
        v_cache.scatter_(2, write_index, v)
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hid, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hid, inter, bias=bias)
        self.up_proj = nn.Linear(hid, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hid, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, write_index, k_cache, v_cache, mask, kv_len) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, write_index,
                               k_cache, v_cache, mask, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_inputs(config: ModelConfig, positions: torch.Tensor, kv_len: int,
                     attn_mask: torch.Tensor | None = None,
                     cache_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What every decoder layer of a forward over ``positions`` ``[B, T]`` int64 shares:

    * ``write_index`` ``[B, KVH, T, D]`` int64, the K/V write positions broadcast for the
      scatter: ``cache_positions`` ``[B, T]`` when given (tree verify: one slot per node
      while siblings share a RoPE position), else ``positions``;
    * ``mask`` ``[B, 1, T, kv_len]`` bool, True = key visible: ``attn_mask[:, None]``
      when given (``[B, T, kv_len]``), else causal by position (key ``j`` visible to a
      query at position ``p`` iff ``j <= p``).
    """
    b, t = positions.shape
    where = positions if cache_positions is None else cache_positions
    write_index = where[:, None, :, None].expand(b, config.num_key_value_heads, t, config.head_dim)
    if attn_mask is None:
        key_pos = torch.arange(kv_len, device=positions.device)
        attn_mask = key_pos[None, None, :] <= positions[:, :, None]        # [B, T, kv_len]
    return write_index, attn_mask[:, None]


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's ``model.*`` submodule)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a static ``KVCache``.

    Build with random weights as ``LlamaForCausalLM(config)``, or from an HF state dict
    with ``LlamaForCausalLM.from_state_dict(config, state_dict, dtype=..., device=...)``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "LlamaForCausalLM":
        """Model holding the weights of an HF-named state dict, in eval mode, grads off.

        Built on the meta device (no random init), weights cast to ``dtype`` and moved to
        ``device``. With tied embeddings ``lm_head.weight`` may be absent (it is then the
        embedding matrix). Raises ValueError naming missing or unexpected keys.
        """
        with torch.device("meta"):
            model = cls(config)
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"state dict does not match {config.model_type} model: "
                             f"missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary_emb.reset_inv_freq(device)
        return model.eval().requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        *,
        attn_mask: torch.Tensor | None = None,
        cache_positions: torch.Tensor | None = None,
        kv_len: int | None = None,
        num_layers: int | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> ModelOutput:
        """Write K/V of ``input_ids`` into ``kv_cache`` at ``positions``, attend, score.

        Args:
            input_ids: ``[B, T]`` int64 token ids.
            positions: ``[B, T]`` int64 absolute position of each token: RoPE angle and
                K/V write index along the cache's position dim. Padding tokens carry
                ``kv_cache.trash_pos``.
            kv_cache: a ``KVCache`` with exactly B slots (``cache.rows(B)``), written in place.
            attn_mask: optional ``[B, T, kv_len]`` bool, True = key visible to the query
                (tree attention). Default: key ``j`` visible iff ``j <= positions[b, t]``.
                Every row must see at least one key (a fully masked row gives NaN, which
                would then be written at its position).
            cache_positions: optional ``[B, T]`` int64 K/V write positions when they differ
                from ``positions`` (tree verify: siblings share a RoPE position, each node
                has its own cache slot). Default: ``positions``.
            kv_len: attend over cache positions ``[0, kv_len)`` (a Python int, static);
                None = the whole cache (``max_model_len + 1``).
            num_layers: run only the first N decoder layers, then the final norm and
                ``lm_head`` (early-exit self-draft). None = all layers.
            hidden_layers: indices of hidden states to return (HF numbering: 0 =
                embedding output, i = output of decoder layer i-1, before the final norm).

        Returns:
            ``ModelOutput`` with ``logits`` ``[B, T, vocab]`` float32 and
            ``hidden_states`` ``{i: [B, T, hidden]}``.

        Raises:
            ValueError: shape/dtype mismatches, ``kv_cache`` slots != B, ``kv_len`` or
                ``num_layers`` out of range, a ``hidden_layers`` index beyond the layers run.
        """
        cfg = self.config
        n_run = cfg.num_hidden_layers if num_layers is None else num_layers
        kv_len = kv_cache.max_len if kv_len is None else kv_len
        self._check_args(input_ids, positions, kv_cache, attn_mask, cache_positions, kv_len, n_run, hidden_layers)

        x = self.model.embed_tokens(input_ids)                              # [B, T, hidden]
        cos, sin = self.model.rotary_emb(positions, x.dtype)                # [B, T, D] each
        write_index, mask = attention_inputs(cfg, positions, kv_len, attn_mask, cache_positions)

        hidden: dict[int, torch.Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x
        for i in range(n_run):
            x = self.model.layers[i](x, cos, sin, write_index, kv_cache.k[i], kv_cache.v[i],
                                     mask, kv_len)
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        logits = self.lm_head(self.model.norm(x)).float()
        return ModelOutput(logits=logits, hidden_states=hidden)

    def _check_args(self, input_ids, positions, kv_cache, attn_mask, cache_positions, kv_len, n_run, hidden_layers):
        """Static (shape/int) checks only: nothing here reads tensor values."""
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions "
                             f"{tuple(positions.shape)} must both be [B, T]")
        if input_ids.dtype != torch.int64 or positions.dtype != torch.int64:
            raise ValueError(f"input_ids/positions must be int64, got {input_ids.dtype}/{positions.dtype}")
        b, t = input_ids.shape
        if kv_cache.num_slots != b:
            raise ValueError(f"kv_cache has {kv_cache.num_slots} slots for a batch of {b}: "
                             f"pass cache.rows({b})")
        if not 1 <= n_run <= self.config.num_hidden_layers or n_run > kv_cache.num_layers:
            raise ValueError(f"num_layers={n_run} out of range [1, {self.config.num_hidden_layers}] "
                             f"(cache has {kv_cache.num_layers} layers)")
        if not 1 <= kv_len <= kv_cache.max_len:
            raise ValueError(f"kv_len={kv_len} out of range [1, {kv_cache.max_len}]")
        bad = [i for i in hidden_layers if not 0 <= i <= n_run]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range [0, {n_run}] for {n_run} layers run")
        if cache_positions is not None and (cache_positions.shape != (b, t) or cache_positions.dtype != torch.int64):
            raise ValueError(f"cache_positions must be int64 [B, T]=[{b}, {t}], "
                             f"got {cache_positions.dtype} {tuple(cache_positions.shape)}")
        if attn_mask is not None and (attn_mask.shape != (b, t, kv_len) or attn_mask.dtype != torch.bool):
            raise ValueError(f"attn_mask must be bool [B, T, kv_len]=[{b}, {t}, {kv_len}], "
                             f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
