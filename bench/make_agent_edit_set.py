"""Write a repetitive prompt set: one source file edited in successive requests, as an agent loop does.

Each request shows the current version of a Python file and asks for one small change
with the complete updated file in reply; the next request shows the file with that
change applied (by this script, deterministically), and so on. The answers a model gives
repeat most of the file, and every request repeats most of the previous one, which is
the workload suffix decoding is built for (Oliaro et al., "SuffixDecoding",
arXiv 2411.04975: agentic loops and code editing).

The edits cycle through: add a marker comment above a function, rename a function (every
word-boundary occurrence), add a line to its docstring. The source defaults to a module
of the Python standard library (``colorsys``: PSF licence, on every Python; nothing is
copied into the repository: the set is generated when needed).

Output: JSON lines in specc's dataset format (``{"id", "category": "agent_edit",
"prompt"}``), for ``specc bench --dataset FILE.jsonl``.

Usage: python bench/make_agent_edit_set.py -o agent_edit.jsonl [--source FILE.py]
    [--module colorsys] [--num-requests 8] [--max-lines 80]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import re
from pathlib import Path

PROMPT = ("You are editing the Python file below.\n\n```python\n{code}\n```\n\n"
          "Change: {change}\nReply with the complete updated file in one ```python block.")


def _functions(code: str) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)]


def _edit(code: str, step: int) -> tuple[str, str]:
    """``(instruction, code after the edit)`` for edit number ``step``."""
    names = _functions(code)
    if not names:
        raise ValueError("the source has no function to edit")
    name = names[step % len(names)]
    kind = step % 3
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(rf"\s*def {re.escape(name)}\(", line))
    indent = re.match(r"\s*", lines[at]).group(0)
    if kind == 0:
        lines.insert(at, f"{indent}# reviewed in step {step + 1}")
        return f"add the comment `# reviewed in step {step + 1}` on the line above `def {name}`.", "\n".join(lines)
    if kind == 1:
        new = f"{name}_v{step + 1}"
        return (f"rename the function `{name}` to `{new}` everywhere in the file.",
                re.sub(rf"\b{re.escape(name)}\b", new, code))
    body = indent + "    "
    lines.insert(at + 1, f'{body}"""Edited in step {step + 1}."""' if '"""' not in lines[at + 1]
                 else f"{body}# docstring kept; edited in step {step + 1}")
    return f"add a one-line docstring (or a comment if it has one) at the top of `{name}`.", "\n".join(lines)


def make_set(code: str, num_requests: int) -> list[dict]:
    """The ``num_requests`` prompts (dicts in specc's dataset format)."""
    out = []
    for step in range(num_requests):
        change, after = _edit(code, step)
        out.append({"id": f"edit{step + 1}", "category": "agent_edit",
                    "prompt": PROMPT.format(code=code, change=change)})
        code = after
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--source", type=Path, help="a Python file (default: --module's source)")
    ap.add_argument("--module", default="colorsys", help="standard-library module used when --source is not given")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-lines", type=int, default=80, help="keep the first N lines (prompt length)")
    a = ap.parse_args(argv)
    code = a.source.read_text() if a.source else inspect.getsource(importlib.import_module(a.module))
    lines = code.splitlines()[: a.max_lines]
    while lines:  # cut at a point where the file still parses
        try:
            ast.parse("\n".join(lines))
            break
        except SyntaxError:
            lines.pop()
    rows = make_set("\n".join(lines), a.num_requests)
    a.output.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} requests to {a.output}")


if __name__ == "__main__":
    main()
