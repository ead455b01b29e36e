"""Tree vs chain proposals of a host drafter (suffix decoding or n-gram) on real text, without a model.

    python bench/suffix_tree_vs_chain.py --dataset-path ../shared/data/spec_bench_questions.jsonl
    python bench/suffix_tree_vs_chain.py --method ngram --dataset-path ../shared/data/spec_bench_questions.jsonl
    python bench/make_agent_edit_set.py -o /tmp/agent_edit.jsonl --num-requests 9
    python bench/suffix_tree_vs_chain.py --method ngram --dataset-path /tmp/agent_edit.jsonl --replies next-file

Teacher-forced proxy of a verify step: the text itself plays the target. Each prompt of
the dataset (first turn or ``prompt``, SmolLM2's tokenizer) is walked token by token; at
every drafting position the drafter proposes a chain and a tree (k nodes) from the text
so far, and a draft token counts as accepted when it (and its whole path) equals the
text's next tokens: for the chain the matching prefix, for the tree the deepest matching
node (the greedy tree rule). Prints how often drafts exist, how often the tree branches,
and accepted tokens per drafting position for both.

Drafters: ``suffix``: the per-request suffix tree (vLLM's defaults; chain =
``SuffixTree.speculate(tree=False)``, tree = ``tree=True``); ``ngram``: prompt lookup
(``NgramProposer.propose`` vs ``propose_tree``, the ``ngram_propose_tree`` tree).

Text walked: ``--replies none`` (default) the prompt itself, drafting past ``--warmup``
tokens; ``--replies next-file`` (an agent-edit set from ``bench/make_agent_edit_set.py``)
the prompt followed by the reply a perfect model gives, the file as the next request
shows it in a ```python block, drafting over the reply only (the last request, which has
no next, is skipped).
"""

from __future__ import annotations

import argparse
import re


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


def _walks(texts: list[str], replies: str, tok, warmup: int) -> list[tuple[list[int], int]]:
    """``(token ids, first drafting position)`` per walked text."""
    if replies == "none":
        return [(tok.encode(t), warmup) for t in texts]
    out = []
    for prompt, nxt in zip(texts, texts[1:]):
        code = re.search(r"```python\n(.*?)\n```", nxt, re.S)
        if code is None:
            raise SystemExit("--replies next-file needs prompts with a ```python block (make_agent_edit_set.py)")
        head = tok.encode(prompt)
        out.append((head + tok.encode(f"```python\n{code.group(1)}\n```"), len(head)))
    return out


def _suffix(args):
    """``(prepare(ids, first), chain(i), tree(i), advance(i))`` over a per-request suffix tree."""
    from specc.runtime.drafters.suffix_tree import SuffixTree

    state = {}

    def prepare(ids, first):
        state["ids"], state["tree"] = ids, SuffixTree(args.depth)
        state["tree"].extend(0, ids[:first])

    def chain(i):
        return state["tree"].speculate_sequence(0, args.k, 1.0, 0.1)

    def tree(i):
        return state["tree"].speculate_sequence(0, args.k, 1.0, 0.1, tree=True)

    def advance(i):
        state["tree"].extend(0, state["ids"][i : i + 1])

    return prepare, chain, tree, advance


def _ngram(args):
    import numpy as np

    from specc.runtime.drafters.ngram import NgramProposer
    from specc.runtime.drafters.suffix_tree import Candidate

    lookup = NgramProposer(args.k, args.prompt_lookup_min, args.prompt_lookup_max)
    state = {}

    def prepare(ids, first):
        state["ids"] = np.asarray(ids)

    def chain(i):
        toks = lookup.propose(state["ids"][:i])
        return Candidate(toks, list(range(-1, len(toks) - 1)))

    def tree(i):
        return lookup.propose_tree(state["ids"][:i])

    return prepare, chain, tree, lambda i: None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset-path", required=True, help="a .jsonl of prompts ('turns' or 'prompt' per line)")
    ap.add_argument("--method", choices=("suffix", "ngram"), default="suffix", help="drafter (default: %(default)s)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=24, help="suffix_decoding_max_tree_depth (default: %(default)s)")
    ap.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram (default: %(default)s)")
    ap.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=80, help="prompts walked (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=16, help="tokens before drafting starts (default: %(default)s)")
    ap.add_argument("--replies", choices=("none", "next-file"), default="none",
                    help="what follows each prompt (module docstring; default: %(default)s)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from specc.datasets import read_jsonl
    from specc.models.loader import resolve_hf_folder

    tok = AutoTokenizer.from_pretrained(resolve_hf_folder("smollm2-135m-instruct"))
    texts = [p.text for p in read_jsonl(args.dataset_path)][: args.num_prompts]
    walks = _walks(texts, args.replies, tok, args.warmup)
    prepare, chain_at, tree_at, advance = (_ngram if args.method == "ngram" else _suffix)(args)
    k = args.k
    positions = drafted = branched = acc_chain = acc_tree = 0
    for ids, first in walks:
        prepare(ids, first)
        for i in range(first, len(ids)):
            truth = ids[i : i + k]
            chain, cand = chain_at(i), tree_at(i)
            positions += 1
            if len(cand):
                drafted += 1
                branched += any(p != j - 1 for j, p in enumerate(cand.parents))
                acc_chain += _accepted_chain(chain.token_ids, truth)
                acc_tree += _accepted_tree(cand.token_ids, cand.parents, truth)
            advance(i)
    print(f"{args.method}: {len(walks)} texts, {positions} positions, k={k}: drafts at "
          f"{drafted / max(positions, 1):.0%} of positions, the tree branches at {branched / max(drafted, 1):.0%} of those")
    print(f"accepted tokens per drafting position: chain {acc_chain / max(drafted, 1):.3f}, "
          f"tree {acc_tree / max(drafted, 1):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
