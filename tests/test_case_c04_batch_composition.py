"""C4 Batch composition (../shared/cases/correctness.md).

Two identical greedy requests, the second admitted (continuous batching: a KV slot frees)
while the first is mid-generation, into a batch whose rows carry different numbers of
drafts (padded at the cache's trash position); prompts of 1, 7 and 300 tokens admitted
at different steps, one of them finishing at its prefill. Every request must give the
non-speculative output of the same request run alone; placeholder or padding tokens
never appear in outputs, logprobs or the drafter's history.

Drafters: n-gram, draft model (own KV cache: slot moves, stale state, rollback after
rejections; once == target, once another model with the same tokenizer), early exit
(the target's first layer, shared cache) and an oracle (scripted, records the history
it is called with).

The :class:`KVShadow` checker (also used by C5) wraps a model's ``forward`` and the cache's
``copy_slot`` and keeps a shadow of which token every (slot, layer, position) of the KV
cache holds. On every forward it checks, per real row:

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
import pytest
import torch

from spec_drafters import OracleDrafter
from specc import SamplingParams, Session
from specc.kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID

K = 4
MAX_MODEL_LEN = 384
NGRAM = dict(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=4)


# ------------------------------------------------------------------------------ checker
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
    ngram_histories: list[list[int]] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        return self.target.errors + (self.drafter.errors if self.drafter and self.drafter is not self.target else [])


def _wrap_forward(model, shadow: KVShadow, stack: contextlib.ExitStack) -> None:
    orig = model.forward

    def forward(input_ids, positions, kv_cache, *, attn_mask=None, kv_len=None, num_layers=None, **kw):
        out = orig(input_ids, positions, kv_cache, attn_mask=attn_mask, kv_len=kv_len, num_layers=num_layers, **kw)
        shadow.on_forward(input_ids, positions, kv_len, num_layers, out.logits)
        return out

    model.forward = forward
    stack.callback(lambda: model.__dict__.pop("forward", None))


def _wrap(obj, name: str, make, stack: contextlib.ExitStack) -> None:
    orig = getattr(obj, name)
    setattr(obj, name, make(orig))
    stack.callback(lambda: obj.__dict__.pop(name, None))


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
        yield checks


def assert_histories(checks: Checks, proposer, outs) -> None:
    """The drafter was only ever shown prompt + emitted tokens."""
    full = {o.request_id: list(o.prompt_token_ids) + list(o.token_ids) for o in outs}
    plen = {o.request_id: len(o.prompt_token_ids) for o in outs}
    for hist in checks.ngram_histories:
        assert any(len(hist) > plen[r] and f[: len(hist)] == hist for r, f in full.items()), hist
    for rid, hist, proposed in getattr(proposer, "calls", []):
        assert len(hist) > plen[rid] and full[rid][: len(hist)] == hist, (rid, hist)
        assert all(t >= 0 for t in proposed)


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (two contend badly on a shared 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base(tiny_llama_dir) -> Session:
    return Session(dict(target=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=1), verbose=False)


@pytest.fixture(scope="module")
def prompts(base) -> dict[str, list[int]]:
    tok = base.tokenizer
    rep = tok.encode("The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown")
    para = tok.encode(
        "Speculative decoding drafts several tokens cheaply and lets the large model check "
        "them all in one forward pass; the tokens it agrees with are kept, the first one it "
        "rejects is replaced by its own choice. " * 12
    )
    assert len(para) >= 300
    out = {
        "rep": rep,
        "filler": tok.encode("Hello there, how are"),
        "one": tok.encode(" the")[:1],
        "one_b": tok.encode(" Paris")[:1],
        "seven": tok.encode("Once upon a time, in a land far")[:7],
        "seven_b": tok.encode("def add(a, b):\n    return a +")[:7],
        "p300": para[:300],
    }
    assert [len(out[n]) for n in ("one", "one_b", "seven", "seven_b", "p300")] == [1, 1, 7, 7, 300]
    return out


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3)


@pytest.fixture(scope="module")
def alone(base):
    """Non-speculative output of each (prompt, max_tokens), run alone (batch of one)."""
    memo: dict = {}

    def get(prompt: list[int], max_tokens: int):
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = base.generate([prompt], _params(max_tokens), use_speculation=False)[0]
        return memo[key]

    return get


METHODS = ["ngram", "draft_model", "draft_model_other", "early_exit", "oracle"]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, smollm2_tokenizer):
    """A second tiny Llama (other random weights, same tokenizer): a drafter that is
    mostly wrong, so the draft model's state is rolled back after rejections."""
    from conftest import TINY_SEED, build_tiny_model

    return build_tiny_model("llama", smollm2_tokenizer, tmp_path_factory.mktemp("c4_other"), seed=TINY_SEED + 1)


