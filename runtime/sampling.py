"""Logits processors and sampling from given uniforms.

Everything here is plain batched tensor code: no per-token Python loops and no
random numbers drawn inside. Uniforms come in as tensors (drawn by the caller from
per-request ``torch.Generator`` objects), so the same functions can run inside a
captured / compiled graph and a seeded request is reproducible whatever it is batched
with.

Conventions (same as vLLM / Hugging Face ``transformers``):

* ``temperature <= 0`` (in practice ``0``) marks a *greedy* row, as in
  ``SamplingParams.is_greedy``. Greedy rows are returned unscaled and unfiltered by
  :func:`process_logits`; the caller takes the ``argmax``. (vLLM treats
  ``temperature < 1e-5`` as greedy; here a tiny positive temperature is honoured, which
  is near-argmax sampling, so the engine's ``is_greedy`` flags and this function can
  never disagree about a row.) :func:`greedy_mask` gives the same flags from a tensor.
* top-k: ``top_k <= 0`` (or ``>= V``) is off. Keeps every token whose (scaled) logit is
  ``>=`` the k-th largest one, i.e. **ties with the k-th value are all kept** (vLLM's
  ``apply_top_k_top_p`` does the same), so a row may keep more than k tokens when there
  are ties at the boundary.
* top-p: ``top_p >= 1`` is off. Applied *after* top-k, on the temperature-scaled and
  top-k-renormalised probabilities: keeps the smallest set of highest-probability
  tokens whose cumulative probability is ``>= top_p``; the top token is always kept.
  Computed on the descending (stable) sort as "keep token j iff the probability mass
  strictly ranked above it is ``< top_p``". Among tokens with *equal* probability at the
  boundary the stable sort keeps the lower token id first.
* Filtered entries are set to ``-inf``, so ``softmax`` gives them probability exactly 0.
"""

from __future__ import annotations

import torch

__all__ = [
    "greedy_mask",
    "process_logits",
    "sample_from_probs",
    "sample_draft",
    "compute_logprobs",
]

#: Smallest divisor used for temperature scaling (keeps ``logits / t`` finite).
_MIN_TEMPERATURE = 1e-30


def greedy_mask(temperature: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: rows whose temperature selects greedy decoding (``<= 0``)."""
    return temperature <= 0


#: Eager fast path: rows using top-p look for their kept set among this many top tokens.
TOP_P_CANDIDATES = 1024


def _kth_value(sorted_vals: torch.Tensor, top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, 1]`` top-k threshold from the descending values of the ``c <= vocab`` largest
    entries of each row (``-inf`` where top-k is off); needs ``top_k <= c`` where on."""
    k_on = (top_k > 0) & (top_k < vocab)
    k_idx = (top_k - 1).clamp(0, sorted_vals.shape[-1] - 1).unsqueeze(1)
    kth = sorted_vals.gather(1, k_idx)
    return torch.where(k_on.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))


