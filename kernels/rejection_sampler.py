"""Accept/reject for speculative decoding: the plain-torch reference.

This is the implementation used on CPU and the one the device kernel (a Triton twin,
later) is tested against. It implements the lossless speculative sampling of

* Leviathan, Kalman, Matias, 2023, "Fast Inference from Transformers via Speculative
  Decoding" (ICML 2023, arXiv:2211.17192), and
* Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper, 2023, "Accelerating Large Language
  Model Decoding with Speculative Sampling" (arXiv:2302.01318),

with vLLM's vocabulary for the tokens of one step:

* **accepted tokens**: draft tokens kept by the accept test, which compares the target
  probability ``p`` and the drafter probability ``q`` of the draft token;
* **recovered token**: at the first rejected position, a token sampled from the adjusted
  distribution ``norm(max(0, p - q))`` derived from both;
* **bonus token**: when every draft token is accepted, one more token sampled from the
  target distribution alone, at the position after the last draft.

So a step always emits ``num_accepted + 1`` tokens, and the emitted sequence is
distributed exactly as sampling from the target (for greedy rows: equals the target's
greedy output).

Greedy rows accept draft ``i`` iff it equals ``argmax(target_logits[b, i])`` and end with
the argmax at position ``num_accepted``. Sampling rows accept draft ``x_i`` iff
``u_i < min(1, p_i(x_i) / q_i(x_i))``, tested as ``u_i * q_i(x_i) < p_i(x_i)`` (no
division; with ``u_i`` in ``[0, 1)`` this also always accepts when ``p >= q``, and never
accepts a token with ``p = 0``). A deterministic drafter (``draft_probs=None``) has ``q``
one-hot at its draft, so the test is ``u_i < p_i(x_i)`` and the residual is ``p`` with the
draft token zeroed.

Nothing random is drawn here: the uniforms are inputs. The code is vectorised over batch
and draft positions (the accepted prefix is a ``cumprod`` of the accept mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# One inverse-CDF convention for spec and non-spec sampling: with no drafts this step
# emits exactly the token plain sampling would emit from the same uniform.
from specc.runtime.sampling import sample_from_probs

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionOutput", "rejection_sample"]

#: Fills ``output_token_ids`` after the last emitted token of a row.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RejectionOutput:
    """Result of one accept/reject step for a batch of ``B`` rows with ``K`` draft slots.

    Attributes:
        output_token_ids: ``[B, K+1]`` int64: the accepted drafts, then the recovered or
            bonus token, then ``-1`` padding.
        num_accepted: ``[B]`` int64 in ``0..num_draft_tokens[b]``.
        num_emitted: ``[B]`` int64, ``num_accepted + 1``.
    """

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor
    num_emitted: torch.Tensor


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms_accept: torch.Tensor,
    uniforms_sample: torch.Tensor,
) -> RejectionOutput:
    """Accept/reject the drafts of a batch and pick the one recovered or bonus token.

    Args:
        target_logits: ``[B, K+1, V]`` float32 processed target logits
            (``process_logits`` output; raw logits for greedy rows) at positions 0..K:
            row ``i`` scores draft ``i`` and row ``K`` (or ``num_draft_tokens[b]``) the
            bonus token.
        draft_token_ids: ``[B, K]`` int64; entries at ``index >= num_draft_tokens[b]``
            are padding (any value, never read as tokens).
        num_draft_tokens: ``[B]`` int64 in ``0..K``.
        draft_probs: ``[B, K, V]`` float32 drafter probabilities after the same logits
            processors as the target, or ``None`` for a deterministic drafter (``q``
            one-hot at the draft token).
        is_greedy: ``[B]`` bool.
        uniforms_accept: ``[B, K]`` float32 in ``[0, 1)``, one per draft position.
        uniforms_sample: ``[B]`` float32 in ``[0, 1)`` for the recovered/bonus token.

    Returns:
        :class:`RejectionOutput`.

    Tokens with target probability 0 (filtered by top-k/top-p) are never accepted nor
    sampled. If the residual ``max(0, p - q)`` is all zero (only possible through
    rounding, or a drafter whose ``q`` does not match its draft) the target ``p`` is
    used instead.
    """
    bsz, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    device = target_logits.device
    logits = target_logits.to(torch.float32)

    num_draft = num_draft_tokens.to(torch.int64).clamp(0, k)
    positions = torch.arange(k, device=device)
    valid = positions.unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    drafts = torch.where(valid, draft_token_ids.to(torch.int64), 0).clamp(0, vocab - 1)

    target_argmax = logits.argmax(dim=-1)  # [B, K+1]
    target_probs = torch.softmax(logits, dim=-1)  # [B, K+1, V]

    # ---- accept test, per draft position ------------------------------------------
    greedy_accept = drafts == target_argmax[:, :k]
    p_draft = target_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    u = uniforms_accept.to(torch.float32)
    if draft_probs is None:
        sample_accept = u < p_draft
    else:
        q_draft = draft_probs.to(torch.float32).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        sample_accept = u * q_draft < p_draft
    accept = torch.where(is_greedy.unsqueeze(1), greedy_accept, sample_accept) & valid
    accepted_prefix = torch.cumprod(accept.to(torch.int64), dim=1)  # [B, K]
    num_accepted = accepted_prefix.sum(dim=1)  # [B]

    # ---- the final (recovered or bonus) token at position num_accepted -----------
    final_pos = num_accepted.unsqueeze(1)  # [B, 1]
    p_final = target_probs.gather(
        1, final_pos.unsqueeze(-1).expand(bsz, 1, vocab)
    ).squeeze(1)  # [B, V]
    is_recovery = num_accepted < num_draft  # rejected at position num_accepted
    if k > 0:
        rej_pos = final_pos.clamp(max=k - 1)  # bonus rows: any in-range index, unused
        if draft_probs is None:
            rejected_token = drafts.gather(1, rej_pos)  # [B, 1]
            residual = p_final.scatter(1, rejected_token, 0.0)
        else:
            q_final = draft_probs.to(torch.float32).gather(
                1, rej_pos.unsqueeze(-1).expand(bsz, 1, vocab)
            ).squeeze(1)
            residual = (p_final - q_final).clamp_min(0.0)
        residual_ok = residual.sum(dim=-1, keepdim=True) > 0
        residual = torch.where(residual_ok, residual, p_final)
        final_dist = torch.where(is_recovery.unsqueeze(1), residual, p_final)
    else:
        final_dist = p_final
    # sample_from_probs samples proportionally to unnormalised weights: no division.
    sampled = sample_from_probs(final_dist, uniforms_sample)
    greedy_final = target_argmax.gather(1, final_pos).squeeze(1)
    final_token = torch.where(is_greedy, greedy_final, sampled)

    # ---- assemble [accepted drafts..., final token, -1 ...] -----------------------
    out = torch.full((bsz, k_plus_1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    out[:, :k] = torch.where(accepted_prefix.bool(), drafts, PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, final_pos, final_token.unsqueeze(1))
    return RejectionOutput(
        output_token_ids=out, num_accepted=num_accepted, num_emitted=num_accepted + 1
    )
