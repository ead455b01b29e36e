"""transformers ``generate`` baselines for ``specc bench --baselines``.

* ``hf``: plain greedy ``generate``.
* ``hf-prompt-lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens=k``,
  ``max_matching_ngram_size`` = the config's ``prompt_lookup_max``, or transformers'
  default when the config's method is not ngram). transformers tries n-gram sizes from the
  max down to 1; specc stops at ``prompt_lookup_min``.
* ``hf-assisted``: assisted generation with the config's drafter: ``assistant_model`` for a
  separate ``draft_model``, ``assistant_early_exit=N`` (the target's first N layers + final
  norm + lm_head, specc's early-exit drafter) for ``num_draft_layers: N``; k fixed
  (``num_assistant_tokens=k``, constant schedule, no confidence cut-off). Not applicable
  to ngram configs or configs without speculation.

Each run counts the target's forward passes (a forward hook) to report the mean tokens
per target forward, Spec-Bench's "mean accepted tokens".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

NAMES = ("hf", "hf-prompt-lookup", "hf-assisted")


@dataclass
class HFRun:
    token_ids: list[int]
    time: float  # s, the generate call (prefill included)
    forwards: int  # target forward passes, prefill included


@dataclass
class HFBaseline:
    """One transformers configuration; ``reason`` set = not applicable (never runs)."""

    name: str
    label: str
    reason: str | None = None
    model: object = None
    kwargs: dict = field(default_factory=dict)
    _forwards: int = 0  # target forwards of the current run
    _num_layers: int = 0  # the target's full layer count

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids, stop: list[str], tokenizer) -> HFRun:
        assert self.reason is None and self.model is not None
        model = self.model
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
        extra = dict(self.kwargs)
        if stop:
            extra.update(stop_strings=stop, tokenizer=tokenizer)
        self._forwards = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=sorted(eos_ids), pad_token_id=tokenizer.pad_token_id or sorted(eos_ids)[0],
                **extra,
            )
        dt = time.perf_counter() - t0
        return HFRun(out[0, len(prompt_ids):].tolist(), dt, self._forwards)

    def _count(self, module, args, output) -> None:
        # early exit drafts with the same module, its layer count cut to N meanwhile
        base = getattr(module, module.base_model_prefix)
        if base.config.num_hidden_layers == self._num_layers:
            self._forwards += 1


def build(names: list[str], session) -> list[HFBaseline]:
    """Load the transformers models the requested baselines need (the target once)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = session.config
    spec = cfg.speculative_config
    k = spec.num_speculative_tokens if spec else 4
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"--baselines: unknown {', '.join(unknown)} (choose from {', '.join(NAMES)})")

    def load(folder):
        m = AutoModelForCausalLM.from_pretrained(folder, **_dtype_kwarg(cfg.torch_dtype)).to(cfg.device).eval()
        m.generation_config.temperature = m.generation_config.top_p = m.generation_config.top_k = None
        return m

    target = None
    out = []
    for name in names:
        b = HFBaseline(name, name)
        if name == "hf":
            b.label = "hf generate"
        elif name == "hf-prompt-lookup":
            ngram = spec.prompt_lookup_max if spec is not None and spec.method == "ngram" else None
            b.label = f"hf prompt lookup k={k}"
            b.kwargs = dict(prompt_lookup_num_tokens=k)
            if ngram is not None:
                b.kwargs["max_matching_ngram_size"] = ngram
        elif name == "hf-assisted":
            b.label = "hf assisted"
            if spec is None or spec.method != "draft_model":
                what = f"method {spec.method!r}" if spec else "no speculative_config"
                b.reason = f"not applicable: {what} has no drafter model (see hf-prompt-lookup for ngram)"
            else:
                assist = dict(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                              assistant_confidence_threshold=0.0)
                if spec.is_early_exit:
                    b.label = f"hf assisted early-exit {spec.num_draft_layers}L k={k}"
                    b.kwargs = dict(assistant_early_exit=spec.num_draft_layers, **assist)
                else:
                    from specc.models.loader import resolve_hf_folder

                    drafter = load(resolve_hf_folder(spec.model))
                    for key, v in assist.items():
                        setattr(drafter.generation_config, key, v)
                    b.label = f"hf assisted k={k}"
                    b.kwargs = dict(assistant_model=drafter)
        if b.reason is None:
            if target is None:
                target = load(session.target.folder)
            b.model = target
            b._num_layers = getattr(target, target.base_model_prefix).config.num_hidden_layers
            target.register_forward_hook(b._count)
        out.append(b)
    return out


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    import transformers
    from packaging.version import Version

    new = Version(transformers.__version__.split("+")[0]) >= Version("4.56")
    return {"dtype" if new else "torch_dtype": dtype}
