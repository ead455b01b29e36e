"""Plain helpers shared by the test files.

Fixtures live in ``conftest.py``, the test drafters in ``spec_drafters.py`` and the KV
cache checker of C4/C5 in ``kv_shadow.py``; what is specific to one file stays there.

* tiny models: :func:`build_tiny_model` (what the ``tiny_*_dir`` fixtures save),
  :data:`LOOPING_SEEDS`;
* sessions: :func:`make_session`, :func:`drafter_spec`, :func:`greedy`;
* the non-speculative truth the oracle drafters replay: :func:`greedy_truth`,
  :func:`oracle_table`, :func:`find_block_end`;
* :func:`reference_ngram` (plain prompt lookup) and :func:`patched` (temporarily replace
  a method on one object);
* random token trees for the tree attention tests: :func:`random_parents`,
  :func:`random_tree_inputs`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from specc.sampling_params import SamplingParams
from specc.runtime.token_tree import batch_ancestor_mask
from specc.session import Session

# ------------------------------------------------------------------------------ tiny models
TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
TINY_SEED = 1234

# Seeds on which the tiny Llama's greedy trajectory settles into a 2-token loop: prefixes of
# those trajectories are prompts that greedy continues exactly and n-gram lookup always hits.
LOOPING_SEEDS = [[14090] * 8, [34200] * 8]


def build_tiny_model(model_type: str, tokenizer, out_dir: Path, seed: int = TINY_SEED, *,
                     vocab_size: int | None = None, lm_head_std: float = 0.5) -> Path:
    """Save a tiny random ``model_type`` ("llama" or "qwen2") with ``tokenizer`` into
    ``out_dir`` (safetensors + config + tokenizer files); returns ``out_dir``.

    ``vocab_size`` defaults to the tokenizer's. Norm weights are 1 +- 0.1, biases (Qwen2's
    q/k/v) N(0, 0.1) and the ``lm_head`` N(0, ``lm_head_std``): the default 0.5 spreads the
    logits widely (std ~4), so greedy ties, which would make equality tests flaky, are unlikely."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(TINY_DIMS, vocab_size=len(tokenizer) if vocab_size is None else vocab_size,
                  initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if model_type == "llama":
        config, cls = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0), LlamaForCausalLM
    elif model_type == "qwen2":
        config, cls = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=100000.0), Qwen2ForCausalLM
    else:
        raise ValueError(model_type)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
        model.lm_head.weight.normal_(0.0, lm_head_std)  # tied for qwen2: the embedding too
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# ------------------------------------------------------------------------------ sessions
def greedy(max_tokens: int, **kw) -> SamplingParams:
    """Greedy sampling params (``kw``: any other SamplingParams field)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def drafter_spec(method: str, k: int, model_dir=None, **overrides) -> dict:
    """``speculative_config`` of a built-in drafter with ``k`` speculative tokens:

    * ``"ngram"``: prompt lookup, n-grams of 1..4 tokens;
    * ``"draft_model"``: the model in ``model_dir`` drafts (own KV cache);
    * ``"early_exit"``: the target's first layer drafts (shared cache);
    * ``"suffix"``: suffix decoding with vLLM's defaults (global tree on; pass
      ``suffix_decoding_max_cached_requests=0`` for drafts that depend on the request only);
    * ``"eagle"`` / ``"eagle3"``: the head in ``model_dir`` (e.g. ``tiny_eagle_heads[method]``).

    ``overrides`` replace or add fields (e.g. ``num_draft_layers=8``)."""
    if method == "ngram":
        spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=4)
    elif method == "draft_model":
        assert model_dir is not None, "draft_model needs the drafter's model_dir"
        spec = dict(method="draft_model", num_speculative_tokens=k, model=str(model_dir))
    elif method in ("eagle", "eagle3"):
        assert model_dir is not None, f"{method} needs the head's folder as model_dir"
        spec = dict(method=method, num_speculative_tokens=k, model=str(model_dir))
    elif method == "early_exit":
        spec = dict(method="draft_model", num_speculative_tokens=k, num_draft_layers=1)
    elif method == "suffix":
        spec = dict(method="suffix", num_speculative_tokens=k)
    else:
        raise ValueError(method)
    return {**spec, **overrides}


def make_session(model_dir, spec: dict | None = None, *, proposer=None, max_model_len: int = 256,
                 max_num_seqs: int = 4, enforce_eager: bool = True, **config) -> Session:
    """A quiet :class:`Session` on the model in ``model_dir``: speculative config ``spec``
    (None: no drafter), or a test drafter ``proposer``; ``config``: other config fields."""
    cfg = dict(target=str(model_dir), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               enforce_eager=enforce_eager, **config)
    if spec is not None:
        cfg["speculative_config"] = spec
    return Session(cfg, proposer=proposer, verbose=False)


def spec_counts(outs) -> list[tuple]:
    """Per output ``(num_drafts, num_draft_tokens, num_accepted_tokens,
    accepted_per_position)``: equal on two paths iff they drafted and accepted alike."""
    return [(o.metrics.spec.num_drafts, o.metrics.spec.num_draft_tokens, o.metrics.spec.num_accepted_tokens,
             o.metrics.spec.accepted_per_position) for o in outs]


# ------------------------------------------------------------------------------ oracle truth
def greedy_truth(session: Session, prompts, max_tokens: int, **kw) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of each prompt's non-speculative greedy run."""
    outs = session.generate(prompts, greedy(max_tokens, **kw), use_speculation=False)
    return [(o.prompt_token_ids, o.token_ids) for o in outs]


