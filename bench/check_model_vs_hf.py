"""Check specc's Llama implementation against transformers on the real SmolLM2-135M.

Two checks, both in float32 on the embedded SmolLM2-135M-Instruct (dequantized GGUF):

1. logits: a chat prompt is prefilled and 32 greedy tokens decoded, by specc (static
   KVCache) and by transformers (its own DynamicCache), feeding both the same tokens;
   prints max |dlogits| for the prefill and over the decode steps.
2. greedy text: for 3 chat prompts, 64 new tokens from a plain greedy loop over specc's
   KV cache vs ``transformers.generate(do_sample=False)``; token ids must be identical.

Timings printed are indicative only (eager, first calls include warm-up; the CPU may
be shared).

Usage: python bench/check_model_vs_hf.py [--spec smollm2-135m-instruct]
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specc.models.kv_cache import KVCache
from specc.models.loader import load_model

PROMPTS = [
    "Tell me about the history of Paris, the capital of France.",
    "Write a short poem about the sea.",
    "Explain in simple words how a bicycle works.",
]
LOGIT_TOL = 1e-3


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def logits_check(lm, hf, prompt_ids: list[int], steps: int) -> tuple[float, float]:
    """(prefill max |dlogits|, decode max |dlogits| over `steps` greedy steps)."""
    n = len(prompt_ids)
    cache = KVCache.for_model(lm.config, 1, n + steps + 1)
    ids = torch.tensor([prompt_ids])
    ours = lm.model(ids, torch.arange(n)[None], cache).logits[0, -1]
    hf_cache = DynamicCache(config=hf.config)
    ref = hf(ids, cache=hf_cache, use_cache=True).logits[0, -1].float()
    prefill = (ours - ref).abs().max().item()
    decode = 0.0
    for i in range(steps):
        tok = torch.tensor([[int(ref.argmax())]])
        ours = lm.model(tok, torch.tensor([[n + i]]), cache).logits[0, -1]
        ref = hf(tok, cache=hf_cache, use_cache=True).logits[0, -1].float()
        decode = max(decode, (ours - ref).abs().max().item())
    return prefill, decode


@torch.no_grad()
def specc_greedy(lm, prompt_ids: list[int], max_new: int) -> list[int]:
    """Plain greedy loop over specc's static cache; stops after an eos token."""
    n = len(prompt_ids)
    cache = KVCache.for_model(lm.config, 1, n + max_new)
    logits = lm.model(torch.tensor([prompt_ids]), torch.arange(n)[None], cache).logits
    out: list[int] = []
    for i in range(max_new):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in lm.config.eos_token_ids or i == max_new - 1:
            break
        logits = lm.model(torch.tensor([[tok]]), torch.tensor([[n + i]]), cache).logits
    return out


@torch.no_grad()
def hf_greedy(hf, tokenizer, prompt_ids: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                      do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    lm = load_model(args.spec, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(lm.folder, dtype=torch.float32).eval()
    tok = lm.tokenizer
    print(f"model: {args.spec} ({lm.folder}), fp32, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    ok = True

    prompts_ids = [chat_ids(tok, p) for p in PROMPTS]
    pre, dec = logits_check(lm, hf, prompts_ids[0], args.decode_steps)
    print(f"logits: prefill({len(prompts_ids[0])} tokens) max |dlogits| {pre:.2e}; "
          f"{args.decode_steps} decode steps max |dlogits| {dec:.2e}")
    ok &= max(pre, dec) < LOGIT_TOL

    for prompt, ids in zip(PROMPTS, prompts_ids):
        t0 = time.perf_counter()
        ours = specc_greedy(lm, ids, args.new_tokens)
        t1 = time.perf_counter()
        ref = hf_greedy(hf, tok, ids, args.new_tokens)
        t2 = time.perf_counter()
        same = ours == ref
        ok &= same
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        print(f"greedy {len(ours)} tokens, identical: {same}"
              + ("" if same else f" (first difference at token {first_diff}, lengths {len(ours)}/{len(ref)})")
              + f"; specc {1e3 * (t1 - t0) / len(ours):.1f} ms/token, HF generate "
              f"{1e3 * (t2 - t1) / max(len(ref), 1):.1f} ms/token")
        print(f"  prompt: {prompt!r}\n  output: {tok.decode(ours, skip_special_tokens=True)!r}")

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
