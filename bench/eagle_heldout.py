"""Teacher-forced top-1 of an EAGLE / EAGLE-3 head on held-out prompts, through the
training code path: ``specc extract``'s greedy answers and hidden states,
``specc.train.make_batch`` and ``specc.train.teacher_forced_outputs`` (no feature noise).
Top-1 = fraction of answer tokens ``x_{p+2}`` that the head's argmax after the pair
(``f_p``, ``x_{p+1}``) gets right: ``specc train``'s ``acc`` on unseen data, and what the
eager drafter's first draft would be at every position (tests/test_eagle_train_consistency.py).

    python bench/eagle_heldout.py heads/smollm2-eagle --target examples/smollm2.yaml \\
        --prompts heldout.jsonl --num-prompts 16 \\
        --spec-bench /work/shared/data/spec_bench_questions.jsonl --num-bench 16 \\
        --max-tokens 64 --work /tmp/heldout --threads 1

``--prompts FILE``: its first N prompts (JSONL as ``specc train --prompts``; e.g. questions
the target wrote with ``--prompts self`` that the head never trained on); ``--spec-bench
FILE --num-bench N``: the prompts ``specc bench --dataset spec_bench --num-prompts N``
runs. ``--work DIR`` caches the extracted hidden states (reused when present).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def top1(head, target, hs_dir: Path) -> tuple[float, int, dict[str, float]]:
    """(top-1 over all answer tokens, answer tokens, per-prompt top-1)."""
    from specc.train import make_batch, teacher_forced_outputs
    from specc.train_data import load_sequences

    seqs, index = load_sequences(hs_dir)
    ids = [x for sh in index["shards"] for x in sh["ids"]]
    fused = 0 if head.method == "eagle" else len(head.hidden_layers)
    hits = total = 0
    per = {}
    with torch.inference_mode():
        for ident, s in zip(ids, seqs):
            am = head.compute_logits(teacher_forced_outputs(head, make_batch([s], fused, target.model.norm)))[0]
            am = am.argmax(-1)                                   # [T]: row p scores x_{p+2}
            n, p0 = len(s.token_ids), s.prompt_length
            ok = am[p0 - 2 : n - 2] == s.token_ids[p0:n]
            hits, total = hits + int(ok.sum()), total + len(ok)
            per[ident] = round(float(ok.float().mean()), 2) if len(ok) else float("nan")
    return hits / max(total, 1), total, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head")
    ap.add_argument("--target", default="examples/smollm2.yaml")
    ap.add_argument("--prompts")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--spec-bench")
    ap.add_argument("--num-bench", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--work")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from specc.datasets import load_dataset, read_jsonl
    from specc.extract import extract_hidden_states
    from specc.models.eagle_checkpoint import load_eagle_head
    from specc.train import _load_target, head_layers

    target = _load_target(a.target)
    head = load_eagle_head(a.head, target)
    layers, _ = head_layers(head.method, target.config.num_hidden_layers,
                            list(head.hidden_layers) if head.method == "eagle3" else None)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="eagle-heldout-"))
    sets = {}
    if a.prompts:
        sets["held-out prompts"] = read_jsonl(a.prompts)[: a.num_prompts]
    if a.spec_bench:
        sets["spec_bench"] = load_dataset("spec_bench", a.spec_bench, num_prompts=a.num_bench).prompts
    for name, prompts in sets.items():
        hs = work / f"{name.replace(' ', '_')}-{len(prompts)}-{a.max_tokens}-{'_'.join(map(str, layers))}"
        if not (hs / "index.json").is_file():
            extract_hidden_states(a.target, prompts, layers, hs, max_tokens=a.max_tokens, progress=False)
        acc, n, per = top1(head, target, hs)
        print(f"{name}: teacher-forced top-1 {acc:.3f} over {n} answer tokens ({len(prompts)} prompts)")
        print("  per prompt:", per)


if __name__ == "__main__":
    main()
