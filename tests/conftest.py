"""Shared fixtures: one torch thread, the real SmolLM2-135M target and tiny random-weight models.

* ``one_torch_thread`` (autouse, whole session): see its docstring.
* ``base``: the non-speculative reference session of a test module (tiny Llama).
* ``smollm2_dir``: the embedded SmolLM2-135M-Instruct GGUF converted to an HF folder by
  specc's loader, in the normal cache dir (``$SPECC_CACHE_DIR`` or ``~/.cache/specc``),
  so a run converts at most once.
* ``tiny_llama_dir`` / ``tiny_qwen2_dir``: 2-layer random-weight models (hidden 64,
  4 heads, 2 KV heads) with the SmolLM2 tokenizer (real vocab, chat template, eos/bos),
  saved as safetensors by :func:`helpers.build_tiny_model`. Fast weights for runtime tests
  with a real tokenizer. The weights are scaled so that logits spread widely (std ~4,
  greedy top-2 gaps ~1): greedy ties, which would make equality tests flaky, are
  unlikely. Qwen2 has random q/k/v biases and tied embeddings; Llama has an untied ``lm_head``.
* ``triton_device``: where a ``test_*_triton.py`` runs its Triton side (CUDA, CPU under
  Triton's interpreter, or skip: ``triton_modes.py``).
* ``tiny_eagle_heads``: ``{"eagle": dir, "eagle3": dir}``, random-weight EAGLE / EAGLE-3
  heads for the tiny Llama in the published checkpoint layouts (``eagle_checkpoints.py``);
  the EAGLE-3 head fuses target layers 0, 1, 2 (its config.json says so).

Plain helpers (session builders, greedy params, oracle truth tables, ...) live in
``helpers.py``, the test drafters in ``spec_drafters.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import build_tiny_model, make_session
from specc.session import Session


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Run every test on ONE torch intra-op thread; restore torch's setting afterwards.

    The suite runs on a shared 2-core machine, mostly on tiny models (hidden size 64) whose
    ops are far too small to gain from intra-op parallelism: two torch threads only contend
    with each other and with other processes for the cores (3-4x slower measured). A test
    that needs another thread count (e.g. ``specc bench --threads N``) must put it back."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF folder of the real SmolLM2-135M-Instruct (fp32, dequantized from Q4_1)."""
    from specc.models.loader import resolve_hf_folder
    return resolve_hf_folder("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return build_tiny_model("llama", smollm2_tokenizer, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return build_tiny_model("qwen2", smollm2_tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_eagle_heads(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    from transformers import AutoConfig

    from eagle_checkpoints import write_eagle3_checkpoint, write_eagle_checkpoint
    from specc.models.llama import ModelConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_llama_dir))
    root = tmp_path_factory.mktemp("tiny_eagle_heads")
    return {"eagle": write_eagle_checkpoint(root / "eagle", config),
            "eagle3": write_eagle3_checkpoint(root / "eagle3", config, layer_ids=[0, 1, 2])}


@pytest.fixture(scope="module")
def base(tiny_llama_dir) -> Session:
    """Reference session on the tiny Llama (max_model_len 256, 4 sequences, no drafter),
    one per test module: run it with ``use_speculation=False`` for the non-speculative
    output. A module that needs another configuration defines its own ``base``."""
    return make_session(tiny_llama_dir)


@pytest.fixture
def triton_device(request) -> torch.device:
    """Device the Triton side of a kernel test runs on (CUDA, or CPU via the interpreter),
    else skip (``triton_modes.py``)."""
    from triton_modes import device_or_skip

    return device_or_skip(request.module.__name__)
