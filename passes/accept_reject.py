"""Fuse the speculative accept/reject into a verify program.

A verify program (:class:`specc.runtime.programs.VerifyProgram`, flattened by
:func:`specc.passes.signature.export_flat`) returns the target's logits ``[B, T, V]``
for ``T = k + 1`` tokens per row (the last token, then ``k`` draft slots). Copying those
logits to the host costs ``B * T * V`` floats per step; the host only needs the tokens the
step emits, how many drafts were accepted, and the logprobs of the emitted tokens.
:func:`fuse_accept_reject` appends that work — exactly what the eager reference
(:meth:`specc.runtime.engine.Engine._step`) does after the target forward — to the
graph, so the compiled program returns only those small tensors:

1. ``drafts = input_ids[:, 1:]`` (the draft slots; entries at index
   ``>= num_draft_tokens[b]`` are padding and never read as tokens);
2. ``processed = process_logits`` over the ``B * T`` rows, each row with its request's
   temperature / top-k / top-p (under tracing the top-k/top-p sort sits behind a
   ``torch.cond`` that skips it when no row filters);
3. :func:`specc.kernels.rejection_sampler.rejection_sample` with the drafter's ``q``
   (``draft_probs``; None = a deterministic drafter, q one-hot),
   ``is_greedy = greedy_mask(temperature)``, the accept-test
   uniforms ``uniforms[:, k:2k]`` and the recovered/bonus uniform ``uniforms[:, 2k]``
   (the engine's ``[B, 2k + 1]`` layout; columns ``0..k-1`` belong to a sampling drafter
   and are not read here);
4. :func:`specc.runtime.sampling.compute_logprobs` of every output position (a ``-1``
   token is scored as token 0; its value is meaningless).

``k = 0`` (``T = 1``, ``uniforms [B, 1]``) is the non-speculative decode program: no
drafts, the one emitted token is the greedy argmax or a sample with ``uniforms[:, 0]``.

Two kinds of verify graph are accepted. A host-draft verify returns ``(logits,)`` and its
first placeholder ``input_ids`` holds ``[last, d_1..d_k]``. A draft-then-verify graph
(:class:`specc.runtime.programs.EarlyExitStepProgram`: the drafts are made inside)
returns ``(logits, verified_ids, draft_probs)``; its own ``uniforms`` / ``temperature``
/ ``top_k`` / ``top_p`` placeholders (the draft loop reads them) are shared with the
accept/reject, and ``q = draft_probs`` is used for the accept test and the residual.

The computation is the plain function :func:`accept_reject_outputs`; the pass traces it
(``export_flat``) and splices it into the program with :mod:`specc.passes.splice`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from specc.kernels.rejection_sampler import rejection_sample
from specc.passes.signature import export_flat, output_node, output_values
from specc.passes.splice import splice
from specc.runtime.sampling import compute_logprobs, greedy_mask, process_logits

__all__ = [
    "ACCEPT_REJECT_INPUTS",
    "ACCEPT_REJECT_OUTPUTS",
    "accept_reject_outputs",
    "fuse_accept_reject",
    "output_logprobs",
    "processed_logits",
    "verify_graph_logits",
]

#: Placeholders :func:`fuse_accept_reject` appends, in order.
ACCEPT_REJECT_INPUTS = ("num_draft_tokens", "uniforms", "temperature", "top_k", "top_p")
#: What the fused program returns, in order.
ACCEPT_REJECT_OUTPUTS = ("output_token_ids", "num_accepted", "token_logprobs",
                         "top_logprob_ids", "top_logprobs")


def _check_shapes(logits, input_ids, num_draft_tokens, uniforms, temperature, top_k, top_p,
                  k: int, max_logprobs: int) -> None:
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    bsz, t, vocab = logits.shape
    if t != k + 1:
        raise ValueError(f"logits have T = {t} positions; num_speculative_tokens = {k} needs T = {k + 1}")
    if not 0 <= max_logprobs <= vocab:
        raise ValueError(f"max_logprobs must be in 0..V = 0..{vocab}, got {max_logprobs}")
    expected = {
        "input_ids": (input_ids, (bsz, t)),
        "num_draft_tokens": (num_draft_tokens, (bsz,)),
        "uniforms": (uniforms, (bsz, 2 * k + 1)),
        "temperature": (temperature, (bsz,)),
        "top_k": (top_k, (bsz,)),
        "top_p": (top_p, (bsz,)),
    }
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")


def accept_reject_outputs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    num_speculative_tokens: int,
    max_logprobs: int,
    branch_free: bool = False,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One speculative step's accept/reject and logprobs from the verify logits.

    Args (``B`` rows, ``k = num_speculative_tokens``, ``T = k + 1``):
        logits: ``[B, T, V]`` float32 raw target logits of ``[last, d_1 .. d_k]``.
        input_ids: ``[B, T]`` int64, the verified tokens; ``input_ids[:, 1:]`` are the
            drafts (padding beyond ``num_draft_tokens[b]``: any value).
        num_draft_tokens: ``[B]`` int64 in ``0..k`` (clamped to it).
        uniforms: ``[B, 2k + 1]`` float32 in ``[0, 1)``: columns ``k..2k-1`` are the
            accept tests, column ``2k`` the recovered/bonus token's (``0..k-1``, a
            sampling drafter's, are ignored).
        temperature: ``[B]`` float32, ``<= 0`` = greedy row.
        top_k: ``[B]`` int64, ``<= 0`` (or ``>= V``) = off.
        top_p: ``[B]`` float32, ``1.0`` = off.
        num_speculative_tokens: ``k >= 0``.
        max_logprobs: number of top alternatives returned per position, ``0..V``.
        branch_free: no ``torch.cond`` in the traced graph (CUDA-graph programs; see
            :func:`~specc.runtime.sampling.process_logits`).
        draft_probs: ``[B, k, V]`` float32, the drafter's processed distribution q at
            each draft, or None (deterministic drafter: q one-hot).

    Returns:
        ``(output_token_ids [B, T] int64, num_accepted [B] int64,
        token_logprobs [B, T] float32, top_logprob_ids [B, T, max_logprobs] int64,
        top_logprobs [B, T, max_logprobs] float32)``: the accepted drafts then the
        recovered/bonus token, ``-1`` after; the accepted count; the logprob of each
        output token under the processed target distribution (meaningless where the
        token is ``-1``); the top alternatives, descending.

    Raises:
        ValueError: on inconsistent shapes or arguments.
    """
    k = int(num_speculative_tokens)
    _check_shapes(logits, input_ids, num_draft_tokens, uniforms, temperature, top_k, top_p,
                  k, int(max_logprobs))
    processed = processed_logits(logits, temperature, top_k, top_p, branch_free=branch_free)
    result = rejection_sample(
        processed,
        input_ids[:, 1:],
        num_draft_tokens,
        draft_probs,
        greedy_mask(temperature),
        uniforms[:, k : 2 * k],
        uniforms[:, 2 * k],
    )
    return (result.output_token_ids, result.num_accepted,
            *output_logprobs(processed, result.output_token_ids, int(max_logprobs)))


