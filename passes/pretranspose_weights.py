"""Store linear weights pre-transposed, so every projection is a plain NN GEMM.

(Module docstring completed below, after measurement.)
"""

from __future__ import annotations

import torch
from torch import fx, nn

from specc.passes.fuse_projections import _del_attr, _fake_val, _get_attr_tensor, _set_meta

__all__ = ["pretranspose_weights", "transposed_name", "SHARED_MODES"]

_LINEAR = torch.ops.aten.linear.default
_MATMUL = torch.ops.aten.matmul.default
_ADD = torch.ops.aten.add.Tensor
_EMBEDDING = torch.ops.aten.embedding.default
_PERMUTE = torch.ops.aten.permute.default
_SUFFIX = "_t"

#: What to do with a weight that a linear reads and some other node reads too (tied
#: embeddings: ``aten.embedding`` and the ``lm_head`` linear on one tensor).
SHARED_MODES = ("embedding", "copy", "skip")


def transposed_name(target: str) -> str:
    """Attribute path of the pre-transposed copy of the 2-D attribute ``target``:
    ``target + "_t"`` (``...q_proj.weight`` -> ``...q_proj.weight_t``)."""
    return target + _SUFFIX


# --------------------------------------------------------------------------- helpers

def _linear_parts(node: fx.Node):
    """``(x, weight, bias)`` of an ``aten.linear`` node (bias None if absent)."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])


def _use_kind(user: fx.Node, attr: fx.Node) -> str:
    """How ``user`` reads the ``get_attr`` node ``attr``: ``linear`` (as the weight of an
    ``aten.linear`` and nothing else), ``embedding`` (as the weight of a plain
    ``aten.embedding``), else ``other``."""
    if user.op == "call_function" and user.target is _LINEAR:
        x, weight, bias = _linear_parts(user)
        if weight is attr and x is not attr and bias is not attr and isinstance(x, fx.Node):
            return "linear"
    if user.op == "call_function" and user.target is _EMBEDDING and len(user.args) >= 2 \
            and user.args[0] is attr and user.args[1] is not attr and not user.kwargs:
        return "embedding"
    return "other"


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    *path, leaf = target.split(".")
    mod = gm
    for name in path:
        mod = getattr(mod, name)
    return isinstance(mod, nn.Module) and leaf in mod._parameters


def _register(gm: fx.GraphModule, target: str, value: torch.Tensor, parameter: bool) -> None:
    *path, leaf = target.split(".")
    mod = gm
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


def _attr_paths_of(gm: fx.GraphModule, tensor: torch.Tensor) -> list[str]:
    """Every parameter / buffer path of ``gm`` that holds ``tensor`` (tied aliases)."""
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    return sorted({name for name, t in named if t is tensor})


# --------------------------------------------------------------------------- the pass

def pretranspose_weights(gm: fx.GraphModule, *, shared: str = "embedding") -> int:
    """Rewrite, in place, every ``aten.linear(x, W, b)`` whose weight ``W`` is a 2-D
    ``get_attr`` tensor into ``aten.matmul(x, W_t)`` (``+ b``) over a new attribute
    ``W_t = W.t()`` stored contiguous (``[in_features, out_features]``), named
    :func:`transposed_name` of ``W``'s target; recompiles ``gm``.

    Args:
        gm: a flat graph (:func:`specc.passes.signature.export_flat`).
        shared: a weight that other nodes read too (tied embeddings): ``"embedding"``
            rewrite its ``aten.embedding`` readers to gather from ``W_t.permute(1, 0)``
            (one tensor, no extra memory), leaving the weight alone if any other kind of
            reader remains; ``"copy"`` keep ``W`` for the other readers and add ``W_t``
            (extra memory); ``"skip"`` leave such weights untransposed.

    Returns:
        the number of linear nodes rewritten.
    """
    if shared not in SHARED_MODES:
        raise ValueError(f"shared must be one of {SHARED_MODES}, got {shared!r}")
    graph = gm.graph

    # Group the get_attr nodes by the tensor they read (tied aliases together), in
    # graph order, keeping only tensors some linear reads as its weight.
    groups: dict[int, list[fx.Node]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        t = _get_attr_tensor(gm, node.target)
        if t is None:
            continue
        groups.setdefault(id(t), []).append(node)
        tensors[id(t)] = t

    rewritten = 0
    dead_targets: set[str] = set()
    for key, attrs in groups.items():
        w = tensors[key]
        uses = [(a, u, _use_kind(u, a)) for a in attrs for u in a.users]
        linears = [(a, u) for a, u, k in uses if k == "linear"]
        if w.dim() != 2 or not linears:
            continue
        others = [(a, u, k) for a, u, k in uses if k != "linear"]
        if others:
            if shared == "skip":
                continue
            if shared == "embedding" and any(k != "embedding" for _, _, k in others):
                continue
        rewrite_embeddings = shared == "embedding"

        source = linears[0][0].target  # first get_attr a linear reads: deterministic
        name = transposed_name(source)
        value = w.detach().t().clone(memory_format=torch.contiguous_format)
        existing = _get_attr_tensor(gm, name)
        if existing is not None:
            if existing.shape != value.shape or existing.dtype != value.dtype or not torch.equal(existing, value):
                raise RuntimeError(f"pretranspose_weights: attribute {name!r} exists and is not "
                                   f"the transpose of {source!r}")
        else:
            _register(gm, name, value, _is_parameter(gm, source))

        with graph.inserting_before(attrs[0]):  # before every reader of the tensor
            wt_node = graph.get_attr(name)
        _set_meta(wt_node, _fake_val(lambda v: v.t().contiguous(), linears[0][0]))

        for _, lin in linears:
            x, _, bias = _linear_parts(lin)
            with graph.inserting_before(lin):
                out = graph.call_function(_MATMUL, (x, wt_node))
                _set_meta(out, _fake_val(_MATMUL, x, wt_node), like=lin)
                if bias is not None:
                    out = graph.call_function(_ADD, (out, bias))
                    _set_meta(out, _fake_val(_ADD, out.args[0], bias), like=lin)
            lin.replace_all_uses_with(out)
            graph.erase_node(lin)
            rewritten += 1

        if others and rewrite_embeddings:
            with graph.inserting_after(wt_node):
                back = graph.call_function(_PERMUTE, (wt_node, [1, 0]))
            _set_meta(back, _fake_val(lambda v: v.permute(1, 0), wt_node))
            for attr, user, _ in others:
                user.replace_input_with(attr, back)

        # The tensor is now read through W_t only (unless kept for other readers): erase
        # its unused get_attr nodes and, when nothing reads it any more, every attribute
        # path holding it (tied aliases included), so the constants hold one copy.
        still_read = any(a.users for a in attrs)
        for a in attrs:
            if not a.users:
                graph.erase_node(a)
        if not still_read:
            dead_targets.update(_attr_paths_of(gm, w))

    live_targets = {n.target for n in graph.nodes if n.op == "get_attr"}
    for target in sorted(dead_targets - live_targets):
        if _get_attr_tensor(gm, target) is not None:
            _del_attr(gm, target)

    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
