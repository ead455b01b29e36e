"""Resumable training checkpoints for ``specc train``: safetensors + JSON, never pickle.

``DIR/checkpoints/step_N/`` (written into a temporary sibling and renamed when complete):

* ``head.safetensors``: the head's ``state_dict`` (float32; EAGLE-3 with ``d2t``/``t2d``);
* ``optimizer.safetensors``: AdamW's per-parameter state, keys ``state.<param index>.<name>``
  (``step``, ``exp_avg``, ``exp_avg_sq``);
* ``state.json``: ``{"step": N, "param_groups": [...]}`` (the optimizer's hyper-parameters,
  its tensors' parameter indices).

The data order, noise and learning rate of step ``s`` depend only on the seed and ``s``
(:mod:`specc.train`), so the step number, the head and the optimizer state are all a
resume needs to continue exactly as an uninterrupted run.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from specc.atomic import atomic_folder

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "prune_checkpoints"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(folder: Path, step: int, head: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Write ``folder/step_<step>`` atomically; returns it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step}"
    with atomic_folder(final) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()},
                  str(tmp / "head.safetensors"))
        sd = optimizer.state_dict()
        tensors = {f"state.{i}.{name}": t.detach().cpu().contiguous()
                   for i, st in sd["state"].items() for name, t in st.items()}
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": step, "param_groups": sd["param_groups"]}, indent=1))
    return final


def load_checkpoint(path: Path, head: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load ``path`` (a ``step_N`` folder) into ``head`` and ``optimizer``; returns N.

    Raises:
        ValueError: a checkpoint whose tensors do not fit this head or optimizer.
    """
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    try:
        head.load_state_dict(load_file(str(path / "head.safetensors")), strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path} does not fit this head: {e}") from None
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(path / "optimizer.safetensors")).items():
        _, index, name = key.split(".", 2)
        per_param.setdefault(int(index), {})[name] = t
    groups = state["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise ValueError(f"checkpoint {path} does not fit this optimizer: {e}") from None
    return int(state["step"])


def _steps(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(folder: Path) -> Path | None:
    """The complete ``step_N`` folder with the largest N, or None."""
    steps = _steps(folder)
    return steps[-1][1] if steps else None


def prune_checkpoints(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (``keep < 1``: keep all)."""
    if keep < 1:
        return
    for _, p in _steps(folder)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
