"""Inline one flat FX graph (the *guest*) into another (the *host*).

The compile passes that append work to a program (the on-device accept/reject, the
padding of a batch bucket) write that work as plain PyTorch functions, trace each one
into a flat ``GraphModule`` with :func:`specc.passes.signature.export_flat` and splice it
into the program's graph with :func:`splice`:

* each guest placeholder is either **bound** to an existing host node (its value) or
  becomes a **new host placeholder**, appended after the host's existing placeholders in
  the guest's placeholder order, under a name the caller gives;
* every other guest node is copied into the host (by default just before the host's
  ``output`` node; ``before=`` picks another point), names made unique by FX;
* guest attributes are copied into the host under fresh, non-clashing top-level names:
  tensors reached by ``get_attr`` (a ``Parameter`` stays a parameter, any other tensor
  becomes a buffer, so the ``named_parameters()`` + ``named_buffers()`` of the host still
  list every constant AOTInductor asks for), and submodules reached by ``get_attr`` or
  ``call_module`` — e.g. the ``true_graph_0`` / ``false_graph_0`` branch graphs of a
  ``torch.cond`` higher-order op, which are shared with the guest, not copied;
* the guest's own input guards (``call_module`` of a ``torch.export`` ``GuardsFn``,
  named ``_guards_fn``) are dropped: they check the guest's example inputs, not the
  host's, and the host keeps its own.

The host's ``output`` node is not touched: :func:`splice` returns the host nodes that
hold the guest's outputs and the caller decides what the host returns.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
from torch import fx

from specc.passes.signature import output_node

__all__ = ["splice", "add_placeholder", "fresh_attr_name", "is_guards_fn"]


def is_guards_fn(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` is the input-guard module ``torch.export`` puts in ``.module()``."""
    try:
        from torch.export._unlift import GuardsFn
    except ImportError:  # pragma: no cover - older / newer torch without the class
        return type(mod).__name__ == "GuardsFn"
    return isinstance(mod, GuardsFn)


