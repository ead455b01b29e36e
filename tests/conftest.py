"""Shared fixtures: the real SmolLM2-135M target and tiny random-weight models.

* ``smollm2_dir``: the embedded SmolLM2-135M-Instruct GGUF converted to an HF folder by
  specc's loader, in the normal cache dir (``$SPECC_CACHE_DIR`` or ``~/.cache/specc``),
  so a run converts at most once.
* ``tiny_llama_dir`` / ``tiny_qwen2_dir``: 2-layer random-weight models (hidden 64,
  4 heads, 2 KV heads) with the SmolLM2 tokenizer (real vocab, chat template, eos/bos),
  saved as safetensors. Fast weights for runtime tests with a real tokenizer. The
  weights are scaled so that logits spread widely (std ~4, greedy top-2 gaps ~1):
  greedy ties, which would make equality tests flaky, are unlikely. Qwen2 has random
  q/k/v biases and tied embeddings; Llama has an untied ``lm_head``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
TINY_SEED = 1234


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF folder of the real SmolLM2-135M-Instruct (fp32, dequantized from Q4_1)."""
    from specc.models.loader import resolve_hf_folder
    return resolve_hf_folder("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def build_tiny_model(model_type: str, tokenizer, out_dir: Path, seed: int = TINY_SEED) -> Path:
    """Save a tiny random ``model_type`` ("llama" or "qwen2") with ``tokenizer`` into
    ``out_dir`` (safetensors + config + tokenizer files); returns ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(TINY_DIMS, vocab_size=len(tokenizer), initializer_range=0.1,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if model_type == "llama":
        config, cls = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0), LlamaForCausalLM
    elif model_type == "qwen2":
        config, cls = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=100000.0), Qwen2ForCausalLM
    else:
        raise ValueError(model_type)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
        model.lm_head.weight.normal_(0.0, 0.5)  # tied for qwen2: the embedding too
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return build_tiny_model("llama", smollm2_tokenizer, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return build_tiny_model("qwen2", smollm2_tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))
