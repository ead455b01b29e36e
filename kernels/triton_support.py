"""What every Triton kernel module of specc shares: the optional import and the run modes.

Triton is *not* a dependency of specc: kernel modules import ``triton`` / ``tl`` from here
(``None`` when Triton is missing or broken) and decorate their kernels with
``triton.jit`` only on first use, so they import without it.

Modes: on CUDA tensors a kernel is compiled; on CPU tensors it runs only under Triton's
interpreter (``TRITON_INTERPRET=1``, used by the tests on machines without a GPU; slow,
for testing only). The variable must be in the environment before ``triton`` is first
imported: Triton decorates its own library functions (``tl.max``, ``tl.dot``, ...) at
import, in the mode the variable selects then.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: importing this module must work without it.
    import triton
    import triton.language as tl
except Exception as _err:  # noqa: BLE001  (ImportError, or a broken install)
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: str | None = f"{type(_err).__name__}: {_err}"
else:
    TRITON_IMPORT_ERROR = None

__all__ = ["TRITON_AVAILABLE", "TRITON_IMPORT_ERROR", "interpret_mode", "interpreter_ready",
           "launch_mode", "tl", "triton"]

#: Whether ``triton`` could be imported (the Triton path exists at all).
TRITON_AVAILABLE: bool = triton is not None


def interpret_mode() -> bool:
    """Whether Triton's interpreter is on now (read the way ``triton.jit`` reads it)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_ready() -> bool:
    """Whether interpreted kernels can run in this process: the interpreter is on *and*
    was on when ``triton`` was imported (its library functions are interpreted ones)."""
    if triton is None or not interpret_mode():
        return False
    from triton.runtime.jit import JITFunction

    return not isinstance(tl.max, JITFunction)  # an InterpretedFunction then


def launch_mode(fn_name: str, device: torch.device, fallback: str) -> bool:
    """Check that a Triton kernel can run on ``device`` now; returns whether it runs
    interpreted.

    Args:
        fn_name: the public function, for the messages.
        device: the inputs' device.
        fallback: what to call instead, for the message when Triton is missing.

    Raises:
        RuntimeError: ``triton`` is not importable, or ``TRITON_INTERPRET=1`` was set only
            after ``triton`` was imported.
        ValueError: tensors not on CUDA while the interpreter is off.
    """
    if triton is None:
        raise RuntimeError(f"{fn_name} needs triton, which is not importable ({TRITON_IMPORT_ERROR}); "
                           f"use {fallback}")
    interpret = interpret_mode()
    if device.type != "cuda" and not interpret:
        raise ValueError(f"{fn_name} needs CUDA tensors (got {device}); CPU tensors only run under "
                         "Triton's interpreter (TRITON_INTERPRET=1)")
    if interpret and not interpreter_ready():
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported: Triton's interpreter "
                           "needs it in the environment before the first `import triton`")
    return interpret