def processed_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, *, branch_free: bool = False) -> torch.Tensor:
    """``[B, T, V]`` raw logits -> float32, each row's processors (``[B]`` temperature,
    top-k, top-p) applied at every position (``branch_free``: no ``torch.cond``, for CUDA
    graphs)."""
    bsz, t, vocab = logits.shape
    rows = bsz * t

    def per_position(x: torch.Tensor) -> torch.Tensor:  # [B] -> [B * T], row-major like logits
        return x.unsqueeze(1).expand(bsz, t).reshape(rows)

    processed = process_logits(logits.reshape(rows, vocab), per_position(temperature), per_position(top_k),
                               per_position(top_p), branch_free=branch_free)
    return processed.view(bsz, t, vocab)


def output_logprobs(processed: torch.Tensor, tokens: torch.Tensor, max_logprobs: int):
    """``(token_logprobs [B, T], top_logprob_ids [B, T, m], top_logprobs [B, T, m])`` of
    ``tokens`` ``[B, T]`` (``-1`` scored as token 0) under ``processed`` ``[B, T, V]``."""
    bsz, t, vocab = processed.shape
    token_lp, top_ids, top_lp = compute_logprobs(processed.reshape(bsz * t, vocab),
                                                 tokens.clamp_min(0).reshape(bsz * t), max_logprobs)
    m = top_ids.shape[-1]
    return token_lp.view(bsz, t), top_ids.view(bsz, t, m), top_lp.view(bsz, t, m)


