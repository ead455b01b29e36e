"""Test drafters from ../shared/cases/correctness.md: oracle, scripted, adversarial, empty,
and an oracle that ignores the engine's per-row cap.

Each is a deterministic proposer (q one-hot) keyed on a request's prompt token ids.
Usage: run non-speculative greedy first, hand the outputs to ``OracleDrafter``, then
``Session(config, proposer=OracleDrafter(k, {tuple(prompt_ids): output_ids}))``
(``helpers.greedy_truth`` and ``helpers.oracle_table`` build that table).
"""

from __future__ import annotations

from typing import Callable

from specc.runtime.drafters.base import Proposal, Proposer, StepBatch, pad_drafts
from specc.runtime.request import Request


class ScriptedDrafter(Proposer):
    """Proposes ``script(request)`` (cut to k and to the engine's cap). Records every call
    as ``(request_id, history_at_call, proposed)`` in ``self.calls``."""

    def __init__(self, k: int, script: Callable[[Request], list[int]]):
        super().__init__(k)
        self.script = script
        self.calls: list[tuple[int, list[int], list[int]]] = []

    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms) -> Proposal:
        drafts = []
        for req, cap in zip(batch.requests, max_drafts):
            d = list(self.script(req))[: min(cap, self.num_speculative_tokens)] if cap > 0 else []
            self.calls.append((req.request_id, list(req.all_token_ids), d))
            drafts.append(d)
        ids, num = pad_drafts(drafts, self.num_speculative_tokens)
        return Proposal(ids, num, None)


class OracleDrafter(ScriptedDrafter):
    """Proposes the true continuation: ``truth[tuple(prompt_ids)]`` after the tokens emitted
    so far (everything is accepted while the output follows the truth)."""

    def __init__(self, k: int, truth: dict[tuple[int, ...], list[int]]):
        def script(req: Request) -> list[int]:
            full = truth[tuple(req.prompt_token_ids)]
            n = len(req.output_token_ids)
            return full[n : n + k] if full[:n] == req.output_token_ids else []

        super().__init__(k, script)


class AdversarialDrafter(ScriptedDrafter):
    """Proposes tokens that are always wrong: the true next token + 1 (mod vocab), then
    arbitrary tokens."""

    def __init__(self, k: int, truth: dict[tuple[int, ...], list[int]], vocab_size: int):
        def script(req: Request) -> list[int]:
            full = truth[tuple(req.prompt_token_ids)]
            n = len(req.output_token_ids)
            nxt = full[n] if n < len(full) else 0
            return [(nxt + 1 + i) % vocab_size for i in range(k)]

        super().__init__(k, script)


class EmptyDrafter(ScriptedDrafter):
    """Never proposes anything (every step is a plain decode)."""

    def __init__(self, k: int):
        super().__init__(k, lambda req: [])


class CapIgnoringOracle(Proposer):
    """Always proposes the next k true tokens, ignoring ``max_drafts``: the engine alone
    must cut the step to fit max_tokens and max_model_len."""

    def __init__(self, k: int, truth: dict[tuple[int, ...], list[int]]):
        super().__init__(k)
        self.truth = truth

    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms) -> Proposal:
        drafts = []
        for req in batch.requests:
            full = self.truth[tuple(req.prompt_token_ids)]
            n = len(req.output_token_ids)
            drafts.append(full[n : n + self.num_speculative_tokens])
        ids, num = pad_drafts(drafts, self.num_speculative_tokens)
        return Proposal(ids, num, None)
