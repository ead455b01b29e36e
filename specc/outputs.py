"""Results returned by :meth:`specc.Session.generate` (vLLM-style names)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of one emitted token under the target's processed distribution.

    ``logprob`` is the chosen token's log-probability (natural log); ``top`` holds the
    ``SamplingParams.logprobs`` most likely tokens as ``(token_id, logprob)`` pairs.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SpecMetrics:
    """Speculative-decoding counters, named as vLLM's spec-decode metrics.

    ``num_drafts`` counts verify steps that carried at least one draft token;
    ``num_draft_tokens`` the draft tokens proposed; ``num_accepted_tokens`` the accepted
    draft tokens that were emitted (never tokens cut by a stop); ``accepted_per_position[i]``
    how often the draft at position i was accepted and emitted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per verify step (1.0 with no drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0.0 with no drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def add(self, other: "SpecMetrics") -> None:
        """Accumulate ``other`` into ``self`` (session-level totals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        self.accepted_per_position += [0] * (n - len(self.accepted_per_position))
        for i, c in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += c

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["acceptance_rate"] = self.acceptance_rate
        return d


@dataclass
class RequestMetrics:
    """Timing of one request. Times in seconds (``time.perf_counter`` deltas)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    num_steps: int = 0  # target forward passes after prefill (decode or verify)
    tokens_per_step: list[int] = field(default_factory=list)  # emitted per step, prefill first
    spec: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / wall time from arrival to finish (includes prefill)."""
        return self.num_generation_tokens / self.total_time if self.total_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        d["spec"] = self.spec.to_dict()
        return d


@dataclass
class RequestOutput:
    """Output of one request.

    ``finish_reason`` is ``"stop"`` (end token, stop token or stop string), ``"length"``
    (max_tokens or max_model_len) or ``"error"`` (the request was refused; ``error`` says
    why and the other requests of the call are unaffected).
    """

    request_id: int
    prompt: str | list
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    stop_reason: str | int | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict (what ``specc generate --json`` prints)."""
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "error": self.error,
            "logprobs": None if self.logprobs is None else [asdict(lp) for lp in self.logprobs],
            "metrics": self.metrics.to_dict(),
        }
