"""``specc::small_m_linear``: a few-row linear (bf16 or fp32) that streams its weight once.

``small_m_linear(x, weight, bias=None)`` computes ``y = x @ weight.T (+ bias)``:

* ``x``: ``[..., K]`` (1-D, 2-D or more), ``weight``: ``[N, K]``, ``bias``: ``[N]`` or None;
* ``y``: ``[..., N]`` in ``x``'s dtype, computed in fp32 from the inputs as given and
  rounded once (for bf16 inputs: what oneDNN's bf16 linear computes, up to summation order).

Why: a (k+1)-row verify reads the same weights as a one-row decode step, so on a
memory-bound CPU it should cost about the same. MKL's fp32 GEMM over 5 rows costs ~2x
its one-row sgemv (it is built for large M), and oneDNN's bf16 linear pays ~30 us a call.
The C++ kernel (``small_m_gemv.cpp``, its header comment has the algorithm) streams ``W``
once against all its rows (up to 16 in bf16, 40 in fp32) held in L1: bf16 through AMX tiles taken straight from
the weight's rows (AVX512_BF16 dot products for tails), fp32 through AVX-512 FMAs with
the horizontal sums done 16 at a time and an L2 + L1 prefetch; a 5-row fp32 call costs
~1.1x a one-row call (docs/compile.md, "fp32 few-row linears").

Dispatch: the op is defined when this module is imported (its fake kernel too, so it
traces through ``torch.export`` and AOTInductor calls it by name through its proxy
executor). Its ``CompositeExplicitAutograd`` kernel is :func:`small_m_linear_reference`
until the first call on a CPU with AVX512_BF16 (Linux ``avx512_bf16`` flag), which builds
the C++ kernel (``torch.utils.cpp_extension.load_inline``, g++ and ninja, cached under
``~/.cache/specc/torch_extensions``; tens of seconds once, a load afterwards) and
registers it as the op's CPU kernel; later calls go straight to C++. The C++ kernel
handles bf16 or fp32 ``x``/``weight``/``bias`` (all one dtype) with ``1 <= M <= 16``
(bf16) or ``<= 40`` (fp32) rows; any other dtype or row count falls back to the same fp32 reference inside C++. On
a CPU without AVX512_BF16, or when the build fails (no compiler: a warning once), every
call runs the reference. Nothing is built at import.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["MAX_ROWS", "MAX_ROWS_F32", "max_rows", "small_m_linear", "small_m_linear_reference", "kernel_available", "load_kernel"]

#: Largest bf16 row count the C++ kernel handles (more rows: the reference, i.e. a GEMM).
MAX_ROWS = 16
#: Largest fp32 row count it handles: fp32 rows run in groups of <= 6 against each weight
#: block in L1, so any count works; up to 40 rows (a 5-token verify at batch 8) it beat
#: MKL in bench/small_m_gemm.py (M=20: 59 vs 74-78 ms, M=40: 92 vs 88-106 ms).
MAX_ROWS_F32 = 40
_SOURCE = Path(__file__).with_name("small_m_gemv.cpp")
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-std=c++17"]

_lib = torch.library.Library("specc", "FRAGMENT")
_lib.define("small_m_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")


def small_m_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ weight.T + bias)`` in fp32, rounded once to ``x.dtype``: the op's definition."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def max_rows(dtype: torch.dtype) -> int:
    """Largest row count with a C++ path for ``dtype`` (0: none, every call is the reference)."""
    return {torch.bfloat16: MAX_ROWS, torch.float32: MAX_ROWS_F32}.get(dtype, 0)


def _has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


_state: dict[str, object] = {}
_lock = threading.Lock()


def load_kernel() -> bool:
    """Build (once per source version, cached on disk) and load the C++ kernel; True when
    the op's CPU kernel is now the C++ one. False, without raising, on a CPU without
    AVX512_BF16 (``SPECC_NO_GEMV_KERNEL=1`` forces that) or when the build fails (a
    warning with the compiler's error, once)."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if _has_avx512_bf16() and not os.environ.get("SPECC_NO_GEMV_KERNEL"):
            try:
                from torch.utils.cpp_extension import load_inline

                build_dir = Path(os.environ.get("SPECC_EXTENSIONS_DIR",
                                                Path.home() / ".cache" / "specc" / "torch_extensions"))
                build_dir = build_dir / "specc_small_m_gemv"
                build_dir.mkdir(parents=True, exist_ok=True)
                load_inline("specc_small_m_gemv", cpp_sources=[_SOURCE.read_text()], extra_cflags=_CFLAGS,
                            build_directory=str(build_dir), is_python_module=False, verbose=False)
                ok = True
            except Exception as e:  # noqa: BLE001  (no compiler, an old assembler, ...): the reference runs
                warnings.warn(f"specc::small_m_linear: C++ kernel not built, using the reference ({e})",
                              RuntimeWarning, stacklevel=2)
        _state["ok"] = ok
        return ok


def kernel_available() -> bool:
    """Whether calls on CPU run the C++ kernel (builds it on first call; see :func:`load_kernel`)."""
    return load_kernel()


@torch.library.impl(_lib, "small_m_linear", "CompositeExplicitAutograd")
def _first_call(x, weight, bias=None):
    # until the C++ CPU kernel is registered, CPU calls land here: build it, then redispatch
    if x.device.type == "cpu" and "ok" not in _state and load_kernel():
        return torch.ops.specc.small_m_linear.default(x, weight, bias)
    return small_m_linear_reference(x, weight, bias)


@torch.library.register_fake("specc::small_m_linear")
def _fake(x, weight, bias=None):
    torch._check(weight.dim() == 2, lambda: f"small_m_linear: weight must be [N, K], got {tuple(weight.shape)}")
    torch._check(x.shape[-1] == weight.shape[1], lambda: "small_m_linear: x and weight disagree on K")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through ``specc::small_m_linear`` (module docstring).

    Args:
        x: ``[..., K]``; the fast path wants bf16 or fp32 and ``prod(x.shape[:-1]) <= max_rows(dtype)``.
        weight: ``[N, K]``, same dtype as ``x``.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x.dtype`` (fp32 accumulation, one rounding).

    Raises:
        RuntimeError: ``weight`` is not 2-D or its K differs from ``x``'s.
    """
    return torch.ops.specc.small_m_linear.default(x, weight, bias)