class _AcceptReject(torch.nn.Module):
    """:func:`accept_reject_outputs` as a module, for tracing; the argument names become
    the guest graph's placeholder names."""

    def __init__(self, num_speculative_tokens: int, max_logprobs: int, branch_free: bool = False) -> None:
        super().__init__()
        self.k = num_speculative_tokens
        self.max_logprobs = max_logprobs
        self.branch_free = branch_free

    def forward(self, logits, input_ids, num_draft_tokens, uniforms, temperature, top_k, top_p,
                draft_probs=None):
        return accept_reject_outputs(logits, input_ids, num_draft_tokens, uniforms, temperature,
                                     top_k, top_p, num_speculative_tokens=self.k,
                                     max_logprobs=self.max_logprobs, branch_free=self.branch_free,
                                     draft_probs=draft_probs)


def _meta_val(node: fx.Node, what: str) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"{what} ({node.name}) has no tensor meta['val']: the graph must come "
                         "from torch.export (export_flat) so that shapes are known")
    return val


def fuse_accept_reject(gm: fx.GraphModule, *, num_speculative_tokens: int,
                       max_logprobs: int, branch_free: bool = False) -> fx.GraphModule:
    """Append the accept/reject of :func:`accept_reject_outputs` to a verify graph.

    Args:
        gm: flat graph (``export_flat``) whose first placeholder is ``input_ids``. Either
            a host-draft verify: ``input_ids`` ``[B, T]`` int64 with
            ``T = num_speculative_tokens + 1`` and output ``(logits [B, T, V],)``; or a
            draft-then-verify graph returning ``(logits [B, T, V], verified_ids [B, T]
            int64, draft_probs [B, T - 1, V] float32)`` (module docstring). Shapes are
            read from ``meta["val"]``. Modified in place (and returned).
        num_speculative_tokens: ``k >= 0``.
        max_logprobs: top alternatives per position (``0..V``), e.g.
            :data:`specc.sampling_params.MAX_LOGPROBS`.
        branch_free: splice a graph without ``torch.cond`` (programs replayed as CUDA
            graphs; :func:`~specc.runtime.sampling.process_logits`).

    Returns:
        ``gm``, with the placeholders :data:`ACCEPT_REJECT_INPUTS` it lacks appended in order —
        ``num_draft_tokens [B]`` int64, ``uniforms [B, 2k + 1]`` float32,
        ``temperature [B]`` float32, ``top_k [B]`` int64, ``top_p [B]`` float32 — and
        returning :data:`ACCEPT_REJECT_OUTPUTS` (shapes as in
        :func:`accept_reject_outputs`) instead of the logits.

    Raises:
        ValueError: the graph does not meet the precondition (first placeholder,
            single 3-D float output, ``T != k + 1``, missing shape metadata), an
            appended placeholder name is taken, or ``max_logprobs`` is out of range.
    """
    k = int(num_speculative_tokens)
    host = verify_graph_logits(gm, k, int(max_logprobs), "fuse_accept_reject", with_drafts=True)
    bsz, t, vocab, dev = host.batch, k + 1, host.vocab, host.device
    example = (
        torch.empty(bsz, t, vocab, dtype=torch.float32, device=dev),
        torch.zeros(bsz, t, dtype=torch.int64, device=dev),
        torch.zeros(bsz, dtype=torch.int64, device=dev),
        torch.zeros(bsz, 2 * k + 1, dtype=torch.float32, device=dev),
        torch.zeros(bsz, dtype=torch.float32, device=dev),
        torch.zeros(bsz, dtype=torch.int64, device=dev),
        torch.ones(bsz, dtype=torch.float32, device=dev),
    )
    inputs: dict[str, fx.Node | str] = {"logits": host.logits, "input_ids": host.input_ids}
    if host.draft_probs is not None:
        example += (torch.zeros(bsz, k, vocab, dtype=torch.float32, device=dev),)
        inputs["draft_probs"] = host.draft_probs
    guest = export_flat(_AcceptReject(k, int(max_logprobs), branch_free), example)
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}  # the draft loop's inputs are shared
    inputs.update({name: by_name.get(name, name) for name in ACCEPT_REJECT_INPUTS})
    return replace_outputs(gm, splice(gm, guest, inputs))


