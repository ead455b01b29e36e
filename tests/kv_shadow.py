"""KV cache checker of C4 and C5 (../shared/cases/correctness.md): :func:`checked`.

:class:`KVShadow` wraps a model's ``forward`` and the cache's ``copy_slot`` and keeps a
shadow of which token every (slot, layer, position) of the KV cache holds. On every
forward it checks, per real row:

* writes land at a position ``< max_model_len`` or at the trash position; a write below
  the request's length carries the request's own token (a real KV entry is never
  changed by padding, drafts or another request);
* every key a real query can see (positions ``<= query position``) holds the request's
  own token (below its length) or a token written during the current propose/verify call
  (drafts), and ``kv_len`` covers the query (no key silently cut off);
* logits are finite (no NaN from padded rows).

For a model drafter this is the drafter's history: what it attends to is exactly
prompt + emitted tokens (+ its own drafts of this step).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from helpers import patched
from specc import Session


class KVShadow:
    """Shadow of one KV cache, fed by the forward calls of the model(s) writing it."""

    def __init__(self, cache, name: str):
        self.cache, self.name = cache, name
        shape = (cache.num_slots, cache.num_layers, cache.max_len)
        self.tok = np.full(shape, -1, dtype=np.int64)
        self.gen = np.zeros(shape, dtype=np.int64)
        self.generation = 0
        self.rows: list[tuple[int, object | None]] = []  # batch row -> (slot, request or None)
        self.errors: list[str] = []
        self.num_forwards = 0
        self.num_padded = 0  # forwards where a row is padded (trash) beside a real token

    def set_rows(self, rows) -> None:
        self.rows = rows
        self.generation += 1

    def copy_slot(self, src: int, dst: int) -> None:
        self.tok[dst] = self.tok[src]
        self.gen[dst] = self.gen[src]

    def _err(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{self.name}: {msg}")

    def on_forward(self, input_ids, positions, kv_len, num_layers, logits) -> None:
        self.num_forwards += 1
        trash, limit = self.cache.trash_pos, self.cache.max_model_len
        n = self.cache.num_layers if num_layers is None else num_layers
        ids, pos = input_ids.tolist(), positions.tolist()
        kv_len = self.cache.max_len if kv_len is None else kv_len
        if len(ids) != len(self.rows):
            self._err(f"forward with {len(ids)} rows but {len(self.rows)} rows registered")
            return
        pad = positions == trash
        if bool((pad.any(0) & (~pad).any(0)).any()):
            self.num_padded += 1
        if not bool(torch.isfinite(logits).all()):
            self._err(f"non-finite logits (rows {torch.nonzero(~torch.isfinite(logits).all(-1)).tolist()[:4]})")
        for b, (slot, req) in enumerate(self.rows):
            truth = None if req is None else req.all_token_ids
            real_q = []
            for t, (tok, p) in enumerate(zip(ids[b], pos[b])):
                if tok < 0:
                    self._err(f"placeholder token {tok} fed at row {b}, position {p}")
                if p == trash:
                    continue
                if not 0 <= p < limit:
                    self._err(f"row {b} writes position {p} (max_model_len {limit})")
                    continue
                if truth is not None and p < len(truth) and tok != truth[p]:
                    self._err(f"row {b} (request {req.request_id}) writes token {tok} at position {p}, "
                              f"which holds the request's token {truth[p]}")
                self.tok[slot, :n, p] = tok
                self.gen[slot, :n, p] = self.generation
                real_q.append(p)
            if truth is None or not real_q:
                continue
            q = max(real_q)
            if kv_len <= q:
                self._err(f"row {b}: kv_len {kv_len} hides keys of a query at position {q}")
            own = min(q + 1, len(truth))
            seen = self.tok[slot, :n, :own]
            want = np.asarray(truth[:own])
            if not (seen == want[None]).all():
                j = int(np.argwhere((seen != want[None]).any(0))[0, 0])
                self._err(f"row {b} (request {req.request_id}, slot {slot}): key at position {j} holds "
                          f"{seen[:, j].tolist()}, the request's token is {truth[j]}")
            if q >= len(truth) and not (self.gen[slot, :n, len(truth) : q + 1] == self.generation).all():
                self._err(f"row {b}: a query at {q} sees a draft key left by an earlier call")


@dataclass
class Checks:
    target: KVShadow
    drafter: KVShadow | None
    step_sizes: list[tuple[int, int]] = field(default_factory=list)  # (rows, unfinished rows)
    admissions: list[tuple[int, int, dict[int, int]]] = field(default_factory=list)
    # (request_id, step index, {other running request: its output length}) at each prefill
    ngram_histories: list[list[int]] = field(default_factory=list)  # n-gram and suffix drafters

    @property
    def errors(self) -> list[str]:
        return self.target.errors + (self.drafter.errors if self.drafter and self.drafter is not self.target else [])


def _wrap_forward(model, shadow: KVShadow, stack: contextlib.ExitStack) -> None:
    orig = model.forward

    def forward(input_ids, positions, kv_cache, *, attn_mask=None, kv_len=None, num_layers=None, **kw):
        out = orig(input_ids, positions, kv_cache, attn_mask=attn_mask, kv_len=kv_len, num_layers=num_layers, **kw)
        shadow.on_forward(input_ids, positions, kv_len, num_layers, out.logits)
        return out

    stack.enter_context(patched(model, "forward", forward))


def _wrap(obj, name: str, make, stack: contextlib.ExitStack) -> None:
    """Until ``stack`` closes, ``obj.<name>`` is ``make(the original)``."""
    stack.enter_context(patched(obj, name, make(getattr(obj, name))))


@contextlib.contextmanager
def checked(session: Session):
    """Install the KV shadow checks (and recorders) on ``session``'s speculative engine
    for the duration of the block; yields :class:`Checks`."""
    engine, proposer = session.engine, session.proposer
    with contextlib.ExitStack() as stack:
        target = KVShadow(session.kv_cache, "target")
        _wrap_forward(session.target.model, target, stack)
        _wrap(session.kv_cache, "copy_slot", lambda o: lambda s, d: (target.copy_slot(s, d), o(s, d))[1], stack)
        drafter = None
        model = getattr(proposer, "model", None)
        if model is session.target.model:
            drafter = target
        elif model is not None:
            drafter = KVShadow(proposer.cache, "drafter")
            _wrap_forward(model, drafter, stack)
            _wrap(proposer.cache, "copy_slot", lambda o: lambda s, d: (drafter.copy_slot(s, d), o(s, d))[1], stack)
        checks = Checks(target, drafter)
        running: list = []

        def prefill(orig):
            def f(req, slot):
                others = {r.request_id: len(r.output_token_ids) for r in running if not r.finished}
                checks.admissions.append((req.request_id, len(checks.step_sizes), others))
                target.set_rows([(slot, req)])
                return orig(req, slot)
            return f

        def step(orig):
            def f(rows):
                running[:] = rows
                checks.step_sizes.append((len(rows), sum(not r.finished for r in rows)))
                target.set_rows([(b, None if r.finished else r) for b, r in enumerate(rows)])
                return orig(rows)
            return f

        _wrap(engine, "_prefill", prefill, stack)
        _wrap(engine, "_step", step, stack)
        if drafter is not None:
            def d_prefill(orig):
                def f(req, slot):
                    drafter.set_rows([(slot, req)])
                    return orig(req, slot)
                return f

            def d_propose(orig):
                def f(batch, max_drafts, uniforms):
                    drafter.set_rows([(b, None if r.finished else r) for b, r in enumerate(batch.requests)])
                    return orig(batch, max_drafts, uniforms)
                return f

            _wrap(proposer, "prefill", d_prefill, stack)
            _wrap(proposer, "propose", d_propose, stack)
        lookup = getattr(proposer, "lookup", None)
        if lookup is not None:
            def l_propose(orig):
                def f(token_ids, max_num_tokens=None):
                    checks.ngram_histories.append(list(token_ids))
                    return orig(token_ids, max_num_tokens)
                return f

            _wrap(lookup, "propose", l_propose, stack)
        history = getattr(proposer, "history", None)
        if history is not None:  # suffix: the tokens in each request's tree when it drafts
            def s_candidate(orig):
                def f(req, max_tokens=None):
                    out = orig(req, max_tokens)
                    checks.ngram_histories.append(history(req.request_id))
                    return out
                return f

            _wrap(proposer, "candidate", s_candidate, stack)
        yield checks
