"""Where the Triton side of a kernel test runs (shared by the ``test_*_triton.py`` files).

* a CUDA device is present: on CUDA, in this process (the reference runs on CUDA too,
  on the same inputs);
* no GPU but ``triton`` installed: on CPU tensors through Triton's interpreter. That
  needs ``TRITON_INTERPRET=1`` in the environment *before* ``triton`` is first imported
  (Triton decorates its own library functions, ``tl.max``, ``tl.cumsum``..., at import,
  in the mode the variable selects then), which a running pytest process can no longer
  guarantee. So each file's ``test_triton_side_in_interpreter_subprocess``
  (:func:`rerun_in_interpreter`) reruns that file in a child ``pytest`` with
  ``TRITON_INTERPRET=1`` set from the start and fails with the child's output if
  anything there fails; in the parent, the Triton tests skip, naming that test. (Running
  ``TRITON_INTERPRET=1 pytest tests/test_X_triton.py`` directly runs them in-process.) A
  file's compiled-mode test (``ahead_of_time`` in its name: the real Triton compiler
  for sm_90, no GPU needed, :func:`cuda_compiler_or_skip`) runs in the parent only;
* ``triton`` not installed (the CI default: it is not a specc dependency): the Triton
  tests skip with that reason; the import/dispatch tests still run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specc.kernels.triton_support import TRITON_AVAILABLE, TRITON_IMPORT_ERROR, interpreter_ready

SUBPROCESS_TEST = "test_triton_side_in_interpreter_subprocess"
_NOT_INSTALLED = "triton is not installed (optional, not a specc dependency)"


def run_mode() -> str:
    """``cuda``, ``interpreter`` (in this process), ``subprocess`` or ``none`` (no triton)."""
    if not TRITON_AVAILABLE:
        return "none"
    if torch.cuda.is_available():
        return "cuda"
    if interpreter_ready():
        return "interpreter"
    return "subprocess"


def device_or_skip(where: str) -> torch.device:
    """The device the Triton side of the tests in ``where`` runs on (CUDA, or CPU via the
    interpreter), else skip the test with the reason (conftest's ``triton_device``)."""
    mode = run_mode()
    if mode == "none":
        pytest.skip(f"{_NOT_INSTALLED}: the Triton kernel of {where} cannot run ({TRITON_IMPORT_ERROR})")
    if mode == "subprocess":
        pytest.skip(f"no GPU: runs under Triton's interpreter in the child pytest of {SUBPROCESS_TEST}")
    return torch.device("cuda" if mode == "cuda" else "cpu")


def rerun_in_interpreter(test_file: str) -> None:
    """No GPU, triton installed: rerun ``test_file`` with ``TRITON_INTERPRET=1`` from the
    start (all but this test and the ahead-of-time ones); fail with the child's output
    if it fails or skips anything. Skips where the Triton tests run in this process."""
    mode = run_mode()
    if mode != "subprocess":
        pytest.skip(f"the Triton tests run in this process ({mode})" if mode != "none" else _NOT_INSTALLED)
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider",
           "-k", f"not {SUBPROCESS_TEST} and not ahead_of_time"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"child pytest failed (rc {proc.returncode}):\n{out[-6000:]}"
    summary = out.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, summary


def cuda_compiler_or_skip(monkeypatch):
    """``(triton, GPUTarget, ASTSource)`` for an ahead-of-time compile for CUDA with the
    interpreter off, or skip (triton missing, imported in interpreter mode, or without
    its CUDA backend)."""
    if not TRITON_AVAILABLE:
        pytest.skip(_NOT_INSTALLED)
    if interpreter_ready():
        pytest.skip("triton was imported in interpreter mode; this compiled-mode test runs in the parent process")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"triton's CUDA backend is not available for ahead-of-time compiles: {err}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return triton, GPUTarget, ASTSource
