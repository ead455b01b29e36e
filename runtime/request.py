"""Per-request state: tokens, its random stream, stop checks and counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specc.outputs import RequestMetrics, TokenLogprob
from specc.sampling_params import SamplingParams


@dataclass
class Request:
    """One live generation request.

    Invariants: ``num_computed`` tokens of ``prompt_token_ids + output_token_ids`` have
    their K/V in the target's cache; the last token (``last_token``) never has, it is the
    first input of the next step. ``generator`` is the request's own CPU random stream:
    every uniform the request uses comes from it, in a fixed pattern per step, so a seeded
    request gives the same output whatever it is batched with.
    """

    request_id: int
    prompt: str | list
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    eos_token_ids: frozenset[int]
    max_model_len: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_computed: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""  # detokenized output, cut before a matched stop string
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    arrival_time: float = field(default_factory=time.perf_counter)
    streamed_chars: int = 0  # how much of ``text`` a stream consumer has been given

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def max_new_drafts(self, k: int) -> int:
        """Draft tokens worth verifying this step: a step emits at most drafts + 1 tokens,
        so never more than the tokens left under max_tokens and max_model_len."""
        left_tokens = self.params.max_tokens - len(self.output_token_ids)
        left_context = self.max_model_len - self.num_tokens
        return max(0, min(k, left_tokens - 1, left_context - 1))

    def append_tokens(self, token_ids: list[int], detokenize) -> int:
        """Append a step's tokens, stopping at the first stop condition.

        Args:
            token_ids: tokens the step produced (accepted drafts + recovered/bonus token).
            detokenize: ``list[int] -> str`` for the output so far.

        Returns:
            how many of ``token_ids`` were kept (the rest fall after a stop and are dropped).
        """
        p = self.params
        kept = 0
        for tok in token_ids:
            self.output_token_ids.append(tok)
            kept += 1
            if not p.ignore_eos and tok in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", tok
            elif p.stop_token_ids and tok in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", tok
            elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= self.max_model_len:
                self.finish_reason = "length"
            if p.stop:
                self._update_text(detokenize)
                hit = self._find_stop_string()
                if hit is not None:
                    self.finish_reason, self.stop_reason = "stop", hit
            if self.finished:
                break
        if not p.stop:
            self._update_text(detokenize)
        if self.finish_reason == "length" and self.text.endswith("\ufffd"):
            # max_tokens / max_model_len cut the output inside a multi-byte character (an
            # emoji's byte tokens): drop the incomplete character instead of showing U+FFFD
            self.text = self.text.rstrip("\ufffd")
        return kept

    def _update_text(self, detokenize) -> None:
        self.text = detokenize(self.output_token_ids)

    def _find_stop_string(self) -> str | None:
        """Cut ``text`` before the earliest stop string and return it, if any is present."""
        best = None
        for s in self.params.stop:
            i = self.text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def stream_delta(self) -> str:
        """New text safe to show: while running, hold back a tail that could still grow
        into a stop string, so a stream never shows text that a stop later removes."""
        visible = len(self.text)
        if not self.finished:
            # an incomplete multi-byte character decodes as U+FFFD until its last byte
            while visible > self.streamed_chars and self.text[visible - 1] == "\ufffd":
                visible -= 1
        if not self.finished and self.params.stop:
            for s in self.params.stop:
                for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:n]):
                        visible = min(visible, len(self.text) - n)
                        break
        delta = self.text[self.streamed_chars : visible]
        self.streamed_chars = max(self.streamed_chars, visible)
        return delta
