"""Replay the step programs as CUDA graphs, one graph per kv_len bucket.

On a CUDA device a step program (``decode_b{b}``, ``spec_step_b{b}``) is an AOTInductor
package whose run is a few hundred kernel launches; for a small model and batch those
launches, not the GPU, bound the step. A captured CUDA graph replays them with one
launch. A graph binds the addresses and shapes of every tensor it touches, so:

* **static inputs**: each input but the KV cache and ``key_positions`` gets one device
  buffer per program; a step copies its host values into them (``copy_``) and replays.
  The KV views (slots ``slot0 .. slot0 + b - 1`` of the session's cache, one per layer
  and k/v) are fixed tensors already and are bound as they are, never copied.
* **kv_len buckets**: ``key_positions`` (``arange(kv_len)``) has the programs' one
  dynamic size. Each graph is captured for one kv_len from :func:`kv_len_buckets`
  (powers of two from 256, then ``max_model_len``) and a step runs the smallest bucket
  that holds the keys its rows need. Keys past a row's length are inert: the mask is
  ``key_position <= query_position`` (``models/llama.py``, ``attention_inputs``), so a
  row never attends a key beyond its own position, whatever the cache holds there (the
  CPU path already rounds kv_len up to a multiple of 32 on the same grounds).
* **random numbers** stay inputs (``uniforms``), so a replay is a pure function of its
  inputs; the programs are compiled branch-free for CUDA (no ``torch.cond``, whose
  predicate would be read on the host during capture: ``process_logits(branch_free=True)``).
* **capture at Session start**, every (program, group start, kv bucket), largest batch
  and kv_len first, into one shared memory pool (DESIGN.md: graphs bind addresses, so an
  artifact cannot hold them). Memory: the pool holds about one step's intermediates at
  the largest shapes (the graphs replay one at a time and each step's outputs are read
  before the next replay); each graph adds its small static outputs. Time: two warm-up
  runs and one capture per graph; graphs = step programs x kv buckets x group starts
  (e.g. 8 x 4 x 1 = 32 for buckets 1/2/4/8, n-gram, max_model_len 2048, max_num_seqs <= 8).

The capture itself is a seam (:func:`capture_cuda_graph` on CUDA; :func:`call_directly`
replays by calling the runner, which is how the buffer and bucket logic is tested on a
CPU). ``SPECC_CUDA_GRAPHS=0`` runs CUDA programs without graphs (direct calls).
"""

from __future__ import annotations

import os
import weakref
from typing import Callable, Sequence

import torch

__all__ = ["kv_len_buckets", "kv_bucket", "capture_cuda_graph", "call_directly", "GraphedProgram",
           "StepGraphs", "use_cuda_graphs"]

#: Smallest kv_len bucket (keys attended) of a captured graph.
MIN_KV_BUCKET = 256
#: Runs of a program on a side stream before its capture (lazy initialisation, cuBLAS
#: workspaces and allocator warm-up must not happen inside the capture).
WARMUP_RUNS = 2

Replay = Callable[[], Sequence[torch.Tensor]]


def use_cuda_graphs(device: torch.device | str) -> bool:
    """Whether step programs on ``device`` are replayed as CUDA graphs: on CUDA, unless
    ``SPECC_CUDA_GRAPHS=0``."""
    return torch.device(device).type == "cuda" and os.environ.get("SPECC_CUDA_GRAPHS", "1") != "0"


def kv_len_buckets(max_model_len: int, smallest: int = MIN_KV_BUCKET) -> list[int]:
    """kv_len of each captured graph: ``smallest, 2 * smallest, ...`` below
    ``max_model_len``, then ``max_model_len`` itself (the programs' bound on kv_len)."""
    out, n = [], smallest
    while n < max_model_len:
        out.append(n)
        n *= 2
    return out + [max_model_len]


def kv_bucket(needed: int, buckets: Sequence[int]) -> int:
    """Smallest bucket ``>= needed`` (keys ``[0, needed)`` are read by the step).

    Raises:
        ValueError: ``needed`` exceeds the largest bucket (max_model_len).
    """
    for n in buckets:
        if n >= needed:
            return n
    raise ValueError(f"a step needs {needed} keys; the largest kv_len bucket is {buckets[-1]}")


def call_directly(fn: Replay, pool=None) -> Replay:
    """The capture seam off CUDA: "replay" calls the runner on the static buffers."""
    return fn


