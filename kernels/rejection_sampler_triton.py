"""Accept/reject for speculative decoding: the Triton kernel (device twin of the reference).

Same algorithm, inputs and outputs as :func:`specc.kernels.rejection_sampler.rejection_sample`
(the plain-torch reference; read its docstring for the vocabulary), i.e. the lossless
speculative sampling of

* Leviathan, Kalman, Matias, 2023, "Fast Inference from Transformers via Speculative
  Decoding" (ICML 2023, arXiv:2211.17192), and
* Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper, 2023, "Accelerating Large Language
  Model Decoding with Speculative Sampling" (arXiv:2302.01318).

Shapes and dtypes (``B`` rows, ``K`` draft slots, vocabulary ``V``):

* in: ``target_logits [B, K+1, V]`` (any float dtype, processed as float32),
  ``draft_token_ids [B, K]`` int, ``num_draft_tokens [B]`` int, ``draft_probs [B, K, V]``
  float or ``None`` (deterministic drafter: ``q`` one-hot at the draft),
  ``is_greedy [B]`` bool, ``uniforms_accept [B, K]`` and ``uniforms_sample [B]`` float
  in ``[0, 1)``;
* out: :class:`~specc.kernels.rejection_sampler.RejectionOutput` with
  ``output_token_ids [B, K+1]`` int64 (accepted drafts, the recovered or bonus token,
  then ``-1``), ``num_accepted [B]`` and ``num_emitted [B]`` int64.

Algorithm. ``softmax`` of the logits is computed by torch, exactly as the reference does
it (so ``p`` is bit-identical on the same device); everything else is one Triton program
per row:

1. *accept loop* over draft positions ``i < num_draft_tokens[b]``, stopping at the first
   rejection: a greedy row accepts draft ``x_i`` iff it equals ``argmax(logits[b, i])``
   (first index among equal maxima, like ``torch.argmax``); a sampling row iff
   ``u_i * q_i(x_i) < p_i(x_i)`` (``u_i < p_i(x_i)`` when ``draft_probs`` is ``None``).
   Draft ids are clamped to ``[0, V-1]`` and ``num_draft_tokens`` to ``[0, K]`` as in the
   reference. Accepted drafts are written to the output as the loop goes.
2. *final token* at position ``f = num_accepted``: greedy rows take
   ``argmax(logits[b, f])``; sampling rows sample from the weights ``w``: the residual
   ``max(0, p_f - q_f)`` (``p_f`` with the rejected draft zeroed when ``draft_probs`` is
   ``None``) if the row rejected at ``f`` and that residual is not all zero, else ``p_f``
   (bonus token, or the all-zero-residual fallback). Sampling is the inverse CDF of
   :func:`specc.runtime.sampling.sample_from_probs` with the given uniform:
   ``cdf = cumsum(w)``, ``target = min(u * cdf[-1], nextafter(cdf[-1], 0))``, token = the
   first index with ``cdf[i] > target`` (and ``w[i] > 0``; an all-zero row gives
   ``V - 1``). The CDF is a blockwise scan (``tl.cumsum`` plus a running carry), one pass
   for the total and one, stopping early, for the search; no division anywhere.

Exactness. The accept decisions, the number accepted, the accepted tokens and greedy
tokens are bit-exact against the reference (same ``p``, same elementwise float32
arithmetic, same argmax tie rule). The sampled final token is identical except when
``u * total`` lies within float32 summation error (a few ulps of the running sum) of a
CDF boundary: the reference's ``torch.cumsum`` and the kernel's scan add in different
orders. Both then return one of the two neighbouring positive-weight tokens, so the
sampled distribution differs only by float rounding. (The ``w[i] > 0`` test and a
"last positive-weight token" fallback keep a zero-weight token from ever being returned
even if a parallel scan's rounding made the CDF non-monotone.)

Cost. One program per row, looping over the vocabulary in blocks of ``BLOCK_V``
(<= 2048, 4 or 8 warps): a greedy row reads ``logits`` once per accepted draft plus one
(argmax passes); a sampling row reads one ``p`` (and ``q``) entry per draft, then at the
final position up to three passes over ``p`` (and ``q``): residual check (stops at the
first positive entry), total, search (stops at the hit). The softmax in torch is the
reference's. Limits: ``(K+1) * V < 2**31`` (in-row offsets are int32); NaN logits are
not supported (neither path defines a result for them).

When each path is used. :func:`rejection_sample_auto` runs the Triton kernel when
``target_logits`` is a CUDA tensor and ``triton`` is importable (:data:`TRITON_AVAILABLE`),
else the torch reference. :func:`rejection_sample_triton` always runs the kernel: on CUDA
tensors, or on CPU tensors when Triton's interpreter is on (``TRITON_INTERPRET=1``, used
by the tests on machines without a GPU; slow, for testing only). The variable must be in
the environment before ``triton`` is first imported: Triton decorates its own library
functions (``tl.max``, ``tl.cumsum``, ...) at import, in the mode the variable selects
then. Triton is *not* a dependency of specc: this module imports without it, and the
kernel is only built (``triton.jit``) on the first call, per interpreter/compiled mode.
"""

