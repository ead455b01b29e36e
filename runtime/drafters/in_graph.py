"""The proposer of a compiled step that drafts inside its program (early exit, EAGLE).

A compiled early-exit or EAGLE ``spec_step``
(:class:`specc.runtime.programs.EarlyExitStepProgram`,
:class:`~specc.runtime.programs.EagleStepProgram`) makes its k drafts on the device, in
the same program as the verify: the host has nothing to draft. :class:`InGraphDrafter`
stands in the engine's proposer slot so the engine keeps one step loop: it only says how
many drafts each row may verify (its cap, as
:class:`~specc.runtime.drafters.draft_model.DraftModelProposer` does) and returns
placeholder tokens, which :class:`specc.runtime.replay.CompiledEngine` does not feed
(the program takes the last tokens only).

An early-exit drafter has no state: it shares the target's cache and the verify rewrites
it. An EAGLE head has: its KV cache and the fused target features, which the programs
read and write in place (:class:`~specc.runtime.drafters.eagle.EagleState`, allocated by
:func:`eagle_program_state` from the programs' signatures), and per slot how far the head
has caught up (``done``), which the stand-in sets at admission and moves with its slot;
the engine builds each step's catch-up pairs from it
(:meth:`~specc.runtime.drafters.eagle.EagleState.catch_up_pairs`). A row that falls more
than ``k + 1`` pairs behind is one that ran decode steps (every row of its group had a
draft cap of 0), and caps never grow back, so its drafts are never verified again.
"""

from __future__ import annotations

import torch

from specc.models.kv_cache import KVCache
from specc.runtime.drafters.base import Proposal, Proposer, StepBatch
from specc.runtime.drafters.eagle import EagleState
from specc.runtime.request import Request

__all__ = ["InGraphDrafter", "eagle_program_state", "HEAD_KV", "FEATURES"]

#: Input names of an EAGLE program's state: the head's per-layer K/V (``head_kv_0 ..``,
#: as ``kv_*``) and the feature buffer.
HEAD_KV = "head_kv_"
FEATURES = "features"


class InGraphDrafter(Proposer):
    """Drafts are made by the compiled program; see the module docstring.

    Args:
        num_speculative_tokens: k of the programs.
        num_draft_layers: N of the early-exit drafter the programs were built for (None
            for an EAGLE head).
        state: an EAGLE head's program state (:func:`eagle_program_state`), None for early
            exit.
    """

    drafts_in_graph = True

    def __init__(self, num_speculative_tokens: int, num_draft_layers: int | None = None,
                 state: EagleState | None = None):
        super().__init__(num_speculative_tokens)
        self.num_draft_layers = num_draft_layers
        self.state = state

    def prefill(self, request: Request, slot: int) -> None:
        """The compiled prefill ran the head's prompt pass: pairs ``0 .. n-2`` are done."""
        if self.state is not None:
            self.state.done[slot] = max(len(request.prompt_token_ids) - 1, 0)

    def move_slot(self, src: int, dst: int) -> None:
        if self.state is not None:
            self.state.move_slot(src, dst)

    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms: torch.Tensor) -> Proposal:
        k = self.num_speculative_tokens
        num = torch.tensor(max_drafts, dtype=torch.long).clamp(max=k)
        return Proposal(torch.zeros(batch.size, k, dtype=torch.long), num)


def eagle_program_state(signature: dict[str, tuple[list[int], torch.dtype]], num_slots: int,
                        device) -> EagleState:
    """Zeroed EAGLE state for ``num_slots`` slots, shaped as a program's state inputs.

    Args:
        signature: ``{input name: (shape, dtype)}`` of a program that takes the state
            (``head_kv_{2i}`` / ``head_kv_{2i+1}`` ``[b, kv_heads, S + 1, head_dim]``,
            ``features`` ``[b, S + 1, H]``; other names are ignored).
        num_slots: slots to allocate (the target cache's).
        device: where.

    Raises:
        ValueError: the signature has no ``features`` or no ``head_kv_*`` inputs.
    """
    kv = sorted((n for n in signature if n.startswith(HEAD_KV)), key=lambda n: int(n[len(HEAD_KV):]))
    if FEATURES not in signature or not kv:
        raise ValueError(f"not an EAGLE program signature: inputs {sorted(signature)}")
    (_, heads, length, head_dim), dtype = signature[kv[0]]
    cache = KVCache(len(kv) // 2, num_slots, heads, length - 1, head_dim, dtype, device)
    return EagleState(cache, signature[FEATURES][0][-1])
