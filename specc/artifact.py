"""The artifact folder `specc compile` writes and `Session(DIR)` opens.

Layout (every path relative to the folder)::

    manifest.json          what was built, for what, and the size + sha256 of every file
    weights.safetensors    the constants of every program, one copy (programs bind them at load)
    model/                 the target's HF config.json and tokenizer files
    programs/<name>.pt2    one AOTInductor package per program per bucket
                           (prefill, decode_b1, spec_step_b4, ...)

``manifest.json`` holds: ``format`` (:data:`FORMAT_VERSION`), ``config`` (the full
``SpeccConfig`` as a dict), ``source`` (the config file and target it was built from),
``environment`` (specc, torch, transformers versions, device kind), ``weights_hash``
(sha256 of the target's safetensors, as ``specc.models.loader.weights_hash``),
``draft_hash`` and ``draft_folder`` (an EAGLE artifact: :func:`draft_hash` of the head
folder its programs were built with), ``programs`` (name, kind, batch, tokens, file, input and output signatures, compile
seconds), ``constants`` (name -> stored name, for tied weights stored once) and
``files`` (path -> size, sha256).

Writing is atomic: everything goes to a temporary folder beside the destination, the
manifest last, then one rename. Opening checks, before loading anything: the manifest
parses and has the current format; every listed file exists with its size (a truncated
copy fails here) and, for the small files (programs, tokenizer), its sha256; the
environment matches this process (torch and transformers versions, device kind: the
compiled code targets one CPU instruction set or GPU architecture). A mismatch raises
:class:`ArtifactError` naming what differs and the command that rebuilds it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specc.atomic import atomic_folder
from specc.config import ConfigError

__all__ = [
    "FORMAT_VERSION", "MANIFEST", "ArtifactError", "Artifact", "device_kind", "environment",
    "check_output_dir", "compiled_cache_key", "draft_hash", "model_files_hash", "open_artifact", "source_hash", "write_artifact", "program_config", "program_config_diff", "sha256_file",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
MODEL_DIR = "model"
PROGRAMS_DIR = "programs"
_HASHED_MAX_BYTES = 64 << 20  # files up to this size get their sha256 checked at open


class ArtifactError(ConfigError):
    """An artifact folder that cannot be used: missing, truncated, or built for another
    environment, config or weights. The message says what differs and how to rebuild."""


def device_kind(device: str) -> str:
    """What compiled code is specific to: ``cpu/<arch>/<ISA>`` (e.g. ``cpu/x86_64/AVX512``)
    or ``cuda/<GPU name>/sm_<major><minor>``."""
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return f"cuda/{torch.cuda.get_device_name()}/sm_{major}{minor}"
    if device == "cpu":
        return f"cpu/{platform.machine()}/{torch.backends.cpu.get_cpu_capability()}"
    return device


def environment(device: str) -> dict[str, str]:
    """The versions and device kind an artifact is pinned to; ``specc_source`` hashes the
    code that defines what programs compute, so a changed pass or model invalidates it."""
    import transformers

    from specc import __version__

    return {"specc": __version__, "specc_source": source_hash(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device_kind": device_kind(device)}


#: Environment fields an artifact must match to be opened.
_PINNED = ("specc_source", "torch", "transformers", "device_kind")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 (16 hex digits) of the specc sources that shape a compiled program: the
    models, passes and kernels packages, the program modules, sampling and the compiler."""
    import specc.compiler
    import specc.kernels
    import specc.models
    import specc.passes
    import specc.runtime.programs
    import specc.runtime.sampling

    files = []
    for pkg in (specc.models, specc.passes, specc.kernels):
        files += sorted(Path(pkg.__file__).parent.glob("*.py"))
    files += [Path(m.__file__) for m in (specc.runtime.programs, specc.runtime.sampling, specc.compiler)]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def model_files_hash(folder: str | os.PathLike) -> str:
    """sha256 over an HF folder's files other than the weights (config.json, tokenizer
    and chat-template files): what, beside the weights, a compiled artifact depends on."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix != ".safetensors"):
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def draft_hash(folder: str | os.PathLike) -> str:
    """sha256 over a drafter folder's weights and other files (an EAGLE head's): what,
    beside the target, an artifact whose programs hold the drafter depends on.

    Raises:
        FileNotFoundError: no such folder."""
    from specc.models.loader import weights_hash

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder")
    return hashlib.sha256((weights_hash(path) + model_files_hash(path)).encode()).hexdigest()


# Config fields the compiled programs depend on (the rest: sampling defaults, seed,
# prompt lookup sizes, are read at run time). The tree switches decide whether the
# artifact holds tree_step programs.
_PROGRAM_FIELDS = ("dtype", "device", "max_model_len", "batch_buckets")
_PROGRAM_SPEC_FIELDS = ("method", "num_speculative_tokens", "num_draft_layers", "suffix_decoding_propose_tree",
                        "ngram_propose_tree", "eagle_aux_hidden_state_layer_ids")


def program_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config dict (``SpeccConfig.to_dict()``) the programs are built for."""
    spec = config.get("speculative_config") or {}
    return {**{f: config.get(f) for f in _PROGRAM_FIELDS},
            # unset or off fields (num_draft_layers outside early exit, a false tree switch) are
            # left out, so adding a field keeps the cache keys of the configs that do not use it
            "speculative_config": {f: spec[f] for f in _PROGRAM_SPEC_FIELDS if spec.get(f) not in (None, False)}
            if spec else None}