def oracle_table(truth) -> dict[tuple[int, ...], list[int]]:
    """``{tuple(prompt ids): output ids}``: the form the oracle drafters take."""
    return {tuple(p): out for p, out in truth}


def find_block_end(truth, eos_ids, k: int, p: int, blocks: range):
    """(prompt, output, index) from ``truth`` ((prompt ids, output ids) pairs): the output's
    first occurrence of a token (not an end token, not its last one) at offset ``p``
    (1-based) of verify block ``m`` (0-based), for the first ``m`` in ``blocks`` that has one.

    With every draft accepted, output index 0 comes from the prefill and verify block m
    emits indices 1 + m(k+1) .. (m+1)(k+1): offset p of block m is index 1 + (p-1) + m(k+1)."""
    for m in blocks:
        i = 1 + (p - 1) + m * (k + 1)
        for prompt, out in truth:
            if i < len(out) - 1 and out[i] not in out[:i] and out[i] not in eos_ids:
                return prompt, out, i
    raise AssertionError(f"test data: no first-occurrence token at offset {p} of verify blocks "
                         f"{blocks.start + 1}..{blocks.stop} (1-based) for k={k}")


# ------------------------------------------------------------------------------ misc
def reference_ngram(tokens, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                    max_num_tokens: int | None = None) -> list[int]:
    """Obviously-correct prompt lookup: the longest n-gram suffix (max..min) that recurs
    earlier, its most recent earlier occurrence (ending before the last position), the
    tokens after it (at most k, or ``max_num_tokens`` if smaller)."""
    tokens = list(tokens)
    limit = num_speculative_tokens if max_num_tokens is None else min(num_speculative_tokens, max_num_tokens)
    if limit <= 0:
        return []
    length = len(tokens)
    for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n :]
        # candidate starts s: the match tokens[s:s+n] must end before the last position
        for s in range(length - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                return tokens[s + n : s + n + limit]
    return []


@contextmanager
def patched(obj, name: str, new: Callable):
    """Within the block, ``obj.<name>`` is ``new`` (an attribute of this one object);
    afterwards the previous attribute shows through again."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, new)
    try:
        yield new
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def forbid_compiling(monkeypatch) -> None:
    """Make tracing and compiling raise (``torch.export``, AOTInductor, ``torch.compile``):
    opening an artifact must do neither."""
    def refuse(*a, **k):
        raise AssertionError("opening an artifact must not trace or compile")

    monkeypatch.setattr(torch.export, "export", refuse)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    monkeypatch.setattr(torch, "compile", refuse)


# ------------------------------------------------------------------------------ token trees
def random_parents(gen: torch.Generator, rows: int, k: int) -> torch.Tensor:
    """``[rows, k]`` int64 random token-tree parents: ``[b, i]`` uniform in ``0..i``."""
    return (torch.rand(rows, k, generator=gen) * torch.arange(1, k + 1)).long()


def random_tree_inputs(seed: int, bsz: int, heads: int, kv_heads: int, n: int, d: int, s: int,
                       dtype=torch.float32, device="cpu"):
    """``(q, k_cache, v_cache, prefix_lens, tree_mask, parents)``: random parents
    (``parents[b, i]`` uniform in ``0..i``), prefix lengths ``0..s - n`` that differ per row
    (the first row 0, the last ``s - n``: a tree that ends at the cache's end)."""
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(gen, bsz, n - 1)
    prefix_lens = torch.randint(0, s - n + 1, (bsz,), generator=gen)
    prefix_lens[0], prefix_lens[-1] = 0, s - n
    q = torch.randn(bsz, heads, n, d, generator=gen)
    k = torch.randn(bsz, kv_heads, s, d, generator=gen)
    v = torch.randn(bsz, kv_heads, s, d, generator=gen)
    on = (lambda t: t.to(device=device, dtype=dtype))
    return (on(q), on(k), on(v), prefix_lens.to(device), batch_ancestor_mask(parents).to(device),
            parents)
