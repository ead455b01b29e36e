"""oneDNN-packed linear weights for reduced-precision CPU programs, shared across programs.

On a CPU with AMX or AVX-512 BF16, oneDNN runs a bf16/fp16 linear over a few rows at about
the cost of reading its weights once, but only when the weight is stored in oneDNN's
blocked ("packed") layout; a plain weight is re-laid-out on every call. Inductor's
``freezing`` does the packing (its ``mkldnn_fusion`` pass turns ``mm(x, W)`` on a constant
``W`` into ``mkldnn._linear_pointwise(x, packed_W)`` and folds the repacking into a new
constant). Measured on SmolLM2-135M (bf16, one thread, AOTInductor, kv_len 128): a
5-token verify costs 1.0x a one-token decode with packed weights against 1.9x for the
fp32 default (docs/compile.md, "Verify cost").

The catch is the artifact's one-copy-of-the-weights design: freezing names each packed
constant ``_frozen_paramN`` (the link to the parameter it came from is gone), and a packed
tensor is opaque (no safetensors). So:

* at compile time, :func:`lower_packed` lowers with freezing, captures the frozen
  graph's constants, and maps every packed one back to the artifact constant it was made
  from by value (``packed.to_dense()`` equals the constant or its transpose; exact, since
  packing is a permutation). The map ``{fqn: {"source": name, "transpose": bool}}`` goes
  into the manifest;
* at load, :class:`PackedWeights` packs each ``(source, transpose)`` once and every program
  binds the same packed tensor (:func:`bind_constants`).

Only the packed linears change: constants Inductor keeps unpacked (norm weights, the
embedding table for the gather) keep their names and bind the shared tensors as before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from specc.passes.graph_attrs import get_attr_tensor

__all__ = ["uses_packed_weights", "lower_packed", "PackedWeights", "bind_constants"]

_PACKED_DTYPES = (torch.bfloat16, torch.float16)


def uses_packed_weights(dtype: torch.dtype, device: str) -> bool:
    """Whether programs for ``dtype`` on ``device`` are lowered with packed weights: CPU,
    bf16 or fp16, and a oneDNN build that runs that dtype natively (AMX / AVX-512 BF16 /
    FP16); elsewhere packing would only add a conversion."""
    if device != "cpu" or dtype not in _PACKED_DTYPES:
        return False
    mkldnn = torch.ops.mkldnn
    supported = mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else mkldnn._is_mkldnn_fp16_supported
    return bool(torch.backends.mkldnn.is_available() and supported())


def _key(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous()
    return tuple(t.shape), t.dtype, hashlib.sha1(t.view(torch.uint8).reshape(-1).numpy()).hexdigest()


def lower_packed(ep: torch.export.ExportedProgram, constants: dict[str, torch.Tensor],
                 path: Path) -> dict[str, dict[str, Any]]:
    """AOTInductor-compile ``ep`` with freezing (packed linears) and constants kept out
    of the package; return how to rebuild each packed constant from ``constants``.

    Args:
        ep: the exported program (its parameters are the artifact constants).
        constants: ``{name: tensor}``, the program's constants (what the artifact stores).
        path: the ``.pt2`` to write.

    Returns:
        ``{fqn: {"source": constant name, "transpose": bool, "packed": bool[, "stride"]}}``
        for every constant of the package that freezing made (packed weights, and plain
        ones it folded, such as the transposed view of a tied embedding that the gather
        reads: ``stride`` is the layout the compiled code indexes it with); the other fqns
        are artifact constant names.

    Raises:
        RuntimeError: a frozen constant matches no artifact constant, transposed or not
            (Inductor folded a computed value the artifact could not rebuild), or the
            capture hook did not run.
    """
    captured: dict[str, torch.Tensor] = {}

    def capture(graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        for node in graph.nodes:  # dotted targets too: a program with no packed linear keeps the names
            t = get_attr_tensor(gm, node.target) if node.op == "get_attr" else None
            if t is not None:
                captured[node.target] = t

    with torch.no_grad():  # freezing only runs for inference graphs
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(path),
            inductor_configs={"aot_inductor.package_constants_in_so": False, "freezing": True,
                              "post_grad_custom_post_pass": capture})
    if not captured:  # a custom pass that is not a CustomGraphPass bypasses Inductor's caches
        raise RuntimeError("the frozen graph's constants were not captured (the post-grad hook did not run)")
    derived = {n: t for n, t in captured.items() if n not in constants}
    if not derived:
        return {}
    by_value: dict[tuple, tuple[str, bool]] = {}
    for name, t in constants.items():
        by_value.setdefault(_key(t), (name, False))
        if t.dim() == 2:
            by_value.setdefault(_key(t.t()), (name, True))
    out = {}
    for fqn, t in derived.items():
        hit = by_value.get(_key(t.to_dense() if t.is_mkldnn else t))
        if hit is None:
            raise RuntimeError(
                f"constant {fqn} {tuple(t.shape)} of the frozen program matches no program constant: Inductor "
                "folded a computed value the artifact cannot rebuild at load; please report it (dtype: float32 "
                "compiles without packing)")
        out[fqn] = {"source": hit[0], "transpose": hit[1], "packed": bool(t.is_mkldnn)}
        if not t.is_mkldnn:  # the compiled code indexes it with these strides
            out[fqn]["stride"] = list(t.stride())
    return out


class PackedWeights:
    """The constants freezing derives from artifact constants, made once at load and
    shared by every program.

    ``get(entry, tensor)`` for an entry of :func:`lower_packed`'s map: ``tensor``
    (transposed when ``entry["transpose"]``), as ``mkldnn._reorder_linear_weight`` packs it
    (an opaque oneDNN tensor of the same logical shape) when ``entry["packed"]``, else with
    the entry's strides (the transposed view itself when they match, no copy). The same
    entry always returns the same tensor (the programs bind it user-managed: they hold a
    pointer, so this object must outlive them).

    Raises:
        ValueError: a plain entry's strides can be met neither by the view nor by a
            contiguous copy.
    """

    def __init__(self) -> None:
        self._packed: dict[tuple[str, bool, bool], torch.Tensor] = {}

    def get(self, entry: dict[str, Any], tensor: torch.Tensor) -> torch.Tensor:
        stride = tuple(entry.get("stride", ()))
        key = (entry["source"], bool(entry["transpose"]), bool(entry["packed"]), stride)
        if key not in self._packed:
            w = tensor.t() if key[1] else tensor
            if key[2]:
                w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
            elif w.stride() != stride:
                w = w.contiguous()
                if w.stride() != stride:
                    raise ValueError(f"constant {entry['source']}: the program expects strides {stride}, "
                                     f"got {w.stride()}")
            self._packed[key] = w
        return self._packed[key]

    def __len__(self) -> int:
        return len(self._packed)


def bind_constants(runner, constants: dict[str, torch.Tensor], packed_map: dict[str, dict[str, Any]] | None,
                   packed: PackedWeights | None = None) -> None:
    """Bind a loaded package's constants user-managed: plain fqns to ``constants[fqn]``,
    packed fqns (``packed_map``, from :func:`lower_packed`) to the shared packed copy.

    Raises:
        KeyError: a constant the package needs is missing.
        ValueError: ``packed_map`` is non-empty and no ``packed`` cache is given.
    """
    packed_map = packed_map or {}
    if packed_map and packed is None:
        raise ValueError("this program binds packed weights: pass a PackedWeights cache")
    bound = {}
    for fqn in runner.get_constant_fqns():
        if fqn in packed_map:
            bound[fqn] = packed.get(packed_map[fqn], constants[packed_map[fqn]["source"]])
        else:
            bound[fqn] = constants[fqn]
    runner.load_constants(bound, check_full_update=True, user_managed=True)