def _get_attr_path(root: torch.nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def fresh_attr_name(module: torch.nn.Module, base: str) -> str:
    """A top-level attribute name of ``module`` derived from ``base`` (dots and other
    non-identifier characters replaced by ``_``) that no attribute of ``module`` uses yet."""
    name = re.sub(r"\W", "_", base) or "_attr"
    if name[0].isdigit():
        name = "_" + name
    candidate, i = name, 0
    while hasattr(module, candidate):
        i += 1
        candidate = f"{name}_{i}"
    return candidate


def add_placeholder(gm: fx.GraphModule, name: str, *, val=None) -> fx.Node:
    """Append a placeholder called ``name`` after the last placeholder of ``gm``'s graph.

    The node's ``name`` and ``target`` are both ``name`` (the argument name of the
    regenerated ``forward``): a non-placeholder node already called ``name`` is renamed
    out of the way. ``val`` (e.g. a fake tensor) is stored as ``node.meta["val"]`` if given.
    Does not recompile ``gm``.

    Raises:
        ValueError: ``name`` is not an identifier, or a placeholder of that name (or
            target) already exists.
    """
    graph = gm.graph
    if not name.isidentifier():
        raise ValueError(f"placeholder name {name!r} is not a Python identifier")
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    if any(n.name == name or n.target == name for n in phs):
        raise ValueError(f"the graph already has a placeholder named {name!r}")
    for n in graph.nodes:
        if n.name == name:  # free the name for the new input
            n._rename(f"{name}_")
    if phs:
        ctx = graph.inserting_after(phs[-1])
    else:
        ctx = graph.inserting_before(next(iter(graph.nodes), None))
    with ctx:
        node = graph.placeholder(name)
    if node.name != name:  # the namespace still remembers a renamed node's old name
        node.name = name
        graph._graph_namespace._rename_object(node, name)
    if val is not None:
        node.meta["val"] = val
    return node


def _copy_attr(host: fx.GraphModule, guest: fx.GraphModule, target: str,
               copied: dict[str, str]) -> str:
    """Register guest attribute ``target`` in ``host``; returns its new (top-level) name."""
    if target in copied:
        return copied[target]
    obj = _get_attr_path(guest, target)
    name = fresh_attr_name(host, target)
    if isinstance(obj, torch.nn.Parameter):
        host.register_parameter(name, obj)
    elif isinstance(obj, torch.Tensor):
        host.register_buffer(name, obj)
    elif isinstance(obj, torch.nn.Module):
        host.add_module(name, obj)
    else:  # a script object or other constant: a plain attribute
        setattr(host, name, obj)
    copied[target] = name
    return name


def splice(
    host: fx.GraphModule,
    guest: fx.GraphModule,
    inputs: Mapping[str, fx.Node | str],
    *,
    before: fx.Node | None = None,
) -> tuple:
    """Copy ``guest``'s computation into ``host``; returns the host values of the guest's outputs.

    Args:
        host: the graph to extend (modified in place; recompiled before returning).
        guest: a flat ``GraphModule`` (placeholders in, ``output`` of a tuple/list of
            values or a single value), e.g. from ``export_flat``. Not modified; its
            submodules become shared with ``host``.
        inputs: for **every** guest placeholder name, either a ``fx.Node`` of ``host``
            (the placeholder is bound to it) or a ``str`` (the placeholder becomes a new
            host placeholder of that name, appended after the host's existing ones, in
            guest placeholder order).
        before: host node before which the guest's nodes are inserted (default: the
            host's ``output`` node). It must come after every bound node.

    Returns:
        A tuple, one entry per guest output: the host ``fx.Node`` computing it (or the
        constant itself if the guest returns a non-node value).

    Raises:
        ValueError: a guest placeholder has no entry in ``inputs``, ``inputs`` names a
            placeholder the guest lacks, a bound node belongs to another graph or does
            not come before ``before``, or a new placeholder name is taken.
    """
    hg = host.graph
    guest_phs = [n for n in guest.graph.nodes if n.op == "placeholder"]
    names = [n.name for n in guest_phs]
    missing = [n for n in names if n not in inputs]
    extra = [n for n in inputs if n not in names]
    if missing or extra:
        raise ValueError(f"splice inputs must name exactly the guest placeholders {names}; "
                         f"missing {missing}, unknown {extra}")
    if before is None:
        before = output_node(hg)
    if before.graph is not hg:
        raise ValueError("`before` is not a node of the host graph")
    order = {n: i for i, n in enumerate(hg.nodes)}
    for name, value in inputs.items():
        if isinstance(value, fx.Node):
            if value.graph is not hg:
                raise ValueError(f"input {name!r} is bound to a node of another graph")
            if order[value] >= order[before]:
                raise ValueError(f"input {name!r} is bound to {value.name}, which does not "
                                 f"come before the insertion point {before.name}")
        elif not isinstance(value, str):
            raise ValueError(f"input {name!r}: expected a host fx.Node or a placeholder "
                             f"name, got {type(value).__name__}")

    env: dict[fx.Node, object] = {}
    for ph in guest_phs:
        value = inputs[ph.name]
        if isinstance(value, str):
            new = add_placeholder(host, value)
            new.meta.update(ph.meta)
            env[ph] = new
        else:
            env[ph] = value

    copied: dict[str, str] = {}
    result = None
    with hg.inserting_before(before):
        for node in guest.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = fx.map_arg(node.args[0], lambda n: env[n])
                continue
            if node.op == "call_module" and is_guards_fn(_get_attr_path(guest, node.target)):
                continue  # the guest's input checks: not the host's business
            new = hg.node_copy(node, lambda n: env[n])
            if node.op in ("get_attr", "call_module"):
                new.target = _copy_attr(host, guest, node.target, copied)
            env[node] = new
    host.recompile()
    if isinstance(result, (tuple, list)):
        return tuple(result)
    return (result,)
