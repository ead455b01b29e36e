"""Stage labels for ``torch.profiler`` traces (``specc profile``).

The engine wraps each stage of a step in ``stage("specc.<name>")``. Under an active
``torch.profiler.profile`` that is a ``record_function`` range (it shows in Chrome /
Perfetto traces and in ``prof.key_averages()``); with no profiler running it is a shared
no-op context. Measured on the 2-core CPU: ``record_function`` costs ~17 µs per range even
when no profiler runs, this check ~0.6 µs (vs. ~35 ms per SmolLM2-135M step).

Stage names (see ``docs/bench.md``):

* ``specc.prefill``: admission of one request (prompt forward, first token, drafter prefill)
* ``specc.step``: one decode / speculative step for the running batch; inside it
  ``specc.draft``, ``specc.verify[T]`` (target forward over T = drafts + 1 tokens per row;
  ``specc.verify_tree[T]`` for a token tree of T nodes; compiled: accept/reject included;
  a compiled early-exit step drafts inside that program, so its drafting time is here too),
  ``specc.accept`` (logits processing + accept/reject + read-back) and
  ``specc.bookkeeping`` (appending tokens, stop checks, logprobs, counters, drafter update)
* ``specc.detokenize``: every detokenize call (nested in prefill / bookkeeping)
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, TypeVar

import torch
from torch.profiler import record_function

_NULL = contextlib.nullcontext()
_profiler_enabled = torch.autograd._profiler_enabled

F = TypeVar("F", bound=Callable)


def stage(name: str):
    """A ``record_function(name)`` range while a profiler runs, else a no-op context."""
    return record_function(name) if _profiler_enabled() else _NULL


def traced(fn: F, name: str) -> F:
    """``fn`` wrapped in ``stage(name)`` (for callbacks such as detokenize)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with stage(name):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
