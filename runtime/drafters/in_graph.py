"""The proposer of a compiled step that drafts inside its program (early exit).

A compiled early-exit ``spec_step`` (:class:`specc.runtime.programs.EarlyExitStepProgram`)
makes its k drafts on the device, in the same program as the verify: the host has
nothing to draft. :class:`InGraphDrafter` stands in the engine's proposer slot so the
engine keeps one step loop: it only says how many drafts each row may verify (its cap,
as :class:`~specc.runtime.drafters.draft_model.DraftModelProposer` does) and returns
placeholder tokens, which :class:`specc.runtime.replay.CompiledEngine` does not feed
(the program takes the last tokens only). No state: the drafter shares the target's
cache and the verify rewrites it.
"""

from __future__ import annotations

import torch

from specc.runtime.drafters.base import Proposal, Proposer, StepBatch

__all__ = ["InGraphDrafter"]


class InGraphDrafter(Proposer):
    """Drafts are made by the compiled program; see the module docstring.

    Args:
        num_speculative_tokens: k of the programs.
        num_draft_layers: N of the early-exit drafter the programs were built for.
    """

    drafts_in_graph = True

    def __init__(self, num_speculative_tokens: int, num_draft_layers: int):
        super().__init__(num_speculative_tokens)
        self.num_draft_layers = num_draft_layers

    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms: torch.Tensor) -> Proposal:
        k = self.num_speculative_tokens
        num = torch.tensor(max_drafts, dtype=torch.long).clamp(max=k)
        return Proposal(torch.zeros(batch.size, k, dtype=torch.long), num)
