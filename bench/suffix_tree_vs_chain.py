"""Suffix decoding's candidate trees vs its best chains on real text, without a model.

    python bench/suffix_tree_vs_chain.py --dataset-path ../shared/data/spec_bench_questions.jsonl

Teacher-forced proxy of a verify step: the text itself plays the target. Each prompt of
the dataset (first turn, SmolLM2's tokenizer) is walked token by token; at every position
past ``--warmup`` the per-request suffix tree over the text so far proposes a chain and a
tree (k nodes, vLLM's defaults), and a draft token counts as accepted when it (and its
whole path) equals the text's next tokens: for the chain the matching prefix, for the
tree the deepest matching node (the greedy tree rule). Prints how often drafts exist, how
often the tree branches, and accepted tokens per drafting position for both.
"""

from __future__ import annotations

import argparse
import json


def _accepted_chain(tokens: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(tokens) and n < len(truth) and tokens[n] == truth[n]:
        n += 1
    return n


def _accepted_tree(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Depth of the deepest node whose path equals ``truth`` (parents: -1 = the context)."""
    depth = [0] * len(tokens)
    ok = [False] * len(tokens)
    best = 0
    for i, (t, p) in enumerate(zip(tokens, parents)):
        d = 1 if p < 0 else depth[p] + 1
        depth[i] = d
        ok[i] = (p < 0 or ok[p]) and d <= len(truth) and truth[d - 1] == t
        if ok[i]:
            best = max(best, d)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset-path", required=True, help="a .jsonl with a 'turns' list per line (Spec-Bench)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=24, help="suffix_decoding_max_tree_depth (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=80, help="prompts walked (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=16, help="tokens before drafting starts (default: %(default)s)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from specc.models.loader import resolve_hf_folder
    from specc.runtime.drafters.suffix_tree import SuffixTree

    tok = AutoTokenizer.from_pretrained(resolve_hf_folder("smollm2-135m-instruct"))
    with open(args.dataset_path, encoding="utf-8") as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()][: args.num_prompts]
    k = args.k
    positions = drafted = branched = acc_chain = acc_tree = 0
    for text in texts:
        ids = tok.encode(text)
        tree = SuffixTree(args.depth)
        tree.extend(0, ids[: args.warmup])
        for i in range(args.warmup, len(ids)):
            truth = ids[i : i + k]
            chain = tree.speculate_sequence(0, k, 1.0, 0.1)
            cand = tree.speculate_sequence(0, k, 1.0, 0.1, tree=True)
            positions += 1
            if len(cand):
                drafted += 1
                branched += any(p != j - 1 for j, p in enumerate(cand.parents))
                acc_chain += _accepted_chain(chain.token_ids, truth)
                acc_tree += _accepted_tree(cand.token_ids, cand.parents, truth)
            tree.extend(0, ids[i : i + 1])
    print(f"{len(texts)} prompts, {positions} positions, k={k}: drafts at {drafted / positions:.0%} of positions, "
          f"the tree branches at {branched / max(drafted, 1):.0%} of those")
    print(f"accepted tokens per drafting position: chain {acc_chain / max(drafted, 1):.3f}, "
          f"tree {acc_tree / max(drafted, 1):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