@dataclass
class HostLogits:
    """What the accept/reject passes read from a verify graph (:func:`verify_graph_logits`)."""

    input_ids: fx.Node  # [B, T] int64: the first placeholder, or a draft-then-verify graph's verified ids
    logits: fx.Node  # [B, T, V] float32 (a cast appended when the graph's are not)
    batch: int
    vocab: int
    device: torch.device
    draft_probs: fx.Node | None = None  # [B, T - 1, V] float32, a draft-then-verify graph's q


def verify_graph_logits(gm: fx.GraphModule, k: int, max_logprobs: int, who: str, *,
                        with_drafts: bool = False) -> HostLogits:
    """Check that ``gm`` is a flat verify graph of ``T = k + 1`` tokens per row (first
    placeholder ``input_ids``, one output ``logits [B, T, V]``, shapes in ``meta["val"]``;
    with ``with_drafts`` also a draft-then-verify graph returning ``(logits, verified_ids
    [B, T], draft_probs [B, T - 1, V])``) and return its logits as float32.

    Raises:
        ValueError: the graph does not meet that, ``k < 0``, or ``max_logprobs`` not in
            ``0..V``.
    """
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not phs or phs[0].name != "input_ids":
        raise ValueError(f"{who} needs a graph whose first placeholder is input_ids, "
                         f"got {[n.name for n in phs[:1]]}")
    outs = output_values(gm)
    shapes = (1, 3) if with_drafts else (1,)
    if len(outs) not in shapes or not all(isinstance(o, fx.Node) for o in outs):
        wanted = "(logits,) or (logits, verified_ids, draft_probs)" if with_drafts else "(logits,)"
        raise ValueError(f"{who} needs a graph returning {wanted}, got {len(outs)} outputs")
    ids_node, q_node = (phs[0], None) if len(outs) == 1 else outs[1:]
    ids_val = _meta_val(ids_node, "input_ids")
    logits_val = _meta_val(outs[0], "logits")
    if logits_val.dim() != 3 or not logits_val.dtype.is_floating_point:
        raise ValueError(f"logits must be a float [B, T, V] tensor, got {logits_val.dtype} "
                         f"{list(logits_val.shape)}")
    bsz, t, vocab = (int(s) for s in logits_val.shape)
    if tuple(ids_val.shape) != (bsz, t):
        raise ValueError(f"input_ids {list(ids_val.shape)} and logits {list(logits_val.shape)} disagree")
    if q_node is not None and tuple(_meta_val(q_node, "draft_probs").shape) != (bsz, t - 1, vocab):
        raise ValueError(f"draft_probs must be [B, T - 1, V] = {[bsz, t - 1, vocab]}, got "
                         f"{list(q_node.meta['val'].shape)}")
    if t != k + 1:
        raise ValueError(f"the graph verifies T = {t} tokens per row; num_speculative_tokens = {k} "
                         f"needs T = {k + 1}")
    if not 0 <= max_logprobs <= vocab:
        raise ValueError(f"max_logprobs must be in 0..V = 0..{vocab}, got {max_logprobs}")
    logits = outs[0]
    if logits_val.dtype != torch.float32:  # the accept/reject functions work in float32
        with gm.graph.inserting_before(output_node(gm.graph)):
            logits = gm.graph.call_function(torch.ops.aten._to_copy.default, (outs[0],), {"dtype": torch.float32})
    # trace the guests on the program's device: device kwargs are baked in
    return HostLogits(ids_node, logits, bsz, vocab, logits_val.device, q_node)


def replace_outputs(gm: fx.GraphModule, results) -> fx.GraphModule:
    """Make the spliced ``results`` the graph's outputs; lint and recompile."""
    output_node(gm.graph).args = (tuple(results),)
    gm.graph.lint()
    gm.recompile()
    return gm
