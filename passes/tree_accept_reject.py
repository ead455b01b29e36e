"""Fuse tree accept/reject and KV compaction into a tree verify program.

A tree verify program (:class:`specc.runtime.programs.TreeVerifyProgram`, flattened by
:func:`specc.passes.signature.export_flat`) returns the target's logits ``[B, N, V]``
at the ``N = k + 1`` nodes of each row's token tree. :func:`fuse_tree_accept_reject`
appends what the eager reference (:meth:`specc.runtime.engine.Engine._verify_tree`) does
after that forward, so the compiled ``tree_step`` returns tokens, counts and logprobs
and leaves the cache as the next step expects:

1. ``processed`` = each row's logits processors at every node
   (:func:`specc.passes.accept_reject.processed_logits`, as the chain step);
2. :func:`specc.kernels.tree_rejection_sampler.tree_rejection_sample`: greedy rows keep
   the longest path matching the target's argmax, sampling rows run the recursive
   rejection over the tree (accept uniforms ``uniforms[:, k:2k]``, the final token's
   ``uniforms[:, 2k]``: the chain step's ``[B, 2k + 1]`` layout);
3. :func:`specc.passes.kv_compaction.compact_accepted_kv` moves the accepted path's K/V
   to ``start + 1 ..`` in every layer (in place, in the graph);
4. logprobs of emitted token ``j`` under the processed distribution at the node that
   scored it (``accepted_nodes[:, j]``).

The eager engine calls the same three functions (2-4 above), so both paths run one
implementation. The computation is :func:`tree_accept_reject_outputs`; the pass traces it
(``export_flat``) and splices it into the program (:mod:`specc.passes.splice`), binding
the program's ``input_ids``, ``parents``, ``num_draft_tokens``, ``start`` and ``kv_*``
inputs.
"""

from __future__ import annotations

import torch
from torch import fx

from specc.kernels.tree_rejection_sampler import tree_rejection_sample
from specc.passes.accept_reject import (
    ACCEPT_REJECT_OUTPUTS,
    output_logprobs,
    processed_logits,
    replace_outputs,
    verify_graph_logits,
)
from specc.passes.kv_compaction import compact_accepted_kv
from specc.passes.signature import export_flat, placeholders
from specc.passes.splice import splice
from specc.runtime.sampling import greedy_mask

__all__ = ["TREE_ACCEPT_REJECT_INPUTS", "TREE_ACCEPT_REJECT_OUTPUTS", "TREE_VERIFY_INPUTS",
           "fuse_tree_accept_reject", "path_logits", "tree_accept_reject_outputs"]

#: Inputs of the tree verify program the pass reads (besides ``input_ids`` and ``kv_*``).
TREE_VERIFY_INPUTS = ("start", "parents", "num_draft_tokens")
#: Placeholders :func:`fuse_tree_accept_reject` appends, in order.
TREE_ACCEPT_REJECT_INPUTS = ("uniforms", "temperature", "top_k", "top_p")
#: What the fused program returns: the chain step's outputs, then the accepted path.
TREE_ACCEPT_REJECT_OUTPUTS = (*ACCEPT_REJECT_OUTPUTS, "accepted_nodes")


def path_logits(processed: torch.Tensor, accepted_nodes: torch.Tensor) -> torch.Tensor:
    """``[B, K+1, V]`` rows of ``processed`` (by node) at ``accepted_nodes`` ``[B, K+1]``
    (``-1`` reads node 0): row ``j`` scored emitted token ``j``."""
    return processed.gather(1, accepted_nodes.clamp(min=0)[:, :, None].expand_as(processed))