def program_config_diff(built: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Lines ``field: built X, config says Y`` for every program field that differs."""
    a, b = program_config(built), program_config(wanted)
    out = [f"{f}: artifact has {a[f]!r}, config has {b[f]!r}" for f in _PROGRAM_FIELDS if a[f] != b[f]]
    if a["speculative_config"] != b["speculative_config"]:
        out.append(f"speculative_config: artifact has {a['speculative_config']!r}, "
                   f"config has {b['speculative_config']!r}")
    return out


def compiled_cache_key(config: dict[str, Any], weights_hash: str, model_hash: str,
                       drafter_hash: str | None = None) -> str:
    """Folder name, in specc's compile cache, of the artifact for a config: a hash of the
    program fields, the target's weights and other files, the environment and, for a
    drafter compiled into the programs (EAGLE), its :func:`draft_hash`."""
    drafter = {"draft": drafter_hash} if drafter_hash is not None else {}  # other configs keep their keys
    blob = json.dumps({"config": program_config(config), "weights": weights_hash, "model": model_hash,
                       "environment": environment(config["device"]), "format": FORMAT_VERSION, **drafter},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Artifact:
    """An opened, checked artifact folder. ``manifest`` is the parsed ``manifest.json``."""

    root: Path
    manifest: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    @property
    def programs(self) -> list[dict[str, Any]]:
        return self.manifest["programs"]

    def path(self, rel: str) -> Path:
        return self.root / rel

    def rebuild_hint(self) -> str:
        src = (self.manifest.get("source") or {}).get("config")
        if src is None and self.root.parent.name == "compiled":  # specc's compile cache
            return f"delete {self.root}: specc rebuilds it on next use"
        return f"rebuild it: specc compile {src or 'CONFIG'} -o {self.root}"


def _is_specc_manifest(path: Path) -> bool:
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and "programs" in m and isinstance(m.get("environment"), dict) \
        and "specc" in m["environment"]


def check_output_dir(out_dir: str | os.PathLike) -> Path:
    """The resolved output folder, after checking it can take an artifact: absent, an
    empty folder, or an earlier specc artifact (its manifest names specc); its parent is
    created. Raises ArtifactError naming ``-o`` otherwise."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not (out.is_dir() and (_is_specc_manifest(out / MANIFEST) or not any(out.iterdir()))):
        raise ArtifactError(f"-o {out}: exists and is not a specc artifact folder; choose another "
                            "output folder (specc only replaces an earlier artifact)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(f"-o {out}: cannot create its parent folder ({e.strerror}: {e.filename})") from e
    if not os.access(out.parent, os.W_OK):
        raise ArtifactError(f"-o {out}: the folder {out.parent} is not writable")
    return out


def write_artifact(out_dir: str | os.PathLike, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Build an artifact atomically.

    ``build(tmp)`` writes every file into the temporary folder ``tmp`` and returns the
    manifest without ``files``; this function adds the size and sha256 of every file,
    writes ``manifest.json`` last and renames the folder to ``out_dir`` (an existing
    artifact there is replaced; any other existing file or non-empty folder is refused).

    Raises:
        ArtifactError: ``out_dir`` exists and is not an artifact.
    """
    out = check_output_dir(out_dir)
    with atomic_folder(out) as tmp:
        manifest = build(tmp)
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = f.relative_to(tmp).as_posix()
            files[rel] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
        manifest["files"] = files
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return out


def open_artifact(path: str | os.PathLike, device: str | None = None) -> Artifact:
    """Open and check an artifact folder (see the module docstring for the checks).

    Args:
        path: the folder ``specc compile -o`` wrote.
        device: the device it will run on (default: the one it was built for).

    Raises:
        ArtifactError: no manifest, an unreadable or truncated manifest or file, another
            format version, or built for another torch / transformers / device kind.
    """
    root = Path(path).expanduser().resolve()
    mpath = root / MANIFEST
    if not mpath.is_file() and (root / "config.json").is_file():
        raise ArtifactError(f"{root} is a model folder, not a specc artifact: write a model.yaml with "
                            f"`target: {root}` and run that (or specc compile it)")
    if not mpath.is_file():
        raise ArtifactError(f"{root}: no {MANIFEST}: not a specc artifact (or an interrupted build); "
                            "build one with: specc compile CONFIG -o DIR")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{mpath}: unreadable manifest ({e}); the artifact is truncated or corrupt: "
                            "rebuild it with specc compile CONFIG -o DIR") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath}: not a specc manifest (a JSON object is expected); "
                            "rebuild it with specc compile CONFIG -o DIR")
    art = Artifact(root, manifest)
    missing = [k for k in ("format", "config", "environment", "programs", "files", "constants", "weights_hash")
               if k not in manifest]
    if missing and manifest.get("format") == FORMAT_VERSION:
        raise ArtifactError(f"{mpath}: manifest lacks {', '.join(missing)} (corrupt or hand-edited); "
                            f"{art.rebuild_hint()}")
    if manifest.get("format") != FORMAT_VERSION:
        raise ArtifactError(f"{root}: artifact format {manifest.get('format')!r}, this specc reads format "
                            f"{FORMAT_VERSION}; {art.rebuild_hint()}")
    problems = []
    for rel, info in manifest.get("files", {}).items():
        f = root / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != info["size"]:
            problems.append(f"{rel} has {f.stat().st_size} bytes, the manifest says {info['size']} (truncated?)")
        elif info["size"] <= _HASHED_MAX_BYTES and sha256_file(f) != info["sha256"]:
            problems.append(f"{rel} does not match its sha256 in the manifest (modified or corrupt)")
    if problems:
        raise ArtifactError([f"{root}: " + p for p in problems] + [f"{root}: {art.rebuild_hint()}"])
    built = manifest["environment"]
    here = environment(device or manifest["config"]["device"])
    diff = [f"{k}: built with {built.get(k)!r}, this process has {here[k]!r}"
            for k in _PINNED if built.get(k) != here[k]]
    if diff:
        raise ArtifactError([f"{root}: stale artifact: " + d for d in diff] + [f"{root}: {art.rebuild_hint()}"])
    return art
