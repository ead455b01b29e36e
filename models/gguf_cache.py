"""GGUF -> HF safetensors folder, converted once and cached by content hash.

``hf_folder_for_gguf(path)`` returns ``<cache_dir>/gguf/<sha256[:16]>/`` holding
``config.json``, ``model.safetensors``, the tokenizer files and ``specc_source.json``.
The first call dequantizes the GGUF through transformers' GGUF reader (float32) and
writes the folder atomically (temp folder beside it, then ``os.replace``), so a
half-written folder never counts as a hit. Later calls find the folder and convert nothing.

``cache_dir`` is ``$SPECC_CACHE_DIR`` or ``~/.cache/specc``. File hashes are memoised
by (path, size, mtime) in ``<cache_dir>/hashes.json`` so a repeat costs a ``stat``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "file_sha256", "hf_folder_for_gguf", "convert_gguf_to_hf"]

_HASH_CHUNK = 1 << 22


def cache_dir() -> Path:
    """specc's cache root: ``$SPECC_CACHE_DIR`` if set, else ``~/.cache/specc``."""
    env = os.environ.get("SPECC_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specc"


def _log(msg: str) -> None:
    print(f"specc: {msg}", file=sys.stderr, flush=True)


def _memo_path() -> Path:
    return cache_dir() / "hashes.json"


def _read_memo() -> dict:
    try:
        return json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's content, memoised by (resolved path, size, mtime_ns).

    Raises FileNotFoundError if the file does not exist. A memo that cannot be written
    (read-only cache dir) only costs a rehash next time.
    """
    p = Path(path).resolve()
    st = p.stat()
    key = str(p)
    memo = _read_memo()
    hit = memo.get(key)
    if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return hit["sha256"]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    memo = {k: v for k, v in _read_memo().items() if Path(k).exists()}  # drop dead paths
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        _write_json_atomic(_memo_path(), memo)
    except OSError:
        pass
    return digest


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` to float32 through transformers and save an HF folder
    (``config.json``, ``model.safetensors``, tokenizer files) into ``out_dir`` (existing).

    transformers' own GGUF reader does the work (tensor renaming, un-permuting q/k,
    dequantization, config and tokenizer from the metadata). It is called directly rather
    than through ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``, which in
    transformers 5 requires ``accelerate`` and may keep weights packed.

    Raises ValueError naming the file if transformers cannot read it (unsupported
    architecture or quantization) or its tensors do not match the architecture.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with torch.device("meta"):  # only for the tensor-name mapping: no memory, no init
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True,
                                       model_to_load=skeleton, torch_dtype=torch.float32)["tensors"]
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"transformers could not convert {gguf_path}: {e}") from e
    expected = set(skeleton.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(tensors), set(tensors) - set(skeleton.state_dict())
    if missing or unexpected:
        raise ValueError(f"{gguf_path}: GGUF tensors do not match {config.model_type}: "
                         f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    # A plain float32 checkpoint: no GGUF quantizer settings may leak into config.json.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)


def hf_folder_for_gguf(gguf_path: str | os.PathLike) -> Path:
    """The cached HF folder for a GGUF file, converting it on the first call.

    Returns ``<cache_dir>/gguf/<sha256[:16]>/``. Prints one line to stderr saying whether
    it converted or hit the cache. Raises FileNotFoundError for a missing file.
    """
    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    digest = file_sha256(src)
    root = cache_dir() / "gguf"
    target = root / digest[:16]
    if (target / "config.json").is_file():
        _log(f"using cached conversion of {src.name} in {target}")
        return target

    _log(f"converting {src.name} to safetensors (once) into {target} ...")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{digest[:16]}-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        convert_gguf_to_hf(src, tmp)
        _write_json_atomic(tmp / "specc_source.json", {
            "gguf_file": src.name, "gguf_sha256": digest, **_versions()})
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real error
                raise
            _log(f"another process converted {src.name} first; using {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _versions() -> dict[str, str]:
    import torch
    import transformers
    return {"transformers": transformers.__version__, "torch": torch.__version__}