@pytest.fixture(scope="module")
def sessions(tiny_llama_dir, other_llama_dir, prompts, alone):
    made: dict[str, Session] = {}

    def get(method: str) -> Session:
        if method in made:
            return made[method]
        cfg = dict(target=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
        proposer = None
        if method == "ngram":
            cfg["speculative_config"] = NGRAM
        elif method == "draft_model":
            cfg["speculative_config"] = dict(method="draft_model", num_speculative_tokens=K, model=str(tiny_llama_dir))
        elif method == "draft_model_other":  # a different model: most drafts rejected
            cfg["speculative_config"] = dict(method="draft_model", num_speculative_tokens=K, model=str(other_llama_dir))
        elif method == "early_exit":
            cfg["speculative_config"] = dict(method="draft_model", num_speculative_tokens=K, num_draft_layers=1)
        else:
            truth = {tuple(p): alone(p, 40).token_ids for p in prompts.values()}
            proposer = OracleDrafter(K, truth)
        made[method] = Session(cfg, proposer=proposer, verbose=False)
        return made[method]

    return get


def _run_and_check(session: Session, method: str, reqs: list[tuple[list[int], int]], alone):
    """Run ``reqs`` ((prompt, max_tokens)) as one generate call with every check on."""
    if method == "oracle":
        session.proposer.calls.clear()
    with checked(session) as checks:
        outs = session.generate([p for p, _ in reqs], [_params(m) for _, m in reqs])
    assert checks.errors == []
    vocab = session.target.config.vocab_size
    for (prompt, m), out in zip(reqs, outs):
        ref = alone(prompt, m)
        assert out.token_ids == ref.token_ids, (method, len(prompt), m)
        assert out.finish_reason == ref.finish_reason
        assert all(0 <= t < vocab for t in out.token_ids) and PLACEHOLDER_TOKEN_ID not in out.token_ids
        # one logprob entry per emitted token, for that token, equal to non-spec
        assert len(out.logprobs) == len(out.token_ids)
        for lp, ref_lp, tok in zip(out.logprobs, ref.logprobs, out.token_ids):
            assert lp.token_id == tok and np.isfinite(lp.logprob)
            assert abs(lp.logprob - ref_lp.logprob) < 1e-4
            assert [t for t, _ in lp.top] == [t for t, _ in ref_lp.top]
            assert all(0 <= t < vocab and np.isfinite(v) for t, v in lp.top)
            assert np.allclose([v for _, v in lp.top], [v for _, v in ref_lp.top], atol=1e-4)
        assert out.metrics.num_generation_tokens == len(out.token_ids)
        assert sum(out.metrics.tokens_per_step) == len(out.token_ids)
    assert_histories(checks, session.proposer, outs)
    if method in ("draft_model", "oracle"):
        # the drafter proposes the target's own greedy tokens: if its state survived the
        # admissions and slot moves, every draft is accepted
        for out in outs:
            s = out.metrics.spec
            assert s.num_accepted_tokens == s.num_draft_tokens, (method, out.request_id, s)
    return outs, checks


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("method", METHODS)
def test_identical_request_admitted_mid_generation(method, sessions, prompts, alone):
    """max_num_seqs=2: A runs; a short filler ends after a step or two, freeing its slot;
    A' (identical to A) is admitted into it while A is mid-generation. Their rows sit at
    different offsets with different draft counts in every shared step."""
    s = sessions(method)
    reqs = [(prompts["rep"], 24), (prompts["filler"], 3), (prompts["rep"], 24)]
    outs, checks = _run_and_check(s, method, reqs, alone)
    assert outs[0].token_ids == outs[2].token_ids
    a, a2 = outs[0].request_id, outs[2].request_id
    adm = {rid: (step, others) for rid, step, others in checks.admissions}
    step, others = adm[a2]
    assert step > 0 and 0 < others.get(a, 0) < 24, (step, others)  # A was mid-generation
    assert any(n == 2 for n, _ in checks.step_sizes[step:])  # and they then shared steps
    assert checks.target.num_padded > 0  # some of them padded (rows with fewer drafts)
    assert checks.errors == []
    if method != "oracle":
        assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("method", METHODS)
def test_prompts_1_7_300_admitted_at_different_steps(method, sessions, prompts, alone):
    """max_num_seqs=2 with six requests: the 1-, 7- and 300-token prompts are admitted
    at different steps as slots free (one request ends at its prefill: max_tokens=1)."""
    s = sessions(method)
    reqs = [
        (prompts["seven"], 14),
        (prompts["one"], 1),  # finishes at prefill, still sits in the next step's batch
        (prompts["p300"], 10),
        (prompts["one_b"], 6),
        (prompts["seven_b"], 4),
        (prompts["rep"], 9),
    ]
    outs, checks = _run_and_check(s, method, reqs, alone)
    steps = [step for _, step, _ in checks.admissions]
    assert len(steps) == len(reqs)
    assert len(set(steps)) >= 4, steps  # admitted over (at least) four different steps
    mid = [others for _, step, others in checks.admissions if step > 0]
    assert any(any(0 < n for n in o.values()) for o in mid)  # admitted beside a running request
    assert outs[1].token_ids == alone(prompts["one"], 1).token_ids and len(outs[1].token_ids) == 1
