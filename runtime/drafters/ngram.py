"""N-gram drafter: prompt lookup decoding.

Prompt lookup decoding (A. Saxena, 2023, https://github.com/apoorvumang/prompt-lookup-decoding),
vLLM's ``method: ngram``: the drafter's history is the request's prompt followed by every
token emitted so far. To propose, take the last ``n`` tokens of that history for ``n``
from ``prompt_lookup_max`` down to ``prompt_lookup_min``; find the most recent earlier
occurrence of that n-gram (one that ends before the final position, so the match is not
the suffix itself); propose the tokens that followed it. The longest ``n`` with a match
wins; among its matches the most recent one (largest end position). At most
``min(num_speculative_tokens, max_num_tokens)`` tokens are proposed, fewer when the
history ends first; ``[]`` when nothing matches.

Implementation: one vectorised pass that grows the match length. ``cand`` holds the end
positions ``j < L-1`` whose last ``t`` tokens equal the last ``t`` tokens of the history;
going from ``t`` to ``t+1`` keeps the candidates with ``tokens[j-t] == tokens[L-1-t]``.
The matches for every ``n`` are therefore found in ``prompt_lookup_max`` numpy filter
steps over a shrinking candidate array (about 10-50 us for an 8k-token history).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specc.runtime.drafters.base import Proposal, Proposer, StepBatch, pad_drafts

__all__ = ["NgramProposer", "NgramDrafter"]


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        num_speculative_tokens: k, the most tokens one proposal returns (>= 1).
        prompt_lookup_min: shortest n-gram to match (>= 1).
        prompt_lookup_max: longest n-gram to match (>= prompt_lookup_min).
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= "
                f"prompt_lookup_min ({prompt_lookup_min})"
            )
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.prompt_lookup_min = int(prompt_lookup_min)
        self.prompt_lookup_max = int(prompt_lookup_max)

    def propose(
        self, token_ids: Sequence[int] | np.ndarray, max_num_tokens: int | None = None
    ) -> list[int]:
        """Propose draft tokens continuing ``token_ids`` (prompt + emitted tokens).

        Args:
            token_ids: the full history, 1-D sequence of ints (list, numpy array, ...).
            max_num_tokens: optional further cap (e.g. tokens left before max_tokens or
                the context limit); ``<= 0`` gives ``[]``.

        Returns:
            Up to ``min(num_speculative_tokens, max_num_tokens)`` token ids (Python ints),
            ``[]`` when no n-gram of length ``prompt_lookup_min..prompt_lookup_max``
            recurs.
        """
        limit = self.num_speculative_tokens
        if max_num_tokens is not None:
            limit = min(limit, int(max_num_tokens))
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        length = tokens.shape[0]
        if limit <= 0 or length < self.prompt_lookup_min + 1:
            return []

        # Length-1 matches: earlier positions holding the last token.
        cand = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        best_end = -1
        for t in range(1, self.prompt_lookup_max + 1):
            if t > 1:
                # extend every candidate match one token to the left
                cand = cand[cand >= t - 1]
                cand = cand[tokens[cand - (t - 1)] == tokens[length - t]]
            if cand.size == 0:
                break
            if t >= self.prompt_lookup_min:
                best_end = int(cand[-1])  # most recent match of the longest length so far
        if best_end < 0:
            return []
        start = best_end + 1  # <= length - 1: at least one token follows the match
        return [int(x) for x in tokens[start : start + limit]]


class NgramDrafter(Proposer):
    """The ``ngram`` method as an engine proposer: :class:`NgramProposer` over each
    request's prompt + emitted tokens, on the host. Deterministic (q is one-hot), so it
    ignores the uniforms and returns no draft probabilities."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        super().__init__(num_speculative_tokens)
        self.lookup = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)

    def propose(self, batch: StepBatch, max_drafts: list[int], uniforms) -> Proposal:
        drafts = [
            self.lookup.propose(req.all_token_ids, cap) if cap > 0 else []
            for req, cap in zip(batch.requests, max_drafts)
        ]
        ids, num = pad_drafts(drafts)
        return Proposal(ids, num, None)
