"""Make the padding rows of a batch bucket inert by construction.

Programs are compiled per batch bucket ``B`` (static shapes); a step with ``n < B`` live
requests runs the ``B`` program with rows ``n..B-1`` as padding. :func:`pad_rows` adds an
input ``num_rows`` (= ``n``) and rewrites the graph so that nothing a padding row computes
can reach the cache's real entries or the host:

* its ``positions`` are replaced by ``trash_pos`` *before any use*, so every K/V write of
  the row lands at the trash position of its own cache slot (which no real query ever
  sees: see :mod:`specc.models.kv_cache`), whatever ``positions`` the caller passed;
* its ``input_ids`` are replaced by ``0`` before any use, so stale or uninitialised ids
  in a padding row (say ``-1`` or an id past the vocabulary) can never index out of
  range (on a GPU that is a device-side assert that poisons the whole context);
* its ``num_accepted`` is forced to ``0`` and its ``output_token_ids`` to ``-1``.

A tree step (``tree_step``) has no ``positions`` input: its padding rows get their root
``start`` at the trash position, no drafts and every parent the root
(:data:`TREE_FILLS`), so the tree inputs built in the graph put every node of the row at
the trash position too.

Rows never mix in the verify program (attention reads the row's own slot, the logits
processors and accept/reject are per row), so the real rows' outputs equal those of the
same rows run alone. The other outputs of a padding row (logprobs) are left as computed:
meaningless, and never read since its ``num_accepted + 1`` tokens are all ``-1``.

The pass splices two small traced functions (:mod:`specc.passes.splice`): one right after
the placeholders (the rewritten inputs), one before the output (tokens, counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx

from specc.kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID
from specc.passes.accept_reject import ACCEPT_REJECT_INPUTS, ACCEPT_REJECT_OUTPUTS
from specc.passes.signature import export_flat, output_node, output_values, placeholders
from specc.passes.splice import is_guards_fn, splice

__all__ = ["CHAIN_FILLS", "TREE_FILLS", "pad_rows", "padding_inputs", "padding_outputs"]

#: What a padding row's inputs become in a chain step (``"trash"``: the trash position).
CHAIN_FILLS = {"input_ids": 0, "positions": "trash"}
#: ... and in a tree step: the root at the trash position, no drafts, every parent the
#: root (in range for every node).
TREE_FILLS = {"input_ids": 0, "start": "trash", "num_draft_tokens": 0, "parents": 0}


def _real_rows(batch: int, num_rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[B]`` bool, True for rows ``b < num_rows`` (``num_rows`` of shape ``[]`` or ``[1]``)."""
    return torch.arange(batch, device=device) < num_rows.reshape(-1).to(torch.int64)


def padding_inputs(values: Sequence[torch.Tensor], fills: Sequence[int], num_rows: torch.Tensor) -> tuple:
    """Each of ``values`` (``[B, ...]`` int64) with every entry of the rows
    ``b >= num_rows`` set to the matching ``fills`` entry; ``num_rows`` int64 of shape
    ``[]`` (or ``[1]``)."""
    real = _real_rows(values[0].shape[0], num_rows, values[0].device)
    return tuple(torch.where(real.view(-1, *([1] * (x.dim() - 1))), x, torch.full_like(x, fill))
                 for x, fill in zip(values, fills))