from __future__ import annotations

import torch

from specc.kernels.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionOutput,
    rejection_sample,
)
from specc.kernels.triton_support import TRITON_AVAILABLE, launch_mode, tl, triton
from specc.kernels.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR  # noqa: F401
from specc.kernels.triton_support import interpreter_ready as _interpreter_ready  # noqa: F401

__all__ = [
    "TRITON_AVAILABLE",
    "rejection_sample_auto",
    "rejection_sample_triton",
]

#: Largest vocabulary block one loop iteration handles, compiled / interpreted. The
#: interpreter runs every block op as a numpy call, so bigger blocks are much faster there.
_MAX_BLOCK_V = 2048
_MAX_BLOCK_V_INTERPRET = 16384


# --------------------------------------------------------------------------- kernel
# Plain function, decorated by ``triton.jit`` on first use (see ``_kernel``): Triton
# decides at decoration time whether a kernel is compiled or interpreted. With
# ``from __future__ import annotations`` the ``tl.constexpr`` annotations stay strings,
# so this definition needs no triton at import time.


def _rejection_sample_kernel(
    logits_ptr,  # [B, K+1, V] float32, contiguous
    probs_ptr,  # [B, K+1, V] float32, contiguous: softmax(logits)
    q_ptr,  # [B, K, V] float32, contiguous (read only if HAS_Q)
    drafts_ptr,  # [B, K] int64, contiguous
    num_draft_ptr,  # [B] int64
    greedy_ptr,  # [B] int32 (0/1)
    ua_ptr,  # [B, K] float32, contiguous
    us_ptr,  # [B] float32
    out_ptr,  # [B, K+1] int64, pre-filled with -1
    num_acc_ptr,  # [B] int64
    K,
    V,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Loop-carried scalars get explicit types (tl.full) so the compiled and the
    # interpreted kernel agree; names are unique per phase (no shape changes).
    b = tl.program_id(0).to(tl.int64)
    K1 = K + 1
    row_logits = logits_ptr + b * K1 * V
    row_probs = probs_ptr + b * K1 * V
    row_q = q_ptr + b * K * V
    row_drafts = drafts_ptr + b * K
    row_ua = ua_ptr + b * K
    offs = tl.arange(0, BLOCK_V)

    n = tl.load(num_draft_ptr + b)
    n = tl.minimum(tl.maximum(n, 0), K).to(tl.int32)
    greedy = tl.load(greedy_ptr + b) != 0

    # ---- 1. accept loop: stop at the first rejected draft --------------------------
    i = tl.full((), 0, tl.int32)
    go = n > 0
    while go:
        d = tl.load(row_drafts + i)
        d = tl.minimum(tl.maximum(d, 0), V - 1)
        if greedy:
            # argmax(logits[b, i]): first index among equal maxima, like torch.argmax
            am_val = tl.full((), float("-inf"), tl.float32)
            am_idx = tl.full((), 0, tl.int64)
            for s1 in range(0, V, BLOCK_V):
                idx1 = s1 + offs
                x1 = tl.load(row_logits + i * V + idx1, mask=idx1 < V, other=float("-inf"))
                m1 = tl.max(x1, axis=0)
                a1 = tl.argmax(x1, axis=0, tie_break_left=True)
                upd1 = m1 > am_val
                am_idx = tl.where(upd1, (s1 + a1).to(tl.int64), am_idx)
                am_val = tl.where(upd1, m1, am_val)
            ok = d == am_idx
        else:
            p_d = tl.load(row_probs + i * V + d)
            u_d = tl.load(row_ua + i)
            if HAS_Q:
                q_d = tl.load(row_q + i * V + d)
                ok = u_d * q_d < p_d
            else:
                ok = u_d < p_d
        tl.store(out_ptr + b * K1 + i, d, mask=ok)
        i = tl.where(ok, i + 1, i)
        go = ok & (i < n)

    # ---- 2. final token at position f = num_accepted --------------------------------
    f = i
    if greedy:
        fm_val = tl.full((), float("-inf"), tl.float32)
        fm_idx = tl.full((), 0, tl.int64)
        for s2 in range(0, V, BLOCK_V):
            idx2 = s2 + offs
            x2 = tl.load(row_logits + f * V + idx2, mask=idx2 < V, other=float("-inf"))
            m2 = tl.max(x2, axis=0)
            a2 = tl.argmax(x2, axis=0, tie_break_left=True)
            upd2 = m2 > fm_val
            fm_idx = tl.where(upd2, (s2 + a2).to(tl.int64), fm_idx)
            fm_val = tl.where(upd2, m2, fm_val)
        token = fm_idx
    else:
        p_row = row_probs + f * V
        q_row = row_q + f * V
        is_rec = f < n  # rejected at f: recovered token from the residual
        rej = tl.load(row_drafts + f, mask=is_rec, other=0)
        rej = tl.minimum(tl.maximum(rej, 0), V - 1)
        # 2a. use the residual only if some residual weight is > 0 (stops at the first)
        use_res = tl.full((), 0, tl.int1)
        s3 = tl.full((), 0, tl.int32)
        scan3 = is_rec
        while scan3:
            idx3 = s3 + offs
            p3 = tl.load(p_row + idx3, mask=idx3 < V, other=0.0)
            if HAS_Q:
                q3 = tl.load(q_row + idx3, mask=idx3 < V, other=0.0)
                r3 = tl.maximum(p3 - q3, 0.0)
            else:
                r3 = tl.where(idx3 == rej, 0.0, p3)
            use_res = tl.max(r3, axis=0) > 0.0
            s3 = s3 + BLOCK_V
            scan3 = (s3 < V) & (use_res == 0)
        # 2b. total = cdf[-1] of the weights w (blockwise scan with a running carry);
        # q is only read when the residual is used (its loads are masked off otherwise)
        q_lim = tl.where(use_res, V, 0)
        carry4 = tl.full((), 0.0, tl.float32)
        last_pos = tl.full((), -1, tl.int64)  # last index with w > 0 (fallback only)
        for s4 in range(0, V, BLOCK_V):
            idx4 = s4 + offs
            p4 = tl.load(p_row + idx4, mask=idx4 < V, other=0.0)
            if HAS_Q:
                q4 = tl.load(q_row + idx4, mask=idx4 < q_lim, other=0.0)
                r4 = tl.maximum(p4 - q4, 0.0)
            else:
                r4 = tl.where(idx4 == rej, 0.0, p4)
            w4 = tl.where(use_res, r4, p4)
            c4 = carry4 + tl.cumsum(w4, axis=0)
            carry4 = tl.max(c4, axis=0)
            lp4 = tl.max(tl.where(w4 > 0.0, idx4, -1), axis=0).to(tl.int64)
            last_pos = tl.maximum(last_pos, lp4)
        total = carry4
        # 2c. target = min(u * total, nextafter(total, 0)), clamped at 0
        u_s = tl.load(us_ptr + b)
        below = (total.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        below = tl.where(total > 0.0, below, 0.0)
        target = tl.maximum(tl.minimum(u_s * total, below), 0.0)
        # 2d. first index with cdf > target (and w > 0), stopping at the first hit
        found = tl.full((), V, tl.int64)
        carry5 = tl.full((), 0.0, tl.float32)
        s5 = tl.full((), 0, tl.int32)
        scan5 = tl.full((), 1, tl.int1)
        while scan5:
            idx5 = s5 + offs
            p5 = tl.load(p_row + idx5, mask=idx5 < V, other=0.0)
            if HAS_Q:
                q5 = tl.load(q_row + idx5, mask=idx5 < q_lim, other=0.0)
                r5 = tl.maximum(p5 - q5, 0.0)
            else:
                r5 = tl.where(idx5 == rej, 0.0, p5)
            w5 = tl.where(use_res, r5, p5)
            c5 = carry5 + tl.cumsum(w5, axis=0)
            carry5 = tl.max(c5, axis=0)
            hit5 = (c5 > target) & (w5 > 0.0) & (idx5 < V)
            f5 = tl.min(tl.where(hit5, idx5, V), axis=0).to(tl.int64)
            found = tl.minimum(found, f5)
            s5 = s5 + BLOCK_V
            scan5 = (s5 < V) & (found == V)
        # fallback (rounding only; never for the reference's monotone cdf): the last
        # positive-weight token, or V - 1 for an all-zero row like the reference
        fallback = tl.where(last_pos >= 0, last_pos, V - 1)
        token = tl.where(found < V, found, fallback)

    tl.store(out_ptr + b * K1 + f, token)
    tl.store(num_acc_ptr + b, f.to(tl.int64))


_KERNELS: dict[bool, object] = {}


def _kernel(interpret: bool):
    """The ``triton.jit`` kernel for the current mode (built once per mode)."""
    kern = _KERNELS.get(interpret)
    if kern is None:
        kern = triton.jit(_rejection_sample_kernel)
        _KERNELS[interpret] = kern
    return kern


# --------------------------------------------------------------------------- host side


def _check_inputs(
    target_logits, draft_token_ids, num_draft_tokens, draft_probs, is_greedy,
    uniforms_accept, uniforms_sample,
) -> tuple[int, int, int]:
    if target_logits.dim() != 3:
        raise ValueError(
            f"target_logits must be [B, K+1, V], got shape {tuple(target_logits.shape)}"
        )
    bsz, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    if k < 0 or vocab < 1:
        raise ValueError(
            f"target_logits needs K+1 >= 1 and V >= 1, got {tuple(target_logits.shape)}"
        )
    if (k + 1) * vocab >= 2**31:  # in-row offsets are int32 in the kernel
        raise ValueError(f"(K+1) * V must be < 2**31, got K+1 = {k + 1}, V = {vocab}")
    expected = {
        "draft_token_ids": (draft_token_ids, (bsz, k)),
        "num_draft_tokens": (num_draft_tokens, (bsz,)),
        "is_greedy": (is_greedy, (bsz,)),
        "uniforms_accept": (uniforms_accept, (bsz, k)),
        "uniforms_sample": (uniforms_sample, (bsz,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (bsz, k, vocab))
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != target_logits.device:
            raise ValueError(
                f"{name} is on {t.device}, target_logits on {target_logits.device}: "
                "all inputs must be on one device"
            )
    if not target_logits.is_floating_point():
        raise ValueError(f"target_logits must be floating point, got {target_logits.dtype}")
    if draft_probs is not None and not draft_probs.is_floating_point():
        raise ValueError(f"draft_probs must be floating point, got {draft_probs.dtype}")
    return bsz, k, vocab


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms_accept: torch.Tensor,
    uniforms_sample: torch.Tensor,
) -> RejectionOutput:
    """Accept/reject the drafts of a batch and pick the one recovered or bonus token (Triton).

    Same contract as :func:`specc.kernels.rejection_sampler.rejection_sample`; see the
    module docstring for the algorithm and the (float-tie only) exactness guarantee.

    Args:
        target_logits: ``[B, K+1, V]`` float (processed as float32) processed target
            logits at positions 0..K.
        draft_token_ids: ``[B, K]`` integer; entries at ``index >= num_draft_tokens[b]``
            are padding (never read); valid entries are clamped to ``[0, V-1]``.
        num_draft_tokens: ``[B]`` integer, clamped to ``0..K``.
        draft_probs: ``[B, K, V]`` float drafter probabilities, or ``None`` for a
            deterministic drafter (``q`` one-hot at the draft token).
        is_greedy: ``[B]`` bool.
        uniforms_accept: ``[B, K]`` float in ``[0, 1)``.
        uniforms_sample: ``[B]`` float in ``[0, 1)``.

    Returns:
        :class:`~specc.kernels.rejection_sampler.RejectionOutput`: ``output_token_ids
        [B, K+1]``, ``num_accepted [B]``, ``num_emitted [B]``, all int64, on the inputs'
        device.

    Raises:
        RuntimeError: ``triton`` is not importable, or ``TRITON_INTERPRET=1`` was set
            only after ``triton`` was imported.
        ValueError: wrong shapes, ``(K+1) * V >= 2**31``, non-float logits/probs, inputs
            on different devices, or tensors not on CUDA while Triton's interpreter
            (``TRITON_INTERPRET=1``) is off.
    """
    interpret = launch_mode("rejection_sample_triton", target_logits.device,
                            "rejection_sample_auto or the torch reference rejection_sample")
    bsz, k, vocab = _check_inputs(
        target_logits, draft_token_ids, num_draft_tokens, draft_probs, is_greedy,
        uniforms_accept, uniforms_sample,
    )
    device = target_logits.device

    out = torch.full((bsz, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(bsz, dtype=torch.int64, device=device)
    if bsz == 0:
        return RejectionOutput(out, num_accepted, num_accepted + 1)

    # p exactly as the reference computes it (same op on the same device).
    logits = target_logits.to(torch.float32)
    probs = torch.softmax(logits, dim=-1).contiguous()
    logits = logits.contiguous()
    if k > 0:
        drafts = draft_token_ids.to(torch.int64).contiguous()
        u_acc = uniforms_accept.to(torch.float32).contiguous()
        q = draft_probs.to(torch.float32).contiguous() if draft_probs is not None else probs
    else:  # no draft slots: pass harmless 1-element buffers (never read)
        drafts = torch.zeros(1, dtype=torch.int64, device=device)
        u_acc = torch.zeros(1, dtype=torch.float32, device=device)
        q = probs
    has_q = draft_probs is not None and k > 0
    n_draft = num_draft_tokens.to(torch.int64).contiguous()
    greedy = is_greedy.to(torch.int32).contiguous()
    u_smp = uniforms_sample.to(torch.float32).contiguous()

    cap = _MAX_BLOCK_V_INTERPRET if interpret else _MAX_BLOCK_V
    block_v = min(triton.next_power_of_2(vocab), cap)
    num_warps = 4 if block_v <= 1024 else 8
    _kernel(interpret)[(bsz,)](
        logits, probs, q, drafts, n_draft, greedy, u_acc, u_smp, out, num_accepted,
        k, vocab, HAS_Q=has_q, BLOCK_V=block_v, num_warps=num_warps,
        enable_fp_fusion=False,  # no FMA contraction: float32 ops as written (as in torch)
    )
    return RejectionOutput(
        output_token_ids=out, num_accepted=num_accepted, num_emitted=num_accepted + 1
    )


def rejection_sample_auto(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms_accept: torch.Tensor,
    uniforms_sample: torch.Tensor,
) -> RejectionOutput:
    """Accept/reject with the best available implementation; same contract as the reference.

    Uses :func:`rejection_sample_triton` when ``target_logits`` is on CUDA and Triton is
    importable (:data:`TRITON_AVAILABLE`), else the torch reference
    :func:`specc.kernels.rejection_sampler.rejection_sample` (CPU, or CUDA without Triton).
    Arguments, shapes, dtypes and the return value are those of the reference; the Triton
    path raises ``ValueError`` for malformed inputs (see :func:`rejection_sample_triton`).
    """
    args = (
        target_logits, draft_token_ids, num_draft_tokens, draft_probs, is_greedy,
        uniforms_accept, uniforms_sample,
    )
    if TRITON_AVAILABLE and target_logits.is_cuda:
        return rejection_sample_triton(*args)
    return rejection_sample(*args)
