"""Turn an exported program into a flat FX graph the other passes can edit.

``torch.export.export(module, args).module()`` gives a ``GraphModule`` whose parameters
are ``get_attr`` nodes and whose calling convention is pytree-structured (nested tuples
of inputs, checked by a pre-hook). The passes add and remove inputs and outputs, so
they work on a *flat* graph: positional tensor inputs in placeholder order, a tuple of
tensor outputs. The result can be exported again (``torch.export.export(gm, flat_args)``)
for AOTInductor.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["export_flat", "flatten_signature", "output_node", "placeholders", "output_values"]


def flatten_signature(gm: fx.GraphModule) -> fx.GraphModule:
    """A new ``GraphModule`` over the same graph and attributes with a flat signature:
    ``forward(*placeholders) -> tuple(outputs)`` (no pytree specs, no input-check hooks).

    Placeholder names are kept (``input_ids``, ``positions``, ``kv_0`` ...)."""
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    out = output_node(graph)
    flat, _ = torch.utils._pytree.tree_flatten(out.args[0])
    out.args = (tuple(flat),)
    flat_gm = fx.GraphModule(gm, graph)
    flat_gm.recompile()
    return flat_gm


def export_flat(module: torch.nn.Module, args: tuple, dynamic_shapes=None) -> fx.GraphModule:
    """Export ``module`` on ``args`` (non-strict; ``dynamic_shapes`` as for
    ``torch.export.export``) and flatten the result: inputs are the leaves of ``args`` in
    order, outputs a tuple."""
    gm = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False).module()
    return flatten_signature(gm)


def output_node(graph: fx.Graph) -> fx.Node:
    """The graph's single ``output`` node."""
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def placeholders(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """``{name: node}`` of the graph's inputs, in order."""
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}


def output_values(gm: fx.GraphModule) -> tuple[fx.Node, ...]:
    """The nodes a flat graph returns."""
    return tuple(output_node(gm.graph).args[0])
