"""``specc extract``: target hidden states for prompts and their greedy continuations,
saved as safetensors shards — the data path for training EAGLE / EAGLE-3 heads (vLLM
serves the same purpose with its ``extract_hidden_states`` speculative method).

For each prompt the target generates greedily (eager path, no drafter, up to
``max_tokens`` tokens; 0 = the prompt alone), then one teacher-forced forward over
prompt + output records the hidden states of the chosen layers at every token (HF
numbering: 0 = embeddings, ``i`` = output of decoder layer ``i - 1``, before the final
norm; EAGLE-1 training applies the target's final norm to layer ``L`` itself).

Output folder (written into a temporary sibling, renamed into place when complete; an
earlier extract folder there is replaced, anything else refused):

* ``shard-00000.safetensors``, ...: whole sequences, about ``tokens_per_shard`` tokens each:
  ``hidden_states`` ``[num_tokens, num_layers, hidden_size]`` float32,
  ``token_ids`` ``[num_tokens]`` int64,
  ``offsets`` ``[num_sequences + 1]`` int64 (sequence ``i`` is rows
  ``offsets[i]:offsets[i+1]``), ``prompt_lengths`` ``[num_sequences]`` int64 (the rows of
  a sequence before its first generated token);
* ``index.json``: format, target, layers, hidden size, dtype, counts, and per shard its
  file, counts and the prompts' ids.

Prompt file: JSON lines with a ``"prompt"`` string or a ``"turns"`` list (first turn
used), optional ``"id"`` / ``"question_id"``, ``"category"``, ``"chat": false`` (the
format of :mod:`specc.datasets`, e.g. ``/work/shared/data/*.jsonl``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from specc.atomic import atomic_folder
from specc.config import SpeccConfig, load_config
from specc.datasets import BenchPrompt

__all__ = ["extract_hidden_states", "FORMAT", "INDEX"]

FORMAT = "specc-hidden-states"
FORMAT_VERSION = 1
INDEX = "index.json"
CHUNK = 256  # tokens per teacher-forced forward


def extract_hidden_states(
    config: str | os.PathLike | dict | SpeccConfig,
    prompts: list[BenchPrompt],
    layers: list[int],
    out_dir: str | os.PathLike,
    *,
    max_tokens: int | None = None,
    tokens_per_shard: int = 8192,
    progress: bool = True,
) -> Path:
    """Generate greedily for ``prompts`` and save the hidden states of ``layers``.

    Args:
        config: a ``model.yaml`` path, dict or :class:`SpeccConfig`; its target runs on the
            eager path without speculation (``speculative_config`` and ``enforce_eager``
            are overridden).
        prompts: e.g. ``specc.datasets.read_jsonl(path)``.
        layers: hidden-state indices (HF numbering), in the order stored.
        out_dir: the output folder (module docstring).
        max_tokens: new tokens per prompt (None: the config's ``sampling.max_tokens``; 0:
            prompts only).
        tokens_per_shard: a shard is closed once it holds at least this many tokens.
        progress: a tqdm bar on stderr.

    Returns:
        the output folder.

    Raises:
        ValueError: empty prompts or layers, a layer outside ``[0, L]`` or repeated,
            ``max_tokens < 0``, ``tokens_per_shard < 1``, ``out_dir`` a file or a non-empty
            folder that is not an earlier extract, a prompt the target cannot take (too
            long, ...: named by its id).
        ConfigError: an invalid config or a target that cannot load.
    """
    from specc.session import Session

    out = _check_out_dir(out_dir)
    if not prompts:
        raise ValueError("no prompts to extract")
    if not layers or len(set(layers)) != len(layers):
        raise ValueError(f"--layers {layers}: give distinct layer ids (0 = embeddings, i = output of layer i-1)")
    if (max_tokens is not None and max_tokens < 0) or tokens_per_shard < 1:
        raise ValueError(f"max_tokens = {max_tokens} must be >= 0 and tokens_per_shard = {tokens_per_shard} >= 1")
    cfg = load_config(config, overrides={"enforce_eager": True, "speculative_config": None})
    session = Session(cfg, verbose=False)
    n_layers = session.target.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i <= n_layers]
    if bad:
        raise ValueError(f"--layers: {bad} outside [0, {n_layers}] (the target has {n_layers} layers; "
                         f"0 = embeddings, i = output of decoder layer i-1)")
    max_tokens = cfg.sampling.max_tokens if max_tokens is None else max_tokens
    with atomic_folder(out) as tmp:
        writer = _ShardWriter(tmp, tokens_per_shard)
        bar = _progress(len(prompts), progress)
        step = cfg.max_num_seqs
        for i in range(0, len(prompts), step):
            group = prompts[i : i + step]
            for p, (ids, n_prompt) in zip(group, _sequences(session, group, max_tokens)):
                writer.add(p.id, torch.tensor(ids), n_prompt, _hidden_states(session, ids, layers))
                bar.update(1)
        bar.close()
        writer.close()
        index = {
            "format": FORMAT, "version": FORMAT_VERSION, "target": cfg.target, "layers": list(layers),
            "hidden_size": session.target.config.hidden_size, "num_target_layers": n_layers,
            "dtype": "float32", "max_tokens": max_tokens, "num_sequences": writer.total_sequences,
            "num_tokens": writer.total_tokens, "shards": writer.shards,
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return out


def _sequences(session, group: list[BenchPrompt], max_tokens: int):
    """(prompt + greedy output ids, prompt length) per prompt of ``group``."""
    from specc import SamplingParams

    prompt_ids = []
    for p in group:
        try:
            prompt_ids.append(session.tokenize(p.text, chat=p.chat))
        except (ValueError, TypeError) as e:
            raise ValueError(f"prompt {p.id!r}: {e}") from None
    if max_tokens == 0:
        return [(ids, len(ids)) for ids in prompt_ids]
    outs = session.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            use_speculation=False)
    for p, o in zip(group, outs):
        if o.error:
            raise ValueError(f"prompt {p.id!r}: {o.error}")
    return [(list(o.prompt_token_ids) + list(o.token_ids), len(o.prompt_token_ids)) for o in outs]


@torch.inference_mode()
def _hidden_states(session, ids: list[int], layers: list[int]) -> torch.Tensor:
    """``[len(ids), len(layers), hidden]`` float32: one teacher-forced target forward (in
    chunks of CHUNK tokens) over a fresh one-slot cache."""
    from specc.models.kv_cache import KVCache

    model, cfg = session.target.model, session.config
    cache = KVCache.for_model(model.config, 1, len(ids), cfg.torch_dtype, cfg.device)
    pieces = []
    for start in range(0, len(ids), CHUNK):
        chunk = torch.tensor([ids[start : start + CHUNK]], device=cfg.device)
        pos = torch.arange(start, start + chunk.shape[1], device=cfg.device)[None]
        out = model(chunk, pos, cache, kv_len=start + chunk.shape[1], hidden_layers=tuple(layers))
        pieces.append(torch.stack([out.hidden_states[i][0] for i in layers], dim=1))
    return torch.cat(pieces).float().cpu()


class _ShardWriter:
    """Collects whole sequences and writes a shard once it holds ``limit`` tokens."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        self.shards: list[dict] = []
        self.total_sequences = self.total_tokens = 0
        self._reset()

    def _reset(self) -> None:
        self.hidden, self.tokens, self.prompt_lengths, self.ids = [], [], [], []

    def add(self, ident: str, tokens: torch.Tensor, prompt_length: int, hidden: torch.Tensor) -> None:
        self.hidden.append(hidden)
        self.tokens.append(tokens.to(torch.int64))
        self.prompt_lengths.append(prompt_length)
        self.ids.append(ident)
        if sum(len(t) for t in self.tokens) >= self.limit:
            self._flush()

    def close(self) -> None:
        if self.tokens:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        lengths = torch.tensor([len(t) for t in self.tokens])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file({"hidden_states": torch.cat(self.hidden).contiguous(), "token_ids": torch.cat(self.tokens),
                   "offsets": offsets, "prompt_lengths": torch.tensor(self.prompt_lengths, dtype=torch.int64)},
                  str(self.folder / name), metadata={"format": FORMAT})
        n = int(offsets[-1])
        self.shards.append({"file": name, "num_sequences": len(self.tokens), "num_tokens": n, "ids": self.ids})
        self.total_sequences += len(self.tokens)
        self.total_tokens += n
        self._reset()


def _is_extract(folder: Path) -> bool:
    try:
        return json.loads((folder / INDEX).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_out_dir(out_dir) -> Path:
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not (out.is_dir() and (_is_extract(out) or not any(out.iterdir()))):
        raise ValueError(f"--out {out}: exists and is not a specc extract folder; choose another folder "
                         "(specc only replaces an earlier extract)")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="seq", desc="specc extract", file=sys.stderr, disable=not enabled)
