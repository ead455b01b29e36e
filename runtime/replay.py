"""Replay compiled programs: load an artifact's packages, bind one set of weights, and
run the engine's steps through them.

:class:`ProgramSet` opens every ``.pt2`` package of an artifact and binds the constants
of ``weights.safetensors`` to each (user-managed: every program uses the same tensors,
no copy). :class:`CompiledEngine` is the :class:`~specc.runtime.engine.Engine` with its
two device parts replaced:

* prefill: the prompt runs as chunks of the prefill program's longest chunk and an
  exact tail (its length is a dynamic size; a 1-token tail gets one pad, written at the
  cache's trash position), one ``prefill`` call per chunk;
* the step: the live rows (slots ``0..B-1``) are cut into groups of the largest bucket,
  each group padded up to the smallest bucket that holds it (``num_rows`` tells the
  program which rows are real); ``spec_step_b{b}`` when any row of the group has drafts,
  else ``decode_b{b}``. Drafts are padded to k and the uniforms keep the eager layout
  ``[B, 2k + 1]``, so a compiled step consumes each request's random stream exactly as
  the eager step does (per-request seeds give the same tokens on both paths). A step whose
  proposal is a token tree (``Proposal.parents``) runs ``tree_step_b{b}`` instead: the
  tree goes in as ``parents`` / ``num_draft_tokens`` / ``start``, and the program also
  compacts the accepted path's K/V and returns its node indices.
  An early-exit artifact's ``spec_step`` drafts itself (``draft_layers`` in the manifest):
  it takes the last tokens only, draws its drafts from ``uniforms[:, :k]`` on the device,
  and the proposer is the :class:`~specc.runtime.drafters.in_graph.InGraphDrafter`
  stand-in, which supplies the per-row draft caps.
  An EAGLE artifact's programs (``drafter`` in the manifest) also take the head's state,
  ``head_kv_*`` and ``features`` (an :class:`~specc.runtime.drafters.eagle.EagleState`
  with the cache's slots, written in place like the KV cache; the stand-in owns it and
  moves it with its slot), and its ``spec_step`` the catch-up pairs each row's head has
  not run (:meth:`~specc.runtime.drafters.eagle.EagleState.catch_up_pairs`, ``k + 1``
  wide); its prefill runs the head's prompt pass, for the baseline engine too (which
  shares the state).

Only the returned tokens, counts and logprobs come back to the host. On a CUDA device
the step programs replay as CUDA graphs captured when the engine is built, one per kv_len
bucket (:mod:`specc.runtime.cuda_graphs`); prefill runs its program directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specc.artifact import Artifact, WEIGHTS
from specc.compiler import KV_LEN_ALIGN
from specc.kernels import small_m_gemv  # noqa: F401  (defines specc::small_m_linear, which programs may call)
from specc.models.kv_cache import KVCache
from specc.passes.packed_weights import PackedWeights, bind_constants
from specc.runtime.cuda_graphs import StepGraphs, use_cuda_graphs
from specc.runtime.drafters.base import Proposer, StepBatch
from specc.runtime.drafters.eagle import EagleState
from specc.runtime.drafters.in_graph import FEATURES, HEAD_KV, eagle_program_state
from specc.runtime.engine import Engine, tree_paths
from specc.runtime.request import Request
from specc.runtime.tracing import stage

__all__ = ["ProgramSet", "CompiledEngine", "cache_slots", "prefill_chunks"]


@dataclass
class _Program:
    name: str
    kind: str
    batch: int
    tokens: int
    inputs: list[str]
    runner: Callable
    drafts_in_graph: bool = False


class ProgramSet:
    """The loaded programs of an artifact.

    Attributes:
        prefill: the prefill program (chunks up to ``prefill.tokens``).
        decode, spec_step, tree_step: ``{b: program}`` by batch bucket (``tree_step``
            only in artifacts built for tree proposals).
        buckets: sorted batch buckets; k: draft tokens per spec step (0 without speculation).
        drafts_in_graph: the spec steps draft inside the program (early exit, EAGLE) and
            take no draft tokens.
        state_signature: ``{input name: (shape, dtype)}`` of the drafter state the
            programs take (EAGLE's ``head_kv_*`` and ``features``; empty otherwise).
        packed: the oneDNN-packed copies of the weights that bf16/fp16 CPU programs bind
            (:mod:`specc.passes.packed_weights`), one per weight, kept alive here.
        weights: ``{stored name: tensor}``, kept alive here: the programs bind them
            user-managed (they hold pointers, not references).

    Raises:
        KeyError / RuntimeError from the packages when the artifact was not checked with
        :func:`specc.artifact.open_artifact` first.
    """

    def __init__(self, artifact: Artifact, device: str = "cpu"):
        from safetensors.torch import load_file

        m = artifact.manifest
        stored = load_file(str(artifact.path(WEIGHTS)), device=device)
        constants = {name: stored[src] for name, src in m["constants"].items()}
        self.prefill: _Program | None = None
        self.decode: dict[int, _Program] = {}
        self.spec_step: dict[int, _Program] = {}
        self.tree_step: dict[int, _Program] = {}
        self.packed = PackedWeights()  # oneDNN-packed weights (bf16/fp16 CPU programs), shared
        for p in m["programs"]:
            runner = torch._inductor.aoti_load_package(str(artifact.path(p["file"])))
            bind_constants(runner, constants, p.get("packed_constants"), self.packed)
            prog = _Program(p["name"], p["kind"], p["batch"], p["tokens"], [i["name"] for i in p["inputs"]], runner,
                            bool(p.get("draft_layers") or p.get("drafter")))
            if p["kind"] == "prefill":
                self.prefill = prog
            else:
                getattr(self, p["kind"])[p["batch"]] = prog
        self.buckets = sorted(self.decode)
        self.k = next(iter(self.spec_step.values())).tokens - 1 if self.spec_step else 0
        self.drafts_in_graph = any(p.drafts_in_graph for p in self.spec_step.values())
        if self.tree_step and next(iter(self.tree_step.values())).tokens - 1 != self.k:
            raise ValueError("tree_step and spec_step programs verify different widths")
        self.weights = stored
        prefill = next(p for p in m["programs"] if p["kind"] == "prefill")
        self.state_signature = {i["name"]: (i["shape"], getattr(torch, i["dtype"])) for i in prefill["inputs"]
                                if i["name"].startswith(HEAD_KV) or i["name"] == FEATURES}

    def draft_state(self, num_slots: int, device) -> EagleState | None:
        """Zeroed drafter state for ``num_slots`` slots when the programs take one (EAGLE),
        else None."""
        return eagle_program_state(self.state_signature, num_slots, device) if self.state_signature else None


def cache_slots(max_num_seqs: int, buckets: list[int]) -> int:
    """KV slots a compiled session needs for ``max_num_seqs`` live sequences: groups of
    the largest bucket, the last group padded up to its bucket (padding rows write only
    at the trash position of their own slot, so the slots must exist)."""
    buckets = sorted(buckets)
    top = buckets[-1]
    full, rest = divmod(max_num_seqs, top)
    return full * top + (next(b for b in buckets if b >= rest) if rest else 0)


def prefill_chunks(n: int, max_chunk: int) -> list[tuple[int, int]]:
    """``[(real_tokens, chunk_length), ...]`` covering a prompt of ``n`` tokens: chunks of
    ``max_chunk`` and an exact tail; the prefill program's shortest chunk is 2 tokens, so
    a 1-token tail gets one pad."""
    out = []
    while n > 0:
        real = min(n, max_chunk)
        out.append((real, max(real, 2)))
        n -= real
    return out


class CompiledEngine(Engine):
    """:class:`Engine` whose prefill and verify run compiled programs (module docstring).

    Args:
        programs: the loaded :class:`ProgramSet`.
        kv_cache: the session's cache (``num_slots`` = max_num_seqs).
        detokenize, proposer: as :class:`Engine`; a proposer's ``num_speculative_tokens``
            must equal the programs' k (None for non-speculative decoding), and it may not
            ask for target hidden states (``hidden_layers``: the eager EAGLE proposer). Programs
            that draft inside ``spec_step`` take the
            :class:`~specc.runtime.drafters.in_graph.InGraphDrafter` stand-in, and only
            they do.
        max_num_seqs: most requests running at once; the cache needs
            :func:`cache_slots` slots for them (padded rows write into real slots).
        draft_state: the drafter state the programs take (EAGLE: :meth:`ProgramSet.draft_state`);
            default the proposer's ``state``. A non-speculative engine over EAGLE
            programs needs it too (its prefill runs the head's prompt pass).

    Raises:
        ValueError: too few cache slots, a proposer that does not fit the programs, or
            programs that take drafter state and none given.
    """

    def __init__(self, programs: ProgramSet, kv_cache: KVCache, detokenize, proposer: Proposer | None = None,
                 max_num_seqs: int | None = None, draft_state: EagleState | None = None):
        super().__init__(None, kv_cache, detokenize, proposer, max_num_seqs)
        if kv_cache.num_slots < cache_slots(self.max_num_seqs, programs.buckets):
            raise ValueError(f"kv_cache has {kv_cache.num_slots} slots; padding {self.max_num_seqs} sequences "
                             f"to buckets {programs.buckets} needs {cache_slots(self.max_num_seqs, programs.buckets)}")
        if proposer is not None and proposer.num_speculative_tokens != programs.k:
            raise ValueError(f"proposer drafts {proposer.num_speculative_tokens} tokens, the programs verify "
                             f"{programs.k}")
        if proposer is not None and proposer.hidden_layers:
            raise ValueError(f"{type(proposer).__name__} drafts from target hidden states "
                             f"(layers {list(proposer.hidden_layers)}); compiled programs do not return "
                             "them (an EAGLE artifact runs its head inside the programs, with the "
                             "InGraphDrafter stand-in): run it with enforce_eager: true")
        if proposer is not None and proposer.drafts_in_graph != programs.drafts_in_graph:
            raise ValueError(
                f"{type(proposer).__name__} does not fit these programs: "
                + ("their spec_step drafts inside the program (early exit, EAGLE) and takes no host drafts"
                   if programs.drafts_in_graph else
                   "it drafts inside a program, but these spec_step programs take host drafts"))
        self.draft_state = draft_state if draft_state is not None else getattr(proposer, "state", None)
        if programs.state_signature and self.draft_state is None:
            raise ValueError("these programs run an EAGLE head and take its state: pass draft_state "
                             "(ProgramSet.draft_state) or the InGraphDrafter that owns it")
        self.programs = programs
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._key_cache: dict[int, torch.Tensor] = {}
        # on CUDA the step programs replay as CUDA graphs captured here (runtime/cuda_graphs.py);
        # EAGLE programs are refused on CUDA by check_compilable (their head state is not captured)
        self.graphs = StepGraphs.shared(programs, kv_cache, self._kv) if use_cuda_graphs(kv_cache.device) else None

    def _kv(self, start: int, n: int) -> tuple[torch.Tensor, ...]:
        """Flat per-layer views of slots ``start..start+n-1`` (cached: the views are fixed)."""
        return tuple(v for name, v in self._state(start, n).items() if name.startswith("kv_"))

    def _state(self, start: int, n: int) -> dict[str, torch.Tensor]:
        """``{input name: view}`` of slots ``start..start+n-1`` of every state a program
        takes: ``kv_*`` and, with drafter state, ``head_kv_*`` and ``features`` (cached:
        the views are fixed)."""
        key = (start, n)
        if key not in self._views:
            c, views = self.cache, {}
            for prefix, cache in (("kv_", c), (HEAD_KV, self.draft_state.cache if self.draft_state else None)):
                if cache is not None:
                    flat = (t for pair in zip(cache.k, cache.v) for t in pair)
                    views.update({f"{prefix}{i}": t[start:start + n] for i, t in enumerate(flat)})
            if self.draft_state is not None:
                views[FEATURES] = self.draft_state.features[start:start + n]
            self._views[key] = views
        return self._views[key]

    def _keys(self, needed: int) -> torch.Tensor:
        """``key_positions`` for a call whose rows need keys ``[0, needed)``: ``arange`` of
        ``needed`` rounded up to a multiple of KV_LEN_ALIGN, capped at max_model_len."""
        kv_len = min(-(-needed // KV_LEN_ALIGN) * KV_LEN_ALIGN, self.cache.max_model_len)
        if kv_len not in self._key_cache:
            self._key_cache[kv_len] = torch.arange(kv_len, device=self.cache.device)
        return self._key_cache[kv_len]

    def _prefill_logits(self, ids: list[int], slot: int) -> torch.Tensor:
        dev, start, prog = self.cache.device, 0, self.programs.prefill
        state = self._state(slot, 1)
        for real, t in prefill_chunks(len(ids), prog.tokens):
            chunk = ids[start:start + real] + [0] * (t - real)
            pos = list(range(start, start + real)) + [self.cache.trash_pos] * (t - real)
            values = {"input_ids": torch.tensor([chunk], device=dev), "positions": torch.tensor([pos], device=dev),
                      "last_index": torch.tensor([real - 1], device=dev), "key_positions": self._keys(start + real)}
            logits = prog.runner(*[state[n] if n in state else values[n] for n in prog.inputs])[0]
            start += real
        return logits.float()

    def _verify(self, running: list[Request], batch: StepBatch, drafts: torch.Tensor, nd: torch.Tensor,
                draft_probs: torch.Tensor | None, uniforms: torch.Tensor):
        if draft_probs is not None:
            raise NotImplementedError("compiled steps take deterministic host drafts only (ngram, suffix); "
                                      "model drafters run inside the program")
        return self._run_groups(running, batch, drafts, nd, uniforms)[:3]

    def _verify_tree(self, running: list[Request], batch: StepBatch, drafts: torch.Tensor, parents: torch.Tensor,
                     nd: torch.Tensor, draft_probs: torch.Tensor | None, uniforms: torch.Tensor):
        if draft_probs is not None:
            raise ValueError("tree proposals must be deterministic (draft_probs None)")
        if not self.programs.tree_step:
            raise NotImplementedError(
                "this artifact has no tree_step programs (built for chain drafts): build it from a config with "
                "speculative_config.suffix_decoding_propose_tree (or ngram_propose_tree): true, or set "
                "enforce_eager: true")
        return self._run_groups(running, batch, drafts, nd, uniforms, parents)

    def _run_groups(self, running, batch, drafts, nd, uniforms, parents=None):
        """The step over groups of the largest bucket (a batch beyond it is split):
        ``(tokens, accepted, logprobs, paths)`` as :meth:`Engine._verify_tree` (``paths``
        None for chains)."""
        B, top = len(running), self.programs.buckets[-1]
        tokens: list[list[int]] = []
        accepted: list[int] = []
        rows_lp: list[tuple[torch.Tensor, ...]] = []  # per row: (token_lp [T], top_ids [T, L], top_lp [T, L])
        paths: list[list[int]] | None = None if parents is None else []
        for g0 in range(0, B, top):  # a batch beyond the largest bucket is split
            rows = slice(g0, min(B, g0 + top))
            out = self._run_group(running[rows], batch, rows, drafts[rows], nd[rows], uniforms[rows], g0,
                                  None if parents is None else parents[rows])
            tokens += out[0]
            accepted += out[1]
            rows_lp += list(zip(*out[2]))
            if paths is not None:
                paths += tree_paths(out[3], out[1])

        def logprobs(b: int, n: int, num_top: int):
            lp, ids, top_lp = rows_lp[b]
            return lp[:n], ids[:n, :num_top], top_lp[:n, :num_top]

        return tokens, accepted, logprobs, paths

    def _run_group(self, reqs, batch, rows, drafts, nd, uniforms, slot0, parents=None):
        """One program call for up to a bucket of rows: ``tree_step`` when ``parents``
        (``[n, K]``) is given, else ``spec_step`` (or ``decode`` when no row has drafts).
        Returns tokens, counts, logprobs ``(token_lp, top_ids, top_lp)`` of the real rows
        and, for a tree, their ``accepted_nodes`` ``[n, k + 1]``."""
        n, k, dev = len(reqs), self.k, self.cache.device
        b = next(x for x in self.programs.buckets if x >= n)
        tree = parents is not None
        spec = tree or (k > 0 and drafts.shape[1] > 0 and bool((nd > 0).any()))
        prog = (self.programs.tree_step if tree else self.programs.spec_step if spec else self.programs.decode)[b]
        width = k + 1 if spec else 1
        pad = b - n
        ids = torch.zeros(b, 1 if prog.drafts_in_graph else width, dtype=torch.long)
        ids[:n, 0] = torch.tensor([r.last_token for r in reqs])
        if spec and not prog.drafts_in_graph:
            ids[:n, 1:1 + drafts.shape[1]] = drafts
        start = torch.tensor([r.num_computed for r in reqs] + [0] * pad)
        nd_full = torch.cat([nd, nd.new_zeros(pad)]) if spec else torch.zeros(b, dtype=torch.long)
        # keys: the verify reads up to start + nd; an in-graph draft step s queries start + s, s < k
        reach = nd_full.clamp(min=k - 1) if prog.drafts_in_graph else nd_full
        needed = int((start + reach).max()) + 1  # keys [0, needed) are read
        u = uniforms if spec else uniforms[:, 2 * k:2 * k + 1]
        u = torch.cat([u, u.new_zeros(pad, u.shape[1])])
        values = {
            "input_ids": ids, "num_draft_tokens": nd_full, "uniforms": u,
            "temperature": _pad(batch.temperature[rows], pad), "top_k": _pad(batch.top_k[rows], pad),
            "top_p": _pad(batch.top_p[rows], pad, 1.0), "num_rows": torch.tensor(n),
        }
        if spec and "pair_ids" in prog.inputs:  # EAGLE: the pairs the head has not run, k + 1 per row
            pair_ids, pair_pos, _ = self.draft_state.catch_up_pairs(reqs, slot0, width)
            values["pair_ids"] = torch.cat([pair_ids, pair_ids.new_zeros(pad, width)])
            values["pair_positions"] = torch.cat([pair_pos, pair_pos.new_full((pad, width), self.cache.trash_pos)])
        if tree:  # nodes beyond a row's drafts: chain-like parents (in range); padding rows: rewritten
            values["parents"] = torch.arange(k).repeat(b, 1)
            values["parents"][:n, :parents.shape[1]] = parents
            values["start"] = start
        else:
            offs = torch.arange(width)
            values["positions"] = torch.where(offs[None] <= nd_full[:, None], start[:, None] + offs[None],
                                              torch.full((b, width), self.cache.trash_pos))
        # verify + accept/reject (+ early-exit drafting; + a tree's KV compaction), one program
        with stage(f"specc.verify_tree[{width}]" if tree else f"specc.verify[{width}]"):
            if self.graphs is not None and self.graphs.covers(prog, slot0):
                out = self.graphs(prog, slot0, values, needed)
            else:
                values["key_positions"] = self._keys(needed)
                state = self._state(slot0, b)
                out = prog.runner(*[state[n] if n in state else values[n].to(dev) for n in prog.inputs])
        out_ids, num_acc, tok_lp, top_ids, top_lp = out[:5]
        lp = (tok_lp[:n].cpu(), top_ids[:n].cpu(), top_lp[:n].cpu())
        result = (out_ids[:n].tolist(), num_acc[:n].tolist(), lp)
        return (*result, out[5][:n].cpu()) if tree else result


def _pad(x: torch.Tensor, pad: int, value: float = 0) -> torch.Tensor:
    return torch.cat([x, x.new_full((pad,), value)]) if pad else x
