"""Host cost of suffix decoding's data structure (no model): build, per-step drafting,
global tree insert / draft / evict, and memory per token held.

    python bench/suffix_drafting.py --dataset-path ../shared/data/spec_bench_questions.jsonl

Token ids: the dataset's first turns, joined and tokenized with SmolLM2's tokenizer (the
embedded model, converted on first use). Times are the best of a few repeats, in one
process; run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc


def _best(f, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset-path", required=True, help="a .jsonl with a 'turns' list per line (Spec-Bench)")
    ap.add_argument("--depth", type=int, default=24, help="suffix_decoding_max_tree_depth (default: %(default)s)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: %(default)s)")
    ap.add_argument("--context", type=int, default=2000, help="request context length (default: %(default)s)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from specc.models.loader import resolve_hf_folder
    from specc.runtime.drafters.suffix_tree import SuffixTree

    tok = AutoTokenizer.from_pretrained(resolve_hf_folder("smollm2-135m-instruct"))
    with open(args.dataset_path, encoding="utf-8") as f:
        ids = tok.encode(" ".join(json.loads(line)["turns"][0] for line in f if line.strip()))
    d, k, n = args.depth, args.k, args.context
    assert len(ids) >= 3 * n + 30_000, "dataset too small for these sizes"
    draft = (k, 1.0, 0.1)

    build = _best(lambda: SuffixTree(d).extend(0, ids[:n]))
    print(f"request tree over a {n}-token prompt: {build * 1e3:.1f} ms ({build / n * 1e6:.1f} us/token)")
    tree = SuffixTree(d)
    tree.extend(0, ids[:n])
    gen = ids[n : n + 400]
    t0 = time.perf_counter()
    for i in range(0, len(gen), 2):
        tree.extend(0, gen[i : i + 2])
        tree.speculate_sequence(0, *draft)
    step = (time.perf_counter() - t0) / (len(gen) // 2)
    print(f"step on the request's tree (append 2 tokens + draft a chain): {step * 1e6:.0f} us")

    def fill() -> SuffixTree:
        glob = SuffixTree(d)
        for r in range(100):
            glob.extend(r, ids[r * 300 : (r + 1) * 300])
        return glob

    insert = _best(fill, 3) / 100
    tracemalloc.start()  # a second fill, traced (tracing slows it down)
    glob = fill()
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"global tree, 100 outputs of 300 tokens: {insert * 1e3:.1f} ms per output, {glob.num_nodes} nodes, "
          f"{mem / 2**20:.1f} MiB ({mem / 30_000:.0f} B/token)")
    seen, unseen = ids[:n], ids[2 * n : 3 * n]
    for name, ctx in (("context inside it", seen), ("unseen context", unseen)):
        t = _best(lambda: [glob.speculate(ctx[: n // 2 + i], *draft) for i in range(100)]) / 100
        print(f"draft from the global tree ({name}): {t * 1e6:.0f} us")
    t0 = time.perf_counter()
    for r in range(50):
        glob.remove(r)
    print(f"evict one output: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
