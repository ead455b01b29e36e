"""Store linear weights pre-transposed, so every projection is a plain NN GEMM.

What it does
------------
In a flat FX graph (:func:`specc.passes.signature.export_flat`), every
``aten.linear.default(x, W[, b])`` whose weight ``W`` is a 2-D ``get_attr`` tensor
(``[out_features, in_features]`` = ``[N, K]``) becomes ``aten.matmul(x, W_t)`` (then
``aten.add(., b)`` when there is a bias), where ``W_t`` is a new attribute holding
``W.t()`` as a contiguous ``[K, N]`` tensor (a copy; ``x`` may be 1-, 2- or N-D). The old
attribute is deleted once nothing reads it. Every linear of a Llama-family program is
rewritten: q/k/v/o, gate/up/down (or the ``fused__*`` weights of
:func:`~specc.passes.fuse_projections.fuse_projections`, which, if used, must run
first: it matches ``aten.linear`` only) and ``lm_head``.

Why: NN vs NT GEMM for few rows
-------------------------------
``aten.linear`` computes ``x @ W.t()``; Inductor lowers it to an extern ``mm``/``addmm``
on ``reinterpret_tensor(W, [K, N], [1, K])``, i.e. MKL's sgemm with the B operand
transposed (NT). With ``W_t`` stored ``[K, N]`` the same call gets a row-major B (NN):
Inductor emits ``aoti_torch_cpu_mm_out(buf, x2d, W_t)``, no reinterpretation. At
decode shapes (M = b * T rows, K = 576-1536) the GEMMs stream the weights once, and
MKL's NN kernels stream them faster than its NT kernels for most small M. Isolated MKL
sgemm, one thread, the 30 layers of SmolLM2-135M (7 projections each) + the 49152 x 576
``lm_head``, cold weights, NT / NN time ratio (> 1: NN faster)::

    M (rows)    1     2     3     4     5     6     8     10    12    16    20    32    40    256
    layers    1.12  0.89  0.88  1.15  1.12  1.10  1.07  1.30  1.37  1.00  1.12  1.18  1.25  1.03
    lm_head   1.27  0.82  0.85  1.35  1.26  1.19  1.47  1.79  1.79  0.90  0.93  1.00  1.00  1.00

(the box is shared and noisy: +-5 %.) NN wins for M = 1 and 4-12, is neutral from 16
on, and LOSES 10-18 % for M = 2 and 3 (MKL's NT path has a special skinny kernel
there). Alternatives tried for M = 2, 3 (``W @ x.t()`` with either layout) are 2-3x
slower than NT, and MKL's packed GEMM (``mkl._mkl_linear``) is no better than NN below
M = 8 (better at 8-16) and its packed format depends on M and the ISA, so it cannot be one constant for
all programs.

Tied weights (``shared``)
-------------------------
A weight that other nodes read too is handled per ``shared``:

* ``"embedding"`` (default): if every other reader is a plain ``aten.embedding`` (tied
  ``embed_tokens`` / ``lm_head``), the embedding is rewritten to gather rows of
  ``aten.permute(W_t, [1, 0])`` (a strided view: Inductor fuses the gather, reading
  ``W_t[j, id]``), so the model keeps ONE copy of the tensor, transposed, and the
  ``lm_head`` GEMM (about a fifth of SmolLM2's weight bytes) gets the NN speed-up. Every
  attribute path holding the old tensor (the unused tied alias included) is deleted. Any
  other kind of reader: the weight is left alone.
* ``"copy"``: the linears read a transposed copy, the other readers keep ``W``
  (SmolLM2-135M: +108 MiB of constants, 513 -> 621 MiB, for no measurable gain over
  ``"embedding"``).
* ``"skip"``: such weights stay untransposed (``lm_head`` stays NT).

The strided gather costs ~6 us per token more than a contiguous one (eager, warm, 256
tokens: 1.6 ms vs 0.1 ms), negligible against a forward pass.

Naming (deterministic)
----------------------
``W_t``'s attribute path is :func:`transposed_name` of the ``get_attr`` target of the
first linear (in graph order) that reads the tensor: ``target + "_t"``, e.g.
``model.model.layers.0.self_attn.q_proj.weight -> ...q_proj.weight_t``,
``...fused__q_proj__k_proj__v_proj.weight -> ...weight_t``; for SmolLM2's tied
embeddings export names the tensor ``model.lm_head.weight``, so it becomes
``model.lm_head.weight_t``. It depends only on the module, never on the program's batch
size or T, and the tensor is ``W.t()`` copied, so every program of an artifact produces
the same names and bit-identical tensors and specc stores each once. ``W_t`` is
registered as a grad-free ``nn.Parameter`` (a buffer if ``W`` was one) in ``W``'s
module, so ``named_parameters()`` and AOTInductor's ``get_constant_fqns()`` report it.

Invariants
----------
* The graph computes the same values up to GEMM summation order (tiny models: equal to
  1e-5; SmolLM2-135M logits: max |d| 2e-4 at T = 1, 4e-4 at T = 5) and
  performs the same in-place writes (KV cache); placeholders and outputs are untouched,
  so the calling convention is unchanged and the graph re-exports.
* Biases are left as they were (a separate ``add``; Inductor fuses it into the
  consumer's pointwise kernel instead of ``addmm``'s bias copy).
* A ``get_attr`` node left without users is erased; an attribute is deleted only when
  no remaining ``get_attr`` node targets it. Modules of the original model are not
  touched (the flat graph has its own containers).
* New nodes get ``meta["val"]`` (fake tensors) when the inputs carry them.
* If the target name already exists (a previous run, or the same weight in another
  program built on this graph), it is reused when it equals ``W.t()``; a different
  tensor there is an error. A second run finds no ``aten.linear`` left and returns 0.

Measured end-to-end
-------------------
``bench/fuse_projections_speed.py``: SmolLM2-135M fp32 (tied embeddings), AOTInductor
VerifyProgram, max_model_len 1024, one torch thread, shared 2-core box; interleaved
samples of 3 calls; each cell: speed-up = baseline / variant of the median ms per call,
then "paired" = median of the per-round ratios (baseline rows: median ms). Runs 1, 2:
attention over the whole cache (static shapes; 60 and 80 samples; b = 2 from a separate
run of 60). Run 3: kv_len symbolic as ``specc.compiler`` now exports programs, called
with 128 keys (60 samples, b = 2: 40)::

    b  T  M   variant              run 1            run 2            run 3 (kv_len 128)
    1  1  1   baseline (ms)        54.71            54.92            65.29
              pretranspose         1.095 / 1.091    1.055 / 1.069    1.107 / 1.109
              pretranspose+fused   1.142 / 1.126    1.115 / 1.117    1.140 / 1.137
              fused alone          0.966 / 0.984
              shared="copy"        1.081 / 1.089
              shared="skip"        1.041 / 1.061
    1  5  5   baseline (ms)        98.27            105.37           82.95
              pretranspose         1.044 / 1.054    1.073 / 1.059    1.076 / 1.079
              pretranspose+fused   1.057 / 1.063    1.051 / 1.057    1.045 / 1.049
              fused alone          0.938 / 0.939
              shared="copy"        1.047 / 1.092
              shared="skip"        1.030 / 1.072
    2  1  2   baseline (ms)        82.50                             67.45
              pretranspose         0.873 / 0.886                     0.855 / 0.844
              pretranspose+fused                                     0.874 / 0.861
    2  5  10  baseline (ms)                                          159.98
              pretranspose                                           1.277 / 1.287
              pretranspose+fused                                     1.179 / 1.225

Logits agree with the baseline to max |d| 1e-4 - 7e-4 (GEMM summation order); constants
513 MiB in every variant but ``shared="copy"`` (621 MiB).

So, alone: +6-11 % at b = 1, T = 1, +4-8 % at T = 5, +28 % at b = 2, T = 5, but -13 to
-15 % at b = 2, T = 1 (M = 2, as the GEMM table predicts). The tied ``lm_head`` matters
(``"skip"`` gains about half as much) and ``"embedding"`` is as fast as ``"copy"``
without the extra 108 MiB. ``fuse_projections`` on top (on the NN layout its larger N
no longer hurts at M = 1) adds ~3-5 % at M = 1 but costs 0-3 % at M = 5 and ~8 % at
M = 10. All programs of an artifact bind one set of constants by name, so choosing
either pass per program would store both layouts (+513 MiB for SmolLM2). Recommended on
this build: this pass alone, in every program; the price is ``decode_b2`` (and a
``decode_b3`` bucket, M = 3).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from specc.passes.graph_attrs import del_attr, fake_val, get_attr_tensor, set_meta, set_or_check_attr

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
        t = get_attr_tensor(gm, node.target)
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
        set_or_check_attr(gm, name, value, parameter=_is_parameter(gm, source),
                          what=f"pretranspose_weights (transpose of {source!r}): ")

        with graph.inserting_before(attrs[0]):  # before every reader of the tensor
            wt_node = graph.get_attr(name)
        set_meta(wt_node, fake_val(lambda v: v.t().contiguous(), linears[0][0]))

        for _, lin in linears:
            x, _, bias = _linear_parts(lin)
            with graph.inserting_before(lin):
                out = graph.call_function(_MATMUL, (x, wt_node))
                set_meta(out, fake_val(_MATMUL, x, wt_node), like=lin)
                if bias is not None:
                    out = graph.call_function(_ADD, (out, bias))
                    set_meta(out, fake_val(_ADD, out.args[0], bias), like=lin)
            lin.replace_all_uses_with(out)
            graph.erase_node(lin)
            rewritten += 1

        if others and rewrite_embeddings:
            with graph.inserting_after(wt_node):
                back = graph.call_function(_PERMUTE, (wt_node, [1, 0]))
            set_meta(back, fake_val(lambda v: v.permute(1, 0), wt_node))
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
        if get_attr_tensor(gm, target) is not None:
            del_attr(gm, target)

    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
