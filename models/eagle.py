"""EAGLE draft heads: what they share, and the EAGLE (EAGLE-1/2) head itself.

An EAGLE head drafts from the target's *features* (hidden states) rather than from tokens
alone: at position ``p`` it takes the pair (target feature ``f_p``, embedding of the next
token ``x_{p+1}``), runs one decoder layer over those pairs with its own KV cache, and
its output both predicts ``x_{p+2}`` (through a vocabulary projection) and stands in for
the target's next feature ``f_{p+1}`` at the next draft step.

* EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty"; the same heads serve EAGLE-2's dynamic trees): the feature is the target's
  last hidden state after its final norm (the input of its ``lm_head``);
  ``fc: Linear(2 * hidden -> hidden)`` over ``[embedding; feature]``, then Llama decoder
  layers (layer 0 without ``input_layernorm``), then the target's own ``lm_head``.
* EAGLE-3 (Li et al. 2025): :mod:`specc.models.eagle3`.

Both heads share the target's embedding (and EAGLE its ``lm_head`` and final norm) by
reference: they are not submodules of the head, so the head's ``state_dict`` holds
exactly the checkpoint's tensors and moving the head never moves the target. Checkpoint
I/O (the published layouts): :mod:`specc.models.eagle_checkpoint`.

A head never sees raw target hidden states in its layers: :meth:`EagleHeadBase.fuse`
turns the states of the target layers it reads (:attr:`EagleHeadBase.hidden_layers`,
HF numbering: 0 = embeddings, ``i`` = output of decoder layer ``i - 1`` before the final
norm) into ``hidden``-wide features once, when the target hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .kv_cache import KVCache
from .llama import DecoderLayer, LlamaForCausalLM, ModelConfig, RMSNorm, RotaryEmbedding, attention_inputs

__all__ = ["EagleHeadBase", "EagleHead", "TargetParts"]


@dataclass(frozen=True)
class TargetParts:
    """The target modules a head uses by reference (never copied, never registered)."""

    embed_tokens: nn.Embedding  # [V, hidden]
    norm: RMSNorm               # the target's final norm
    lm_head: nn.Linear          # [V, hidden]
    num_layers: int             # the target's decoder layers

    @classmethod
    def of(cls, target: LlamaForCausalLM) -> "TargetParts":
        return cls(target.model.embed_tokens, target.model.norm, target.lm_head,
                   target.config.num_hidden_layers)


class EagleHeadBase(nn.Module):
    """What every EAGLE head does: embed the next tokens, run its layers over
    ``(token, feature)`` pairs with its own KV cache, project features to target logits.

    Subclasses set ``method`` (the ``speculative_config.method`` name), build their
    layers, and implement :meth:`fuse`, :meth:`_run_layers` and :meth:`compute_logits`.

    Args:
        config: the head's own decoder config (``hidden_size`` equals the target's).
        target: the target model whose embedding the head reads.
        hidden_layers: the target hidden states :meth:`fuse` takes (HF numbering).
    """

    method: str = ""

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, hidden_layers: tuple[int, ...]):
        super().__init__()
        self.config = config
        self.hidden_layers = tuple(hidden_layers)
        self.rotary_emb = RotaryEmbedding(config)
        self.embed_tokens: nn.Embedding | None = None  # set only for a head with its own embedding
        self._target = TargetParts.of(target)

    @property
    def target(self) -> TargetParts:
        return self._target

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` int64 -> ``[B, T, hidden]``: the head's own embedding if its checkpoint
        brought a different one, else the target's."""
        emb = self.embed_tokens if self.embed_tokens is not None else self._target.embed_tokens
        return emb(input_ids)

    def make_cache(self, num_slots: int, max_model_len: int) -> KVCache:
        """A KV cache for this head's layers, in its dtype and on its device."""
        w = self.fc.weight
        return KVCache.for_model(self.config, num_slots, max_model_len, w.dtype, w.device)

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, len(hidden_layers), hidden]`` target states -> ``[B, T, hidden]`` features."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` head outputs -> ``[..., V_target]`` float32 logits over the
        target's vocabulary (``-inf`` for tokens the head cannot propose)."""
        raise NotImplementedError

    def _run_layers(self, emb, features, cos, sin, write_index, kv_cache, mask, kv_len) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        *,
        kv_len: int | None = None,
        attn_mask: torch.Tensor | None = None,
        cache_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the head over ``(feature, token)`` pairs; write its K/V at ``positions``.

        Args:
            input_ids: ``[B, T]`` int64, token ``x_{p+1}`` of the pair at position ``p``.
            features: ``[B, T, hidden]``: ``fuse``d target features, or the head's own
                outputs from the previous draft step.
            positions: ``[B, T]`` int64; padding at ``kv_cache.trash_pos``.
            kv_cache: the head's cache (``make_cache``), exactly B slots.
            kv_len: attend over cache positions ``[0, kv_len)`` (None = whole cache).
            attn_mask: optional ``[B, T, kv_len]`` bool (tree attention); default causal.
            cache_positions: optional ``[B, T]`` int64 K/V write positions when they
                differ from ``positions`` (tree drafting: siblings share a RoPE position
                but not a cache slot); default ``positions``.

        Returns:
            ``[B, T, hidden]`` head outputs (model dtype): the next features; feed
            :meth:`compute_logits` for the next token's logits.

        Raises:
            ValueError: shapes that do not match, or a cache with other than B slots.
        """
        b, t = input_ids.shape
        if positions.shape != (b, t) or features.shape != (b, t, self.config.hidden_size):
            raise ValueError(f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and "
                             f"features {tuple(features.shape)} must be [B, T], [B, T] and "
                             f"[B, T, {self.config.hidden_size}]")
        if kv_cache.num_slots != b:
            raise ValueError(f"kv_cache has {kv_cache.num_slots} slots for a batch of {b}: pass cache.rows({b})")
        kv_len = kv_cache.max_len if kv_len is None else kv_len
        emb = self.embed(input_ids).to(features.dtype)
        cos, sin = self.rotary_emb(positions, features.dtype)
        write_index, mask = attention_inputs(self.config, positions, kv_len, attn_mask, cache_positions)
        return self._run_layers(emb, features, cos, sin, write_index, kv_cache, mask, kv_len)


class EagleHead(EagleHeadBase):
    """The EAGLE head (Li et al. 2024): ``fc([embedding; feature])`` -> Llama decoder
    layers (layer 0 has no ``input_layernorm``) -> the target's ``lm_head``.

    The feature is the target's last hidden state after its final norm, i.e. what its
    ``lm_head`` reads; the head's output lives in the same space and goes straight into
    the target's ``lm_head`` (no norm of its own).

    Parameters (the published layout, ``state_dict`` keys): ``fc.weight`` ``[H, 2H]``,
    ``fc.bias`` ``[H]`` (EAGLE-1 heads; absent when trained with ``bias: false``),
    ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``layers.{i}.post_attention_layernorm.weight`` and, for ``i >= 1``,
    ``layers.{i}.input_layernorm.weight``.
    """

    method = "eagle"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, *, fc_bias: bool = True):
        super().__init__(config, target, hidden_layers=(target.config.num_hidden_layers,))
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output unnormed

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self._target.norm(target_hidden[:, :, 0])

    def _run_layers(self, emb, features, cos, sin, write_index, kv_cache, mask, kv_len):
        x = self.fc(torch.cat([emb, features], dim=-1))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, write_index, kv_cache.k[i], kv_cache.v[i], mask, kv_len)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target.lm_head(hidden).float()