def _top_p_sorted(
    scaled: torch.Tensor,
    sorted_vals: torch.Tensor,
    kth: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p decision on (a prefix of) the stable descending order of each row.

    Returns ``(remove_sorted, cum)``: ``remove_sorted[:, j]`` says whether the token at
    sorted position ``j`` is removed by top-p, ``cum`` the inclusive cumulative mass.
    Probabilities are ``exp(v - max) / Z`` with ``Z`` summed over the whole row (top-k
    kept tokens only), so a prefix of the order gives bit-identical values to the full
    order: the fast and the full path agree exactly.
    """
    row_max = sorted_vals[:, :1]
    kept_k = scaled >= kth
    z = torch.where(kept_k, torch.exp(scaled - row_max), 0.0).sum(dim=-1, keepdim=True)
    probs = torch.where(sorted_vals >= kth, torch.exp(sorted_vals - row_max), 0.0) / z
    cum = torch.cumsum(probs, dim=-1)
    mass_above = cum - probs  # probability mass ranked strictly above each token
    remove = (top_p < 1.0).unsqueeze(1) & (mass_above >= top_p.unsqueeze(1))
    remove = remove & (torch.arange(remove.shape[-1], device=remove.device) > 0)  # the top token is always kept
    return remove, cum


def _top_k_top_p_mask(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Boolean ``[n, V]`` mask of the entries top-k / top-p remove (True = remove).

    The definition (also the compiled path): one stable descending sort per row; top-k
    removes values below the k-th sorted value; top-p removes sorted positions whose
    exclusive cumulative mass is already ``>= top_p``.
    """
    sorted_vals, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    kth = _kth_value(sorted_vals, top_k, scaled.shape[-1])
    remove_p_sorted, _ = _top_p_sorted(scaled, sorted_vals, kth, top_p)
    remove_p = torch.zeros_like(remove_p_sorted).scatter(1, sorted_idx, remove_p_sorted)
    return (scaled < kth) | remove_p


def _top_k_top_p_mask_fast(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Eager-only equivalent of :func:`_top_k_top_p_mask` that avoids the full sort.

    Takes the ``c`` largest entries per row (``torch.topk``; ``c`` = largest top-k in use,
    at least ``TOP_P_CANDIDATES`` when top-p is used), puts them in the stable order
    (value descending, token id ascending) and keeps ``S'``, those strictly above the
    ``c``-th value: ``S'`` is exactly a prefix of the full stable order. The k-th value
    is exact for every ``k <= c``; the top-p decision is exact when the mass of ``S'``
    exceeds ``top_p`` (every later token is then removed). Rows where it does not are
    redone with the full sort. The result is identical to :func:`_top_k_top_p_mask`.
    """
    n, vocab = scaled.shape
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    c = int(top_k[k_on].max()) if bool(k_on.any()) else 1
    if bool(p_on.any()):
        c = max(c, TOP_P_CANDIDATES)
    if 4 * c > vocab:
        return _top_k_top_p_mask(scaled, top_k, top_p)

    vals, idx = torch.topk(scaled, c, dim=-1, sorted=True)
    # stable order inside the candidates: by token id, then stably by value
    order = torch.argsort(idx, dim=-1)
    idx, vals = idx.gather(1, order), vals.gather(1, order)
    order = torch.argsort(vals, dim=-1, descending=True, stable=True)
    idx, vals = idx.gather(1, order), vals.gather(1, order)

    kth = _kth_value(vals, top_k, vocab)
    remove = scaled < kth
    if not bool(p_on.any()):
        return remove
    remove_p_sorted, cum = _top_p_sorted(scaled, vals, kth, top_p)
    in_prefix = vals > vals[:, -1:]  # S': strictly above the c-th value
    n_prefix = in_prefix.sum(dim=-1, keepdim=True)
    prefix_mass = cum.gather(1, (n_prefix - 1).clamp_min(0))
    exact = (n_prefix > 0) & (prefix_mass - top_p.unsqueeze(1) > 1e-6)
    keep_sorted = in_prefix & ~remove_p_sorted
    remove_p = torch.ones_like(remove).scatter(1, idx, ~keep_sorted)
    remove_p &= p_on.unsqueeze(1)
    remove = remove | remove_p

    redo = torch.nonzero(p_on & ~exact.squeeze(1)).squeeze(1)
    if redo.numel() > 0:
        full = _top_k_top_p_mask(
            scaled.index_select(0, redo), top_k.index_select(0, redo), top_p.index_select(0, redo)
        )
        remove = remove.index_copy(0, redo, full)
    return remove


def _filtered(scaled, top_k, top_p, needs_filter):
    remove = _top_k_top_p_mask(scaled, top_k, top_p) & needs_filter.unsqueeze(1)
    return scaled.masked_fill(remove, float("-inf"))


def _unfiltered(scaled, top_k, top_p, needs_filter):
    return scaled.clone()


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    branch_free: bool = False,
) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p to a batch of logits.

    Args:
        logits: ``[N, V]`` float32 raw logits (one row per sampled position).
        temperature: ``[N]`` float32; ``<= 0`` (i.e. 0) = greedy row.
        top_k: ``[N]`` int64; ``<= 0`` = off.
        top_p: ``[N]`` float32 in ``(0, 1]``; ``1.0`` = off.
        branch_free: under tracing, always run the full-sort path (masked per row)
            instead of a ``torch.cond``: a CUDA graph cannot hold a data-dependent branch
            (the predicate is read on the host), and on a GPU the sort is cheap. Same result.

    Returns:
        ``[N, V]`` float32 processed logits: ``logits / temperature`` with the entries
        removed by top-k / top-p set to ``-inf``. Greedy rows are returned unchanged
        (raw logits, no scaling, no filtering): use ``argmax`` on them.

    Algorithm: scale every sampling row by its temperature; sort the rows that need
    filtering once (descending, stable); top-k removes values ``<`` the k-th sorted value
    (ties kept); top-p removes sorted position ``j > 0`` when the renormalised probability
    mass ranked strictly above it is already ``>= top_p``; scatter the mask back.

    Under ``torch.compile`` / ``torch.export`` the rows go through the full-sort path
    when any row filters, behind a ``torch.cond`` that skips the sort otherwise. In
    eager mode (host-side checks allowed) only the rows that use
    top-k/top-p are filtered, and they first try :func:`_top_k_top_p_mask_fast`
    (``torch.topk`` candidates instead of a full sort, about 10x cheaper at V = 49k),
    which gives bit-identical masks; a row's result never depends on the other rows.
    """
    x = logits.to(torch.float32)
    vocab = x.shape[-1]
    greedy = greedy_mask(temperature)
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    temp = temp.clamp_min(_MIN_TEMPERATURE)
    scaled = x / temp.unsqueeze(1)

    top_k = top_k.to(torch.int64)
    top_p = top_p.to(torch.float32)
    needs_filter = (~greedy) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))

    if torch.compiler.is_compiling() and branch_free:
        processed = _filtered(scaled, top_k, top_p, needs_filter)
    elif torch.compiler.is_compiling():
        # the full sort costs ~20 ms per 5 rows of 49k on one CPU core: skip it (torch.cond,
        # a graph-level branch) on the common steps where no row filters
        processed = torch.cond(needs_filter.any(), _filtered, _unfiltered,
                               (scaled, top_k, top_p, needs_filter))
    else:
        processed = scaled
        rows = torch.nonzero(needs_filter).squeeze(1)
        if rows.numel() > 0:
            sub = scaled.index_select(0, rows)
            remove = _top_k_top_p_mask_fast(
                sub, top_k.index_select(0, rows), top_p.index_select(0, rows)
            )
            processed = scaled.index_copy(0, rows, sub.masked_fill(remove, float("-inf")))
    return torch.where(greedy.unsqueeze(1), x, processed)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with caller-supplied uniforms.

    Args:
        probs: ``[N, V]`` non-negative float weights. They need not sum to exactly 1
            (or to 1 at all): each row is sampled proportionally to its weights.
        uniforms: ``[N]`` float in ``[0, 1)``.

    Returns:
        ``[N]`` int64 token ids.

    Algorithm: ``cdf = cumsum(probs)``; the target is ``u * cdf[-1]``, clamped to just
    below ``cdf[-1]`` so rounding can never push it past the end; the token is the first
    index with ``cdf[i] > target`` (``searchsorted(..., right=True)``). That index always
    has ``cdf[i] > cdf[i-1]``, i.e. ``probs[i] > 0``: a zero-weight token is never
    returned (unless the whole row is zero, where the last index is returned).
    """
    p = probs.to(torch.float32)
    cdf = torch.cumsum(p, dim=-1)
    total = cdf[:, -1:]
    target = uniforms.to(torch.float32).unsqueeze(1) * total
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(target, below_total).clamp_min(0.0)
    idx = torch.searchsorted(cdf, target.contiguous(), right=True).squeeze(1)
    return idx.clamp(max=p.shape[-1] - 1).to(torch.int64)


def sample_draft(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft token per row from a model drafter's logits, and its distribution q.

    Args:
        logits: ``[N, V]`` float32 raw drafter logits (the target's vocabulary).
        temperature, top_k, top_p: ``[N]`` the rows' processors (as :func:`process_logits`).
        is_greedy: ``[N]`` bool.
        uniforms: ``[N]`` float32 in ``[0, 1)``, the row's drafter uniform of this step.

    Returns:
        ``(tokens [N] int64, q [N, V] float32)``: the argmax of the raw logits for greedy
        rows, else a sample of ``q = softmax(process_logits(logits))``, the distribution
        rejection sampling divides by (the same processors as the target: lossless).
        One function for the eager drafter and the compiled draft-then-verify program, so
        both draw the same token from the same uniform.
    """
    q = torch.softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)
    tokens = torch.where(is_greedy, logits.argmax(-1), sample_from_probs(q, uniforms))
    return tokens, q


def compute_logprobs(
    processed_logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the chosen tokens and the top ``num_top`` alternatives.

    Args:
        processed_logits: ``[N, V]`` output of :func:`process_logits` (for greedy rows
            that is the raw logits, so their logprobs are those of the raw model).
        token_ids: ``[N]`` int64, the emitted tokens.
        num_top: number of top alternatives (0 allowed; capped at V).

    Returns:
        ``token_logprob [N]`` float32, ``top_ids [N, num_top]`` int64 and
        ``top_logprobs [N, num_top]`` float32 (descending). Tokens removed by
        top-k/top-p have logprob ``-inf``.
    """
    logprobs = torch.log_softmax(processed_logits.to(torch.float32), dim=-1)
    token_logprob = logprobs.gather(1, token_ids.to(torch.int64).unsqueeze(1)).squeeze(1)
    k = max(0, min(int(num_top), logprobs.shape[-1]))
    top_logprobs, top_ids = torch.topk(logprobs, k, dim=-1)
    return token_logprob, top_ids.to(torch.int64), top_logprobs
