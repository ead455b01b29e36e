"""User-facing per-request sampling parameters (vLLM names)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from specc.config import SamplingDefaults

__all__ = ["SamplingParams", "MAX_LOGPROBS"]

#: Largest number of top logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


def _is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Sampling parameters of one request.

    * ``temperature``: 0 is greedy; > 0 divides the logits.
    * ``top_p``: nucleus sampling mass, 0 < top_p <= 1 (1 = off).
    * ``top_k``: keep the k most likely tokens; 0 or -1 = off (1 = greedy).
    * ``max_tokens``: most tokens to generate.
    * ``stop``: strings that end generation (normalised to a list; not included in the
      output text).
    * ``stop_token_ids``: token ids that end generation (normalised to a list).
    * ``ignore_eos``: keep generating past the EOS token.
    * ``seed``: per-request seed; ``None`` draws from the session's seed stream.
    * ``logprobs``: number of top logprobs to return besides the chosen token's
      (``0`` = only the chosen token's, ``None`` = none), at most :data:`MAX_LOGPROBS`.

    Construction never raises on bad values: call :meth:`validate`, so a session can
    turn a bad request into a per-request error.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Normalise without raising; validate() reports anything odd.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)

    # ------------------------------------------------------------------ validation
    def validate(self) -> "SamplingParams":
        """Raise ``ValueError`` naming every bad field, its value and the allowed
        range (one ``; ``-separated clause per problem). Returns ``self``."""
        errors: list[str] = []

        def bad(name: str, allowed: str) -> None:
            errors.append(f"{name} = {getattr(self, name)!r}: {allowed}")

        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        p = self.top_p
        if not _is_real(p) or not (0 < p <= 1):
            bad("top_p", "must be a number with 0 < top_p <= 1")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.stop, list) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(i) and i >= 0 for i in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of integers >= 0")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            bad("logprobs", f"must be None or an integer with 0 <= logprobs <= {MAX_LOGPROBS}")
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))
        return self

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax: ``temperature == 0`` or ``top_k == 1``."""
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_defaults(cls, defaults: "SamplingDefaults", **overrides: Any) -> "SamplingParams":
        """Build from a config's :class:`~specc.config.SamplingDefaults`, then apply
        ``overrides`` (any field of this class)."""
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"unknown SamplingParams field(s): {', '.join(sorted(unknown))} "
                f"(allowed: {', '.join(cls.__dataclass_fields__)})"
            )
        kwargs: dict[str, Any] = {
            "temperature": defaults.temperature,
            "top_p": defaults.top_p,
            "top_k": defaults.top_k,
            "max_tokens": defaults.max_tokens,
            "seed": defaults.seed,
        }
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable dict (for logs and benchmark records)."""
        return asdict(self)