def tree_accept_reject_outputs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    parents: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    start: torch.Tensor,
    kv: tuple[torch.Tensor, ...],
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_logprobs: int,
    trash_pos: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tree step's accept/reject, KV compaction and logprobs from the verify logits.

    Args (``B`` rows, ``N = k + 1`` nodes):
        logits: ``[B, N, V]`` float32 raw target logits at nodes ``0..k``.
        input_ids: ``[B, N]`` int64, the nodes' tokens (node 0 = the last token).
        parents: ``[B, k]`` int64, node ``i + 1``'s parent at ``[:, i]`` (``0..i``).
        num_draft_tokens: ``[B]`` int64 in ``0..k``.
        start: ``[B]`` int64, the root's cache position.
        kv: the per-layer K/V tensors the verify wrote (compacted in place).
        uniforms: ``[B, 2k + 1]`` float32 (columns ``k..2k``: accept tests, final token).
        temperature, top_k, top_p: ``[B]``, as :func:`~specc.passes.accept_reject.accept_reject_outputs`.
        max_logprobs: top alternatives returned per position.
        trash_pos: the cache's trash position.

    Returns:
        :data:`TREE_ACCEPT_REJECT_OUTPUTS`: the chain step's five, shapes as there
        (``T = N``): the accepted path's tokens then the recovered/bonus token, ``-1``
        after; the path length; logprobs at the scoring nodes; then ``accepted_nodes``
        ``[B, N]`` int64, ``[0, n_1, .., n_a, -1, ..]`` (the proposer learns its path).
    """
    k = logits.shape[1] - 1
    processed = processed_logits(logits, temperature, top_k, top_p)
    result = tree_rejection_sample(processed, input_ids[:, 1:], parents, num_draft_tokens,
                                   greedy_mask(temperature), uniforms[:, k : 2 * k], uniforms[:, 2 * k])
    compact_accepted_kv(kv, start, result.accepted_nodes, result.num_accepted, trash_pos)
    tokens = result.output_token_ids
    return (tokens, result.num_accepted,
            *output_logprobs(path_logits(processed, result.accepted_nodes), tokens, max_logprobs),
            result.accepted_nodes)


class _TreeAcceptReject(torch.nn.Module):
    """:func:`tree_accept_reject_outputs` as a module, for tracing; the argument names
    become the guest graph's placeholder names (``kv`` flattens to ``kv_0 ..``)."""

    def __init__(self, max_logprobs: int, trash_pos: int) -> None:
        super().__init__()
        self.max_logprobs, self.trash_pos = max_logprobs, trash_pos

    def forward(self, logits, input_ids, parents, num_draft_tokens, start, kv, uniforms, temperature, top_k, top_p):
        return tree_accept_reject_outputs(logits, input_ids, parents, num_draft_tokens, start, kv, uniforms,
                                          temperature, top_k, top_p, max_logprobs=self.max_logprobs,
                                          trash_pos=self.trash_pos)


def fuse_tree_accept_reject(gm: fx.GraphModule, *, num_speculative_tokens: int, max_logprobs: int,
                            trash_pos: int) -> fx.GraphModule:
    """Append :func:`tree_accept_reject_outputs` to a tree verify graph.

    Args:
        gm: flat graph of :class:`~specc.runtime.programs.TreeVerifyProgram`
            (``export_flat``): placeholders ``input_ids [B, N]`` first, ``start``,
            ``parents``, ``num_draft_tokens``, ``kv_*``; output ``(logits [B, N, V],)``
            with ``N = num_speculative_tokens + 1``. Modified in place (and returned).
        num_speculative_tokens: ``k >= 0``.
        max_logprobs: top alternatives per position (``0..V``).
        trash_pos: the cache's trash position (``max_model_len``).

    Returns:
        ``gm`` with :data:`TREE_ACCEPT_REJECT_INPUTS` appended (``uniforms [B, 2k + 1]``
        float32, ``temperature [B]`` float32, ``top_k [B]`` int64, ``top_p [B]`` float32)
        and returning :data:`TREE_ACCEPT_REJECT_OUTPUTS`; the cache inputs are
        compacted in place after the verify's writes.

    Raises:
        ValueError: not such a graph (see
            :func:`~specc.passes.accept_reject.verify_graph_logits`; missing tree or
            cache inputs), or ``max_logprobs`` out of range.
    """
    k = int(num_speculative_tokens)
    host = verify_graph_logits(gm, k, int(max_logprobs), "fuse_tree_accept_reject")
    phs = placeholders(gm)
    kv_names = [n for n in phs if n.startswith("kv_")]
    missing = [n for n in TREE_VERIFY_INPUTS if n not in phs] + ([] if kv_names else ["kv_*"])
    if missing:
        raise ValueError(f"fuse_tree_accept_reject needs a tree verify graph; missing placeholders {missing}")
    bsz, n, vocab, dev = host.batch, k + 1, host.vocab, host.device
    kv = tuple(torch.zeros(tuple(phs[name].meta["val"].shape), dtype=phs[name].meta["val"].dtype, device=dev)
               for name in kv_names)
    example = (
        torch.empty(bsz, n, vocab, dtype=torch.float32, device=dev),
        torch.zeros(bsz, n, dtype=torch.int64, device=dev),
        torch.zeros(bsz, k, dtype=torch.int64, device=dev),
        torch.zeros(bsz, dtype=torch.int64, device=dev),
        torch.zeros(bsz, dtype=torch.int64, device=dev),
        kv,
        torch.zeros(bsz, 2 * k + 1, dtype=torch.float32, device=dev),
        torch.zeros(bsz, dtype=torch.float32, device=dev),
        torch.zeros(bsz, dtype=torch.int64, device=dev),
        torch.ones(bsz, dtype=torch.float32, device=dev),
    )
    guest = export_flat(_TreeAcceptReject(int(max_logprobs), int(trash_pos)), example)
    inputs: dict[str, fx.Node | str] = {"logits": host.logits, "input_ids": host.input_ids}
    inputs.update({name: phs[name] for name in (*TREE_VERIFY_INPUTS, *kv_names)})
    inputs.update({name: name for name in TREE_ACCEPT_REJECT_INPUTS})
    results = splice(gm, guest, inputs)
    return replace_outputs(gm, results)