def padding_outputs(output_token_ids: torch.Tensor, num_accepted: torch.Tensor,
                    num_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``output_token_ids`` ``[B, T]`` → ``-1`` and ``num_accepted`` ``[B]`` → ``0`` on the
    rows ``b >= num_rows``."""
    real = _real_rows(num_accepted.shape[0], num_rows, num_accepted.device)
    tokens = torch.where(real.unsqueeze(1), output_token_ids,
                         torch.full_like(output_token_ids, PLACEHOLDER_TOKEN_ID))
    return tokens, torch.where(real, num_accepted, torch.zeros_like(num_accepted))


class _Inputs(torch.nn.Module):
    """:func:`padding_inputs` over named inputs, for tracing (``forward(*values, num_rows)``)."""

    def __init__(self, fills: Sequence[int]) -> None:
        super().__init__()
        self.fills = tuple(fills)

    def forward(self, *args):
        return padding_inputs(args[:-1], self.fills, args[-1])


class _Outputs(torch.nn.Module):
    def forward(self, output_token_ids, num_accepted, num_rows):
        return padding_outputs(output_token_ids, num_accepted, num_rows)


def _val(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"{node.name} has no tensor meta['val']: pad_rows needs a graph from "
                         "torch.export (export_flat) then fuse_accept_reject")
    return val


def pad_rows(gm: fx.GraphModule, *, trash_pos: int, fills: Mapping[str, int | str] | None = None) -> fx.GraphModule:
    """Add the ``num_rows`` input and make rows ``b >= num_rows`` inert.

    Args:
        gm: flat step graph already processed by
            :func:`specc.passes.accept_reject.fuse_accept_reject` (or
            :func:`specc.passes.tree_accept_reject.fuse_tree_accept_reject`): the
            placeholders named in ``fills``, then the accept/reject inputs; outputs
            :data:`~specc.passes.accept_reject.ACCEPT_REJECT_OUTPUTS` (the first two,
            ``output_token_ids [B, T]`` and ``num_accepted [B]``, are rewritten).
            Modified in place (and returned).
        trash_pos: the cache's trash position (``max_model_len``). When the graph has a
            ``kv_0`` placeholder, it must be the last index of its dim 2.
        fills: ``{placeholder: value}``, the ``[B, ...]`` int64 inputs a padding row gets
            rewritten, before any use, to ``value`` (an int, or ``"trash"`` for
            ``trash_pos``). Default (a chain step): ``{"input_ids": 0, "positions":
            "trash"}``; a tree step (:class:`specc.runtime.programs.TreeVerifyProgram`)
            passes :data:`TREE_FILLS`.

    Returns:
        ``gm`` with one more placeholder, last: ``num_rows``, an int64 tensor of shape
        ``[]`` (a 0-dim tensor; the graph only broadcasts it, so export it with the shape
        it will be called with — ``torch.tensor(n)``), ``0 <= num_rows <= B``. Rows
        ``b >= num_rows``: every input of ``fills`` rewritten before any use,
        ``num_accepted`` → 0, ``output_token_ids`` → -1. Rows ``b < num_rows`` are
        unchanged.

    Raises:
        ValueError: the graph is not a fused step graph (a placeholder of ``fills`` or
            the accept/reject inputs missing, fewer outputs than expected, missing shape
            metadata), ``trash_pos`` disagrees with the cache, or ``num_rows`` is taken.
    """
    fills = dict(CHAIN_FILLS if fills is None else fills)
    phs = placeholders(gm)
    missing = [n for n in dict.fromkeys((*fills, *ACCEPT_REJECT_INPUTS)) if n not in phs]
    if missing:
        raise ValueError(f"pad_rows needs a graph processed by fuse_accept_reject; "
                         f"missing placeholders {missing}")
    outs = output_values(gm)
    if len(outs) < len(ACCEPT_REJECT_OUTPUTS):
        raise ValueError(f"pad_rows expects the {len(ACCEPT_REJECT_OUTPUTS)} outputs "
                         f"{ACCEPT_REJECT_OUTPUTS} (then any others), got {len(outs)}")
    if not isinstance(trash_pos, int) or trash_pos < 0:
        raise ValueError(f"trash_pos must be a non-negative int, got {trash_pos!r}")
    nodes = [phs[name] for name in fills]
    vals = [_val(n) for n in nodes]
    tok_val, acc_val = _val(outs[0]), _val(outs[1])
    bsz = int(vals[0].shape[0])
    if tuple(acc_val.shape) != (bsz,) or tok_val.dim() != 2 or tok_val.shape[0] != bsz:
        raise ValueError(f"outputs 0/1 must be output_token_ids [B, T] and num_accepted [B] "
                         f"with B = {bsz}, got {list(tok_val.shape)} and {list(acc_val.shape)}")
    if "kv_0" in phs and "val" in phs["kv_0"].meta:
        cache_len = int(phs["kv_0"].meta["val"].shape[2])
        if trash_pos != cache_len - 1:
            raise ValueError(f"trash_pos = {trash_pos}, but the cache's trash position is "
                             f"{cache_len - 1}")

    dev = vals[0].device
    graph = gm.graph
    num_rows_example = torch.tensor(bsz, dtype=torch.int64, device=dev)

    # 1. the filled inputs, spliced right after the placeholders (so before any use);
    #    creates the num_rows placeholder
    values = [trash_pos if v == "trash" else int(v) for v in fills.values()]
    guest = export_flat(_Inputs(values), (*[torch.zeros(tuple(v.shape), dtype=v.dtype, device=dev) for v in vals],
                                          num_rows_example))
    guest_names = list(placeholders(guest))
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    before = last_ph.next
    old = set(graph.nodes)
    bound: dict[str, fx.Node | str] = dict(zip(guest_names, nodes))
    bound[guest_names[-1]] = "num_rows"
    new_values = splice(gm, guest, bound, before=before)
    spliced = set(graph.nodes) - old

    def rewire(user: fx.Node) -> bool:
        if user in spliced:
            return False
        if user.op == "call_module" and is_guards_fn(gm.get_submodule(user.target)):
            return False  # input guards check what the caller passed
        return True

    for node, new in zip(nodes, new_values):
        node.replace_all_uses_with(new, delete_user_cb=rewire)

    # 2. tokens and counts, before the output
    num_rows = placeholders(gm)["num_rows"]
    guest = export_flat(_Outputs(), (torch.zeros(tuple(tok_val.shape), dtype=torch.int64, device=dev),
                                     torch.zeros(bsz, dtype=torch.int64, device=dev),
                                     num_rows_example))
    tokens, accepted = splice(gm, guest, {"output_token_ids": outs[0], "num_accepted": outs[1],
                                          "num_rows": num_rows})
    output_node(graph).args = ((tokens, accepted, *outs[2:]),)
    graph.lint()
    gm.recompile()
    return gm
