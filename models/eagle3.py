"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test").

EAGLE-3 drops EAGLE's feature regression and fuses three target layers instead of the
last one: the hidden states of a low, a middle and a high layer, concatenated
(``3 * hidden``), are projected by ``fc`` (no bias) to one ``hidden``-wide feature. One
decoder layer (``midlayer``) then attends over ``[input_layernorm(embedding);
hidden_norm(feature)]`` (``2 * hidden`` wide: q/k/v take ``2H`` inputs) with the feature
as the residual; a final ``norm`` and the head's own ``lm_head`` score a reduced *draft
vocabulary* of ``draft_vocab_size`` tokens.

Draft vocabulary (buffers of the published checkpoints):

* ``d2t`` ``[draft_vocab_size]`` int64, an offset: draft id ``d`` is target id
  ``d + d2t[d]``;
* ``t2d`` ``[vocab_size]`` bool: True for the target ids the draft vocabulary holds.

Which target layers: ``eagle_aux_hidden_state_layer_ids`` in the head's config.json (or
its ``eagle_config``), else vLLM's default ``(2, L // 2, L - 3)`` for an L-layer target;
ids use HF numbering (id ``j`` = output of decoder layer ``j - 1``, i.e. the input of
layer ``j``), and the states are concatenated in increasing layer order, as vLLM
collects them. At later draft steps the head's own (pre-norm) output is the feature and
``fc`` is skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from .eagle import EagleHeadBase
from .llama import MLP, Attention, LlamaForCausalLM, ModelConfig, RMSNorm

__all__ = ["Eagle3Head", "Eagle3DecoderLayer", "default_layer_ids"]


def default_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 layers for an L-layer target: ``(2, L // 2, L - 3)``."""
    n = num_target_layers
    return (2, n // 2, n - 3)


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's ``midlayer``: a Llama decoder layer whose attention reads
    ``[input_layernorm(embedding); hidden_norm(feature)]`` and whose residual stream is
    the feature (``norm_before_residual``: the normed feature, a variant vLLM reads from
    the head's config).

    forward(emb ``[B, T, H]``, feature ``[B, T, H]``, cos, sin, write_index, k_cache,
    v_cache, mask, kv_len) -> ``[B, T, H]`` (as :class:`specc.models.llama.DecoderLayer`).
    """

    def __init__(self, config: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = Attention(config, in_features=2 * h)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, emb, feature, cos, sin, write_index, k_cache, v_cache, mask, kv_len) -> torch.Tensor:
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        x = residual + self.self_attn(x, cos, sin, write_index, k_cache, v_cache, mask, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(EagleHeadBase):
    """The EAGLE-3 head (module docstring).

    Args:
        config: the head's decoder config (one layer; ``vocab_size`` = the target's).
        target: the target model (its embedding is shared).
        layer_ids: target hidden states fused by ``fc``, increasing, HF numbering.
        draft_vocab_size: rows of ``lm_head`` (= ``vocab_size`` for a full vocabulary).
        norm_before_residual: see :class:`Eagle3DecoderLayer`.

    Parameters (``state_dict`` keys, the published layout): ``fc.weight``
    ``[H, len(layer_ids) * H]``, ``midlayer.self_attn.{q,k,v}_proj.weight`` ``[*, 2H]``,
    ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
    ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
    ``norm.weight``, ``lm_head.weight`` ``[draft_vocab_size, H]``, ``d2t``, ``t2d``.
    """

    method = "eagle3"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, *, layer_ids: tuple[int, ...],
                 draft_vocab_size: int, norm_before_residual: bool = False):
        super().__init__(config, target, hidden_layers=tuple(layer_ids))
        h = config.hidden_size
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def draft_to_target(self) -> torch.Tensor:
        """``[draft_vocab_size]`` int64: the target id of each draft id (``d + d2t[d]``)."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        b, t, n, h = target_hidden.shape
        return self.fc(target_hidden.reshape(b, t, n * h))

    def _run_layers(self, emb, features, cos, sin, write_index, kv_cache, mask, kv_len):
        return self.midlayer(emb, features, cos, sin, write_index, kv_cache.k[0], kv_cache.v[0], mask, kv_len)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits placed at their target ids; ``-inf`` elsewhere, so the
        softmax (the draft distribution q) is zero outside the draft vocabulary."""
        draft = self.lm_head(self.norm(hidden)).float()                  # [..., V_draft]
        out = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_to_target(), draft)       # [..., V_target]
