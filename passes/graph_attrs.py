"""Constants and metadata of flat FX graphs, shared by the passes that add or remove
weights (:mod:`specc.passes.fuse_projections`, :mod:`specc.passes.pretranspose_weights`).

A constant lives at a dotted attribute path of the ``GraphModule`` (the ``get_attr``
target); the passes create, read and delete them by that path, and give new nodes the
``meta["val"]`` (fake tensor) and ``tensor_meta`` that later passes and re-export read.
"""

from __future__ import annotations

import torch
from torch import fx, nn

__all__ = ["get_attr_tensor", "set_attr", "set_or_check_attr", "del_attr", "fake_val", "set_meta"]


def get_attr_tensor(gm: fx.GraphModule, target: str) -> torch.Tensor | None:
    """The tensor at dotted path ``target`` of ``gm``, or None if there is none."""
    obj = gm
    for name in target.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def set_attr(gm: fx.GraphModule, target: str, value: torch.Tensor, *, parameter: bool = True) -> None:
    """Register ``value`` at the dotted path ``target`` (creating empty container modules
    on the way) as a grad-free parameter, or a buffer with ``parameter=False``.

    Raises RuntimeError when a path component exists and is not a module."""
    *path, leaf = target.split(".")
    mod: nn.Module = gm
    for name in path:
        sub = getattr(mod, name, None)
        if sub is None:
            sub = nn.Module()
            mod.add_module(name, sub)
        elif not isinstance(sub, nn.Module):
            raise RuntimeError(f"cannot create attribute {target!r}: {name!r} is not a module")
        mod = sub
    if parameter:
        mod.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
    else:
        mod.register_buffer(leaf, value)


def set_or_check_attr(gm: fx.GraphModule, target: str, value: torch.Tensor, *, parameter: bool = True,
                      what: str = "") -> None:
    """Register ``value`` at ``target`` unless an equal tensor is already there (a pass
    run twice, or the same derived weight reached from two places).

    Raises RuntimeError (prefixed with ``what``) when a different tensor holds the path."""
    existing = get_attr_tensor(gm, target)
    if existing is None:
        set_attr(gm, target, value, parameter=parameter)
    elif existing.shape != value.shape or existing.dtype != value.dtype or not torch.equal(existing, value):
        raise RuntimeError(f"{what}attribute {target!r} exists and holds another tensor")


def del_attr(gm: fx.GraphModule, target: str) -> None:
    """Delete attribute ``target``, then every container module it leaves empty."""
    *path, leaf = target.split(".")
    mods: list[nn.Module] = [gm]
    for name in path:
        mods.append(getattr(mods[-1], name))
    delattr(mods[-1], leaf)
    for depth in range(len(path), 0, -1):
        mod = mods[depth]
        if next(iter(mod._parameters), None) or next(iter(mod._buffers), None) \
                or next(iter(mod._modules), None) or mod.__dict__.keys() - nn.Module().__dict__.keys():
            break
        delattr(mods[depth - 1], path[depth - 1])


def fake_val(fn, *args):
    """``fn(*args)`` on fake tensors (``meta["val"]``), or None if any is missing."""
    vals = []
    for a in args:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if v is None:
                return None
            vals.append(v)
        elif isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            sub = [x.meta.get("val") for x in a]
            if any(v is None for v in sub):
                return None
            vals.append(sub)
        else:
            vals.append(a)
    try:
        from torch._guards import detect_fake_mode
        mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]
                                + [x for v in vals if isinstance(v, list) for x in v])
        if mode is None:
            return None
        with mode:
            return fn(*vals)
    except Exception:  # meta is best effort; re-export recomputes it anyway
        return None


def set_meta(node: fx.Node, val, like: fx.Node | None = None) -> None:
    """Give ``node`` ``meta['val']`` / ``tensor_meta`` for ``val`` and the source-location meta of ``like``."""
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    if val is not None:
        node.meta["val"] = val
        if isinstance(val, torch.Tensor):
            from torch.fx.passes.shape_prop import _extract_tensor_metadata
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
