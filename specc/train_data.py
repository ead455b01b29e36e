"""Training data for ``specc train``: prompts that never overlap the evaluation set, the
target's greedy answers and their hidden states (via :mod:`specc.extract`), cached.

Prompt sources (self-distillation: the head learns the target's own answers):

* ``self``: the target writes its own user questions. Its chat template is opened at a
  user turn (everything the template puts before the user's text: system prompt, role
  header) and the target samples what follows (temperature 1.0, top-p 0.95, one seed per
  question: ``seed + i``) up to its end token. Questions are deduplicated and filtered
  (:func:`overlaps`) against the evaluation prompts given with ``--exclude`` (e.g.
  Spec-Bench's ``question.jsonl``, which holds MT-bench's 80 questions). Needs no data
  outside the model.
* ``FILE.jsonl``: the user's prompts, one JSON object per line with a ``"prompt"`` string
  or a ``"turns"`` list (first turn used), as :mod:`specc.datasets` reads them; filtered
  against ``--exclude`` the same way.

Overlap rule (:func:`overlaps`): after lower-casing and keeping only words (``[a-z0-9]+``),
a training prompt is dropped when it equals an evaluation prompt, one contains the other,
or they share any run of :data:`NGRAM` consecutive words (the n-gram test used for
contamination checks of LLM training sets).

Cache (``DIR/data``): ``prompts.jsonl`` (the training prompts, written once),
``meta.json`` (what produced them) and ``hidden_states/`` (a :mod:`specc.extract` folder:
prompt + greedy answer token ids and the hidden states of the layers a head needs). A
rerun with the same settings reads them back; different settings are refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specc.datasets import BenchPrompt, DatasetError, jsonl_rows, read_jsonl

__all__ = ["NGRAM", "normalize", "overlaps", "EvalFilter", "user_turn_prefix", "self_generated_prompts",
           "prepare_data", "Sequence", "load_sequences", "draft_vocabulary"]

NGRAM = 8  # words in a shared run that marks a training prompt as overlapping the evaluation
QUESTION_TEMPERATURE, QUESTION_TOP_P = 1.0, 0.95
MIN_WORDS = 3  # shorter generated questions are dropped
_MARK = "\x00SPECC_USER\x00"


# ------------------------------------------------------------------------------ overlap
def normalize(text: str) -> list[str]:
    """Lower-cased words (``[a-z0-9]+`` runs) of ``text``."""
    return re.findall(r"[a-z0-9]+", text.lower())


class EvalFilter:
    """Membership test against evaluation prompts (module docstring: the rule).

    Args:
        eval_texts: the evaluation prompts (e.g. every turn of Spec-Bench's questions).
    """

    def __init__(self, eval_texts: list[str]):
        self._joined = [" ".join(normalize(t)) for t in eval_texts]
        self._joined = [t for t in self._joined if t]
        self._ngrams = {g for t in self._joined for g in _ngrams(t.split())}

    def overlaps(self, text: str) -> bool:
        words = normalize(text)
        joined = " ".join(words)
        if not joined:
            return False
        if any(g in self._ngrams for g in _ngrams(words)):
            return True
        return any(joined == e or f" {joined} " in f" {e} " or f" {e} " in f" {joined} " for e in self._joined)


def overlaps(text: str, eval_texts: list[str]) -> bool:
    """True when ``text`` overlaps any of ``eval_texts`` (one-off form of :class:`EvalFilter`)."""
    return EvalFilter(eval_texts).overlaps(text)


def _ngrams(words: list[str]):
    return (" ".join(words[i : i + NGRAM]) for i in range(len(words) - NGRAM + 1))


def eval_texts(paths: list[str | Path]) -> list[str]:
    """Every turn of every prompt in the JSONL files ``paths`` (not only the first: a
    training prompt must not repeat a follow-up question either)."""
    texts = []
    for path in paths:
        try:
            for _, row in jsonl_rows(path):
                turns = row.get("turns")
                texts += [t for t in turns if isinstance(t, str)] if isinstance(turns, list) else []
                if isinstance(row.get("prompt"), str):
                    texts.append(row["prompt"])
        except DatasetError as e:
            raise DatasetError(f"--exclude {e}") from None
    return texts


# ------------------------------------------------------------------------------ prompts
def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (system prompt
    and user header included). Raises ValueError for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--prompts self needs a chat template (the target writes its own user turns); "
                         "give --prompts FILE.jsonl instead")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    return tokenizer.encode(text[: text.index(_MARK)], add_special_tokens=False)


def self_generated_prompts(session, num: int, *, seed: int, max_tokens: int = 64,
                           exclude: EvalFilter | None = None, max_attempts: int | None = None,
                           progress: bool = False) -> list[BenchPrompt]:
    """``num`` distinct user questions sampled from the target (module docstring).

    Args:
        session: a :class:`specc.Session` without speculation use (the target samples).
        seed: question ``i`` (over all attempts) samples with seed ``seed + i``.
        max_tokens: longest question in tokens (a longer one is cut there and kept: the
            answer to it is what the head learns from).
        exclude: evaluation filter; overlapping questions are dropped.
        max_attempts: samples drawn at most (default ``4 * num``).

    Returns:
        ``num`` prompts with ids ``self-<i>`` (category ``self``, chat template on).

    Raises:
        ValueError: fewer than ``num`` usable questions after ``max_attempts`` samples.
    """
    from specc import SamplingParams

    prefix = user_turn_prefix(session.tokenizer)
    max_attempts = 4 * num if max_attempts is None else max_attempts
    seen: set[str] = set()
    out: list[BenchPrompt] = []
    batch = max(1, session.config.max_num_seqs)
    i = 0
    bar = _bar(num, progress, "questions")
    while len(out) < num and i < max_attempts:
        n = min(batch, max_attempts - i)
        params = [SamplingParams(temperature=QUESTION_TEMPERATURE, top_p=QUESTION_TOP_P, max_tokens=max_tokens,
                                 seed=seed + i + j) for j in range(n)]
        for j, o in enumerate(session.generate([list(prefix)] * n, params, use_speculation=False)):
            text = o.text.strip()
            key = " ".join(normalize(text))
            if (o.error or len(key.split()) < MIN_WORDS or key in seen
                    or (exclude is not None and exclude.overlaps(text))):
                continue
            seen.add(key)
            if len(out) < num:
                out.append(BenchPrompt(id=f"self-{i + j}", category="self", text=text, raw_category="self"))
                bar.update(1)
        i += n
    bar.close()
    if len(out) < num:
        raise ValueError(f"the target wrote only {len(out)} usable questions of {num} in {max_attempts} samples "
                         "(duplicates, under 3 words or overlapping the evaluation prompts): lower --num-prompts "
                         "or give --prompts FILE.jsonl")
    return out


def _bar(total: int, enabled: bool, unit: str):
    import sys

    from tqdm.auto import tqdm
    return tqdm(total=total, unit=unit, desc=f"specc train: {unit}", file=sys.stderr, disable=not enabled)


# ------------------------------------------------------------------------------ cache
def prepare_data(config, data_dir: Path, *, layers: list[int], prompts: str, num_prompts: int, max_tokens: int,
                 seed: int, exclude: list[str | Path] = (), progress: bool = True) -> Path:
    """Training prompts, greedy answers and hidden states in ``data_dir`` (created), or
    the ones already there. Returns the :mod:`specc.extract` folder.

    Args:
        config: the target's ``model.yaml`` (path, dict or SpeccConfig).
        layers: hidden-state layers to record (HF numbering; :mod:`specc.extract`).
        prompts: ``"self"`` or a JSONL path (module docstring).
        num_prompts: training prompts wanted (a file: its first N after filtering).
        max_tokens: greedy answer length per prompt.
        exclude: evaluation JSONL files the prompts must not overlap.

    Raises:
        ValueError: cached data made with other settings (the differences listed), too few
            prompts left after filtering, and :func:`specc.extract.extract_hidden_states`'s errors.
    """
    from specc.extract import INDEX, extract_hidden_states

    meta = {"prompts": prompts if prompts == "self" else str(Path(prompts).resolve()), "num_prompts": num_prompts,
            "max_tokens": max_tokens, "seed": seed, "layers": list(layers),
            "exclude": sorted(str(Path(p).resolve()) for p in exclude), "ngram": NGRAM}
    data_dir.mkdir(parents=True, exist_ok=True)
    meta_file, prompt_file, hs = data_dir / "meta.json", data_dir / "prompts.jsonl", data_dir / "hidden_states"
    if meta_file.is_file():
        old = json.loads(meta_file.read_text())
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{data_dir} holds data made with other settings ("
                             + ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
                             + "); use another --out or the same settings")
    if not prompt_file.is_file():
        chosen = _choose_prompts(config, prompts, num_prompts, seed, exclude, progress)
        tmp = prompt_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text,
                                           "chat": p.chat}) + "\n" for p in chosen), encoding="utf-8")
        tmp.replace(prompt_file)
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    if not (hs / INDEX).is_file():
        extract_hidden_states(config, read_jsonl(prompt_file), list(layers), hs, max_tokens=max_tokens,
                              progress=progress)
    return hs


def _choose_prompts(config, prompts: str, num: int, seed: int, exclude, progress: bool) -> list[BenchPrompt]:
    flt = EvalFilter(eval_texts(list(exclude))) if exclude else None
    if prompts != "self":
        rows = read_jsonl(prompts)
        kept = [p for p in rows if flt is None or not flt.overlaps(p.text)]
        if not kept:
            raise ValueError(f"--prompts {prompts}: every prompt overlaps the --exclude set")
        return kept[:num]
    from specc.config import load_config
    from specc.session import Session

    cfg = load_config(config, overrides={"enforce_eager": True, "speculative_config": None})
    return self_generated_prompts(Session(cfg, verbose=False), num, seed=seed, exclude=flt, progress=progress)


# ------------------------------------------------------------------------------ reading
@dataclass
class Sequence:
    """One training sequence: prompt + greedy answer."""

    token_ids: torch.Tensor  # [n] int64
    hidden: torch.Tensor     # [n, num_layers, H] float32, layers in the extract's order
    prompt_length: int       # rows before the first answer token


def load_sequences(hs_dir: Path) -> tuple[list[Sequence], dict]:
    """The sequences of an extract folder, in file order, and its ``index.json``."""
    from safetensors.torch import load_file

    index = json.loads((hs_dir / "index.json").read_text())
    seqs = []
    for shard in index["shards"]:
        sh = load_file(str(hs_dir / shard["file"]))
        off = sh["offsets"].tolist()
        for j in range(len(off) - 1):
            seqs.append(Sequence(sh["token_ids"][off[j] : off[j + 1]], sh["hidden_states"][off[j] : off[j + 1]],
                                 int(sh["prompt_lengths"][j])))
    return seqs, index


def draft_vocabulary(seqs: list[Sequence], size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's reduced draft vocabulary: the ``size`` most frequent tokens of the answers
    (ties and unused slots: lowest ids first), as the published buffers.

    Returns:
        ``d2t`` ``[size]`` int64 (draft id ``d`` is target id ``d + d2t[d]``, target ids
        increasing) and ``t2d`` ``[vocab_size]`` bool.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"--draft-vocab-size {size}: must be in [1, {vocab_size}]")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.token_ids[s.prompt_length:], minlength=vocab_size)
    # stable sort by count descending: equal counts keep increasing ids
    order = torch.sort(-counts, stable=True).indices
    kept = order[:size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(size), t2d
