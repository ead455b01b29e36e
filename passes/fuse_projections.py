"""Horizontal fusion of linear projections that read the same input.

What it fuses
-------------
In a flat FX graph (:func:`specc.passes.signature.export_flat`), every group of two or
more ``aten.linear.default`` nodes (what ``torch.export`` emits for ``nn.Linear``) that

* read the *same* input node,
* take their weight from a ``get_attr`` node (a 2-D parameter or buffer of the module),
  with the same dtype, device and number of input features,
* and either all take a ``get_attr`` bias (1-D, same dtype and device) or none does,

becomes one linear over the weights concatenated along the output dimension (and the
biases likewise), followed by one ``aten.split_with_sizes`` along the last dimension whose
pieces replace the original outputs. In the Llama family this fuses ``q_proj``/``k_proj``
/``v_proj`` (with Qwen2's biases) into one linear and ``gate_proj``/``up_proj`` into
another, per layer. Linears over a mix of biased and unbiased projections on one input
are fused as two groups (one per kind); a weight used twice on one input is fused once.

Why it could help on CPU
------------------------
One GEMM instead of three (or two): the activation is read and packed once, the call and
dispatch overhead of the extern GEMM (MKL / oneDNN) is paid once, and the larger N (e.g.
576 + 192 + 192 for SmolLM2's q/k/v) gives the GEMM a better-shaped problem. At decode
shapes (M = b * T of 1-10 rows) the projections are bound by reading the weights, whose
total size does not change, so the gain is the saved per-call overhead rather than
FLOP efficiency.

Measured: it does NOT pay off on this CPU build
-----------------------------------------------
``bench/fuse_projections_speed.py``: SmolLM2-135M fp32, AOTInductor VerifyProgram,
batch 1, max_model_len 1024, one torch thread, MKL sgemm via ``extern_kernels.mm/addmm``
(90 fewer GEMM calls per step: 211 -> 121, lm_head included), on a shared 2-core box; median ms
per call of 60 interleaved samples x 3 calls ([p10, p90]), speed-up = unfused / fused,
"paired" = median of per-round ratios; logits bit-identical (max |d| = 0)::

    T   unfused                 fused                   speed-up   paired
    1   64.21 [56.93, 71.58]    64.88 [55.38, 71.64]    0.99x      1.01x
    5  115.99 [97.60, 121.07]  122.27 [102.05, 125.62]  0.95x      0.96x

(a first run with 40 samples gave 1.05x and 0.94x). So: no measurable gain at T = 1
(the step reads ~0.5 GB of weights either way; the saved call overhead is lost in the
noise) and a ~5 % *loss* at T = 5: MKL's skinny-M sgemm on the transposed ``[N, K]``
weight is slower per byte with the larger N (isolated, cold weights of 30 layers, q/k/v
+ gate/up, M = 5: 40.1 ms separate vs 43.3 ms fused; M = 1: 22.8 vs 22.3 ms). Apply it
to T = 1 programs at most, or not at all, on this build; it remains the natural place to
fuse if a backend with better large-N skinny GEMMs (or a packed-weight GEMM) is used.

Naming of the new attributes (deterministic)
--------------------------------------------
The fused weight's name depends only on the fused weights' ``get_attr`` targets, in graph
order, so the same model fused in several programs / batch buckets yields the same names
(and bit-identical tensors: ``torch.cat`` of the same tensors), and specc can keep one
weights file for all programs. With the targets split on ``.``: ``P`` = their longest
common prefix (never a whole target), ``S`` = the longest common suffix of what remains
(leaving each middle non-empty), ``M_i`` = the middles; the name is
``P + ["fused__" + "__".join("_".join(M_i) for each i)] + S`` joined by ``.``. Examples::

    model.model.layers.0.self_attn.{q,k,v}_proj.weight
        -> model.model.layers.0.self_attn.fused__q_proj__k_proj__v_proj.weight
    model.model.layers.0.self_attn.{q,k,v}_proj.bias
        -> model.model.layers.0.self_attn.fused__q_proj__k_proj__v_proj.bias
    model.model.layers.0.mlp.{gate,up}_proj.weight
        -> model.model.layers.0.mlp.fused__gate_proj__up_proj.weight
    w1, w2 (top-level attributes)          -> fused__w1__w2

A tensor shared under several names (tied weights) appears in an exported graph under
one of them (export picks it, deterministically for a given module), and that is the
name used here.

Every component is a valid Python identifier, so the name is a valid attribute path: the
fused tensor is registered as a (grad-free) ``nn.Parameter`` at that path, creating empty
``nn.Module`` containers on the way (``...self_attn.fused__q_proj__k_proj__v_proj``), and
it is what ``named_parameters()`` and AOTInductor's ``get_constant_fqns()`` report.

Invariants
----------
* The graph computes the same values (up to GEMM summation order, ~1e-6 relative in fp32)
  and performs the same in-place writes (KV cache) as before; placeholders and outputs
  are untouched, so the calling convention is unchanged and the graph re-exports.
* Each split piece is a view of the fused output (non-contiguous along the leading
  dims). An ``aten.view`` user that such a view cannot serve is rewritten to
  ``aten.reshape`` (checked on the fake tensors in ``meta["val"]``).
* A ``get_attr`` node left without users by the fusion is erased, and its attribute
  deleted from the module only when no other ``get_attr`` node still targets it (tied or
  shared weights survive); module containers emptied by a deletion are removed.
  Attributes the pass did not touch (e.g. an unused tied alias) are left alone.
* New nodes get ``meta["val"]`` (fake tensors) when the inputs carry them.
* If the target name already exists (the same weights fused on another input, or a
  previous run), the existing tensor is reused when it equals the concatenation; a
  different tensor there is an error.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from specc.passes.graph_attrs import del_attr, fake_val, get_attr_tensor, set_meta, set_or_check_attr

__all__ = ["fuse_projections", "fused_name"]

_LINEAR = torch.ops.aten.linear.default
_VIEW = torch.ops.aten.view.default
_RESHAPE = torch.ops.aten.reshape.default
_SPLIT = torch.ops.aten.split_with_sizes.default
_PREFIX = "fused__"


def fused_name(targets: list[str]) -> str:
    """Deterministic attribute path for the concatenation of the attributes ``targets``
    (in order); see the module docstring. ``targets`` must be >= 2 distinct paths."""
    if len(targets) < 2 or len(set(targets)) != len(targets):
        raise ValueError(f"fused_name needs >= 2 distinct targets, got {targets}")
    parts = [t.split(".") for t in targets]
    shortest = min(len(p) for p in parts)
    n_pre = 0
    while n_pre < shortest - 1 and all(p[n_pre] == parts[0][n_pre] for p in parts):
        n_pre += 1
    rests = [p[n_pre:] for p in parts]
    shortest = min(len(r) for r in rests)
    n_suf = 0
    while n_suf < shortest - 1 and all(r[-1 - n_suf] == rests[0][-1 - n_suf] for r in rests):
        n_suf += 1
    middles = ["_".join(r[:len(r) - n_suf]) for r in rests]
    suffix = rests[0][len(rests[0]) - n_suf:]
    return ".".join(parts[0][:n_pre] + [_PREFIX + "__".join(middles)] + suffix)


# --------------------------------------------------------------------------- helpers

@dataclass
class _Linear:
    node: fx.Node
    weight: fx.Node
    bias: fx.Node | None


def _as_linear(gm: fx.GraphModule, node: fx.Node) -> _Linear | None:
    """The node as a fusable linear (weight/bias from ``get_attr``), else None."""
    if node.op != "call_function" or node.target is not _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    w = get_attr_tensor(gm, weight.target)
    if w is None or w.dim() != 2:
        return None
    if bias is not None:
        if not isinstance(bias, fx.Node) or bias.op != "get_attr":
            return None
        b = get_attr_tensor(gm, bias.target)
        if b is None or b.dim() != 1 or b.dtype != w.dtype or b.device != w.device:
            return None
    return _Linear(node, weight, bias)


def _group_key(gm: fx.GraphModule, lin: _Linear) -> tuple:
    w = get_attr_tensor(gm, lin.weight.target)
    return (lin.bias is not None, w.dtype, w.device, w.shape[1])


def _fused_attr(gm: fx.GraphModule, attr_nodes: list[fx.Node], dim: int,
                created: dict[str, torch.Tensor]) -> str:
    """Name of the attribute holding the concatenation of ``attr_nodes``' tensors along
    ``dim``, creating it (or reusing an equal one)."""
    targets = [n.target for n in attr_nodes]
    name = fused_name(targets)
    if name in created:
        return name
    value = torch.cat([get_attr_tensor(gm, t).detach() for t in targets], dim=dim)
    set_or_check_attr(gm, name, value, what=f"fuse_projections (concatenation of {targets}): ")
    created[name] = get_attr_tensor(gm, name)
    return name


# --------------------------------------------------------------------------- the pass

def fuse_projections(gm: fx.GraphModule) -> int:
    """Fuse, in place, the linears of ``gm`` that read the same input (see the module
    docstring); recompiles ``gm``. Returns the number of groups fused."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: list[list[_Linear]] = []
    for x in list(graph.nodes):
        by_key: dict[tuple, list[_Linear]] = {}
        for user in x.users:
            lin = _as_linear(gm, user)
            if lin is not None and lin.node.args[0] is x:
                by_key.setdefault(_group_key(gm, lin), []).append(lin)
        for members in by_key.values():
            members.sort(key=lambda lin: order[lin.node])
            seen: set[str] = set()
            uniq = []
            for lin in members:  # a weight applied twice to one input: fuse it once
                if lin.weight.target not in seen:
                    seen.add(lin.weight.target)
                    uniq.append(lin)
            if len(uniq) >= 2:
                groups.append(uniq)

    created: dict[str, torch.Tensor] = {}
    touched: set[fx.Node] = set()
    for members in groups:
        first = members[0].node
        x = first.args[0]
        w_name = _fused_attr(gm, [m.weight for m in members], 0, created)
        b_name = (_fused_attr(gm, [m.bias for m in members], 0, created)
                  if members[0].bias is not None else None)
        sizes = [get_attr_tensor(gm, m.weight.target).shape[0] for m in members]

        with graph.inserting_before(first):
            w_node = graph.get_attr(w_name)
            set_meta(w_node, fake_val(lambda *vs: torch.cat(vs, 0), *[m.weight for m in members]))
            b_node = None
            if b_name is not None:
                b_node = graph.get_attr(b_name)
                set_meta(b_node, fake_val(lambda *vs: torch.cat(vs, 0), *[m.bias for m in members]))
            fused = graph.call_function(_LINEAR, (x, w_node, b_node) if b_node is not None else (x, w_node))
            set_meta(fused, fake_val(_LINEAR, *fused.args), like=first)
            split = graph.call_function(_SPLIT, (fused, sizes, -1))
            set_meta(split, fake_val(_SPLIT, fused, sizes, -1), like=first)
            pieces = []
            for i, m in enumerate(members):
                piece = graph.call_function(operator.getitem, (split, i))
                val = split.meta.get("val")
                set_meta(piece, val[i] if val is not None else None, like=m.node)
                pieces.append(piece)

        for m, piece in zip(members, pieces):
            _fix_views(graph, m.node, piece)
            m.node.replace_all_uses_with(piece)
            graph.erase_node(m.node)
            touched.add(m.weight)
            if m.bias is not None:
                touched.add(m.bias)

    # Erase the get_attr nodes the fusion left unused; delete their attributes unless
    # another get_attr node still reads them (tied / shared weights).
    dead = [n for n in touched if not n.users]
    for n in dead:
        graph.erase_node(n)
    live_targets = {n.target for n in graph.nodes if n.op == "get_attr"}
    for target in sorted({n.target for n in dead} - live_targets):
        if get_attr_tensor(gm, target) is not None:
            del_attr(gm, target)

    if groups:
        graph.lint()
        gm.recompile()
    return len(groups)


def _fix_views(graph: fx.Graph, old: fx.Node, piece: fx.Node) -> None:
    """Rewrite ``aten.view`` users of ``old`` that the strided ``piece`` cannot serve
    into ``aten.reshape`` (same values, copying if needed)."""
    val = piece.meta.get("val")
    for user in list(old.users):
        if user.op != "call_function" or user.target is not _VIEW or user.args[0] is not old:
            continue
        ok = False
        if val is not None:
            try:
                with _fake_mode_of(val):
                    val.view(user.args[1])
                ok = True
            except Exception:
                ok = False
        if not ok:
            user.target = _RESHAPE


def _fake_mode_of(val):
    import contextlib

    from torch._guards import detect_fake_mode
    mode = detect_fake_mode([val])
    return mode if mode is not None else contextlib.nullcontext()