def capture_cuda_graph(fn: Replay, pool=None) -> Replay:
    """Warm ``fn`` up on a side stream, capture one call into a ``torch.cuda.CUDAGraph``
    (memory from ``pool``) and return a replay that refreshes the captured outputs.

    ``capture_error_mode="relaxed"``: the AOTInductor runner may query its own CUDA
    events between runs, which the stricter modes refuse during a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="relaxed"):
        outputs = fn()

    def replay() -> Sequence[torch.Tensor]:
        graph.replay()
        return outputs

    replay.graph = graph  # kept alive with the replay
    return replay


class GraphedProgram:
    """One step program on fixed KV views, replayed per kv_len bucket.

    Args:
        runner: the loaded program (``runner(*args)`` in ``inputs`` order).
        inputs: the program's input names (``kv_*`` and ``key_positions`` included).
        kv: the KV views it writes (slots ``slot0 .. slot0 + b - 1``), in ``kv_*`` order.
        example: ``{name: tensor}`` for every other input, at the program's static shapes
            on its device (the static buffers are clones; padded rows must be inert,
            e.g. positions at the trash slot, so warm-up runs change no real KV entry).
        kv_buckets: the kv_len of each graph (:func:`kv_len_buckets`).
        capture: :func:`capture_cuda_graph` or :func:`call_directly`.
        pool: memory pool shared by all graphs (``torch.cuda.graph_pool_handle()``).
    """

    def __init__(self, runner: Callable, inputs: Sequence[str], kv: Sequence[torch.Tensor],
                 example: dict[str, torch.Tensor], kv_buckets: Sequence[int],
                 capture: Callable[[Replay, object], Replay] = call_directly, pool=None):
        device = kv[0].device
        self.runner, self.inputs, self.kv = runner, list(inputs), tuple(kv)
        self.static = {n: example[n].to(device).clone() for n in self.inputs
                       if not n.startswith("kv_") and n != "key_positions"}
        self.kv_buckets = sorted(kv_buckets)
        self.keys = {n: torch.arange(n, device=device) for n in self.kv_buckets}
        self._capture, self._pool = capture, pool
        self._replays: dict[int, Replay] = {}

    def _args(self, kv_len: int) -> list[torch.Tensor]:
        kv = iter(self.kv)
        return [next(kv) if n.startswith("kv_") else self.keys[kv_len] if n == "key_positions" else self.static[n]
                for n in self.inputs]

    def capture(self, kv_len: int) -> None:
        """Capture the graph of bucket ``kv_len`` (no-op when captured)."""
        if kv_len not in self._replays:
            args = self._args(kv_len)
            self._replays[kv_len] = self._capture(lambda: self.runner(*args), self._pool)

    def capture_all(self) -> None:
        """Every bucket, largest first (the shared pool is sized by the first capture)."""
        for n in reversed(self.kv_buckets):
            self.capture(n)

    def __call__(self, values: dict[str, torch.Tensor], needed_keys: int) -> Sequence[torch.Tensor]:
        """Copy ``values`` (any device; every static input) into the static buffers and
        replay the bucket holding ``needed_keys``. The outputs are the graph's static
        tensors: read them before the next replay of this program."""
        n = kv_bucket(needed_keys, self.kv_buckets)
        for name, buf in self.static.items():
            buf.copy_(values[name], non_blocking=True)
        self.capture(n)  # captured at start; lazily only if a bucket was skipped
        return self._replays[n]()


class StepGraphs:
    """The graphed step programs of one session: ``{(program name, slot0): GraphedProgram}``
    for every ``decode_b{b}`` / ``spec_step_b{b}`` and every group start ``slot0`` the
    engine uses (``0, top, 2 * top, ...`` with ``slot0 + b <= slots``), all sharing one pool.

    Args:
        programs: the :class:`~specc.runtime.replay.ProgramSet`.
        kv_views: ``kv_views(slot0, b)`` -> the flat per-layer views (the engine's ``_kv``).
        num_slots, max_model_len, trash_pos: of the session's KV cache.
        capture: the capture seam (:func:`capture_cuda_graph` on CUDA).
    """

    def __init__(self, programs, kv_views: Callable[[int, int], tuple[torch.Tensor, ...]], num_slots: int,
                 max_model_len: int, trash_pos: int, capture=capture_cuda_graph):
        from specc.compiler import step_example_inputs

        self.programs, self.kv_buckets = programs, kv_len_buckets(max_model_len)
        top = programs.buckets[-1]
        pool = torch.cuda.graph_pool_handle() if capture is capture_cuda_graph else None
        self.graphs: dict[tuple[str, int], GraphedProgram] = {}
        # host-draft spec steps and decode; early-exit spec steps ([b, 1] inputs, a torch.cond in the
        # draft sampling) and tree steps run directly for now (covers() says which)
        steps = [*(p for p in programs.spec_step.values() if not p.drafts_in_graph), *programs.decode.values()]
        for prog in sorted(steps, key=lambda p: (-p.batch, -p.tokens)):  # largest first: one pool
            for slot0 in range(0, num_slots - prog.batch + 1, top):
                kv = kv_views(slot0, prog.batch)
                example = {"input_ids": torch.zeros(prog.batch, prog.tokens, dtype=torch.long),
                           "positions": torch.full((prog.batch, prog.tokens), trash_pos),
                           **step_example_inputs(prog.batch, prog.tokens - 1, "cpu")}
                self.graphs[prog.name, slot0] = GraphedProgram(prog.runner, prog.inputs, kv, example,
                                                               self.kv_buckets, capture, pool)

    @classmethod
    def shared(cls, programs, kv_cache, kv_views) -> "StepGraphs":
        """The graphs of ``programs`` on ``kv_cache``, built and captured on first use and
        shared by every engine of the session (its speculative and baseline engines).
        Captured as CUDA graphs on a CUDA cache, else replayed by direct calls (tests)."""
        graphs = _SHARED.get(kv_cache)
        if graphs is None or graphs.programs is not programs:
            cuda = torch.device(kv_cache.device).type == "cuda"
            capture = capture_cuda_graph if cuda else call_directly
            graphs = cls(programs, kv_views, kv_cache.num_slots, kv_cache.max_model_len, kv_cache.trash_pos, capture)
            graphs.capture_all()
            _SHARED[kv_cache] = graphs
        return graphs

    def capture_all(self) -> None:
        """Capture every program's every kv_len bucket (at Session start), largest first."""
        for g in self.graphs.values():
            g.capture_all()

    def covers(self, prog, slot0: int) -> bool:
        """Whether ``prog`` at group start ``slot0`` has captured graphs."""
        return (prog.name, slot0) in self.graphs

    def __call__(self, prog, slot0: int, values: dict[str, torch.Tensor], needed_keys: int):
        return self.graphs[prog.name, slot0](values, needed_keys)


_SHARED: "weakref.WeakKeyDictionary[object, StepGraphs]" = weakref.WeakKeyDictionary()  # by KV cache
