"""EAGLE / EAGLE-3 chain drafting through the engine (runtime/drafters/eagle.py): greedy
output equals non-speculative greedy, batches with slot moves, every draft equals a
from-scratch recomputation (target forward + head over all true pairs), seeded sampling
reproducible, config and compile-path errors."""

from __future__ import annotations

import pytest
import torch

from eagle_checkpoints import write_eagle3_checkpoint
from helpers import drafter_spec, greedy, make_session, patched
from specc import SamplingParams
from specc.config import ConfigError, load_config
from specc.models.kv_cache import KVCache
from specc.runtime.drafters.eagle import EagleProposer

PROMPTS = ["Hello there, how are you today?", "The capital of France is", "1 2 3 4 5 6",
           "def f(x):\n    return", "Once upon a time"]


@pytest.fixture(scope="module")
def heads(tiny_eagle_heads):
    return tiny_eagle_heads


def _spec(heads, method: str, k: int, **kw) -> dict:
    return drafter_spec(method, k, heads[method], **kw)


@pytest.fixture(scope="module")
def reference(base):
    outs = base.generate(PROMPTS, greedy(20), use_speculation=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("k,max_num_seqs", [(1, 4), (3, 2), (5, 4)])
def test_greedy_equals_non_speculative(tiny_llama_dir, heads, reference, method, k, max_num_seqs):
    """Five prompts, at most ``max_num_seqs`` at once: requests are admitted as others
    finish and move slots (the head's cache and feature rows move with them)."""
    s = make_session(tiny_llama_dir, _spec(heads, method, k), max_num_seqs=max_num_seqs)
    assert isinstance(s.proposer, EagleProposer)
    outs = s.generate(PROMPTS, [greedy(20 - i) for i in range(len(PROMPTS))])
    for i, (o, ref) in enumerate(zip(outs, reference)):
        assert o.token_ids == ref[: 20 - i], (method, k, i)
    assert s.metrics.num_drafts > 0 and s.metrics.num_draft_tokens > 0


def _caught_up(target, head, ids: list[int], room: int):
    """From nothing: a target forward over the verified tokens ``ids[:-1]``, their fused
    features, the head over every pair ``(f_p, x_{p+1})`` in a fresh cache with ``room``
    positions to spare. Returns (head output at the last pair ``[1, 1, H]``, head cache, n)."""
    n = len(ids) - 1
    tc = KVCache.for_model(target.config, 1, n + room)
    out = target(torch.tensor([ids[:n]]), torch.arange(n)[None], tc, hidden_layers=head.hidden_layers)
    feats = head.fuse(torch.stack([out.hidden_states[i] for i in head.hidden_layers], dim=2))
    hc = head.make_cache(1, n + room)
    return head(torch.tensor([ids[1:]]), feats, torch.arange(n)[None], hc, kv_len=n)[:, -1:], hc, n


def _reference_logits(target, head, ids: list[int], drafts: list[int]) -> torch.Tensor:
    """``[len(drafts), V]``: the head's logits before each of ``drafts`` (chain steps on
    them after :func:`_caught_up`)."""
    h, hc, n = _caught_up(target, head, ids, len(drafts) + 1)
    logits = []
    for j, tok in enumerate(drafts):
        logits.append(head.compute_logits(h[:, -1])[0])
        h = head(torch.tensor([[tok]]), h, torch.tensor([[n + j]]), hc, kv_len=n + j + 1)
    return torch.stack(logits)


def _reference_drafts(target, head, ids: list[int], k: int) -> list[int]:
    """Greedy drafts recomputed from nothing: :func:`_caught_up`, then k-1 chain steps."""
    h, hc, n = _caught_up(target, head, ids, k + 1)
    drafts = []
    for j in range(k):
        tok = int(head.compute_logits(h[:, -1]).argmax(-1))
        drafts.append(tok)
        h = head(torch.tensor([[tok]]), h, torch.tensor([[n + j]]), hc, kv_len=n + j + 1)
    return drafts


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_from_scratch_recomputation(tiny_llama_dir, heads, method):
    """The proposer's incremental state (feature buffer, head KV, catch-up pairs, slot
    moves) drafts exactly what a from-scratch computation drafts, at every step."""
    k = 3
    s = make_session(tiny_llama_dir, _spec(heads, method, k), max_num_seqs=2)
    prop, target = s.proposer, s.target.model
    checked = []

    def propose(batch, max_drafts, uniforms):
        p = EagleProposer.propose(prop, batch, max_drafts, uniforms)
        for b, r in enumerate(batch.requests):
            if max_drafts[b] > 0:
                ref = _reference_drafts(target, prop.head, r.all_token_ids[: r.num_computed + 1], k)
                assert p.draft_token_ids[b].tolist() == ref, (r.request_id, r.num_computed)
                checked.append(r.request_id)
        return p

    with patched(prop, "propose", propose), torch.inference_mode():
        s.generate(PROMPTS[:4], [greedy(12 + 3 * i) for i in range(4)])
    assert len(set(checked)) == 4 and len(checked) > 20


@pytest.mark.parametrize("tree", [None, "[(0,), (1,), (0, 0)]"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_seeded_sampling_reproducible(tiny_llama_dir, heads, method, tree):
    """Chains, and static trees (``speculative_token_tree``: deterministic candidates)."""
    s = make_session(tiny_llama_dir, _spec(heads, method, 3, **({} if tree is None else
                                                                 dict(speculative_token_tree=tree))))
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=100 + i)
              for i in range(3)]
    a = [o.token_ids for o in s.generate(PROMPTS[:3], params)]
    b = [o.token_ids for o in s.generate(PROMPTS[:3], params)]
    assert a == b
    assert len({tuple(x) for x in a}) == 3
    assert s.metrics.num_draft_tokens > 0


def test_eagle3_layer_ids_from_config(tiny_llama_dir, tmp_path, base):
    d = write_eagle3_checkpoint(tmp_path / "e3", base.target.model.config)  # no ids in its config.json
    with pytest.raises(ConfigError, match=r"speculative_config.model = .*default layers.*"
                                          r"eagle_aux_hidden_state_layer_ids"):
        make_session(tiny_llama_dir, dict(method="eagle3", model=str(d)))
    s = make_session(tiny_llama_dir, dict(method="eagle3", model=str(d), eagle_aux_hidden_state_layer_ids=[2, 1, 0]))
    assert s.proposer.hidden_layers == (0, 1, 2)


def test_config_rules():
    with pytest.raises(ConfigError, match=r"speculative_config.model: method 'eagle' needs 'model': the folder "
                                          r"of an EAGLE head"):
        load_config(dict(target="t", speculative_config=dict(method="eagle")))
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids = \[1\]: not allowed with method "
                                          r"'eagle' \(only with 'eagle3'\)"):
        load_config(dict(target="t", speculative_config=dict(method="eagle", model="h",
                                                              eagle_aux_hidden_state_layer_ids=[1])))
    with pytest.raises(ConfigError, match="must be distinct"):
        load_config(dict(target="t", speculative_config=dict(method="eagle3", model="h",
                                                              eagle_aux_hidden_state_layer_ids=[1, 1])))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_compile_path_takes_eagle_on_cpu_only(method):
    """EAGLE compiles (tests/test_compiled_eagle.py); on CUDA its head state is not
    captured into CUDA graphs yet, so it is refused there with a message."""
    from specc.compiler import check_compilable

    check_compilable(load_config(dict(target="t", speculative_config=dict(method=method, model="h"))))
    cfg = load_config(dict(target="t", device="cuda", speculative_config=dict(method=method, model="h")))
    with pytest.raises(ConfigError, match=rf"method = '{method}' on device 'cuda'.*set enforce_eager: true"):
        check_compilable(cfg)


def test_bad_head_reported_against_model(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"speculative_config.model = .*: EAGLE head .*no such folder"):
        make_session(tiny_llama_dir, dict(method="eagle", model=str(tmp_path / "missing")))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_long_prompt_chunked_prefill(tiny_llama_dir, heads, method):
    """A 300-token prompt: the target's prefill and the head's prompt pass both run in
    chunks of 256; drafts still equal the from-scratch recomputation at every step."""
    s = make_session(tiny_llama_dir, _spec(heads, method, 2), max_model_len=400)
    prompt = [(7 * i) % 997 + 100 for i in range(300)]
    ref = s.generate([prompt], greedy(10), use_speculation=False)[0].token_ids
    prop, target = s.proposer, s.target.model

    def propose(batch, max_drafts, uniforms):
        p = EagleProposer.propose(prop, batch, max_drafts, uniforms)
        r = batch.requests[0]
        assert p.draft_token_ids[0].tolist() == _reference_drafts(target, prop.head,
                                                                   r.all_token_ids[: r.num_computed + 1], 2)
        return p

    with patched(prop, "propose", propose), torch.inference_mode():
        assert s.generate([prompt], greedy(10))[0].token_ids == ref


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_sampled_draft_probs_are_the_heads_processed_distribution(tiny_llama_dir, heads, method):
    """q handed to rejection sampling = softmax of the head's logits after the request's
    own temperature / top-k / top-p, recomputed from scratch; each sampled draft has
    q > 0; EAGLE-3's q is zero outside its draft vocabulary (t2d)."""
    from specc.runtime.sampling import process_logits

    k = 3
    s = make_session(tiny_llama_dir, _spec(heads, method, k), max_num_seqs=3)
    prop, target = s.proposer, s.target.model
    settings = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=20), dict(temperature=0.0)]
    checked = []

    def propose(batch, max_drafts, uniforms):
        p = EagleProposer.propose(prop, batch, max_drafts, uniforms)
        assert p.draft_probs is not None
        for b, r in enumerate(batch.requests):
            if max_drafts[b] == 0 or bool(batch.is_greedy[b]):
                continue
            drafts = p.draft_token_ids[b].tolist()
            logits = _reference_logits(target, prop.head, r.all_token_ids[: r.num_computed + 1], drafts)
            rows = len(drafts)
            q = torch.softmax(process_logits(logits, batch.temperature[b].repeat(rows), batch.top_k[b].repeat(rows),
                                             batch.top_p[b].repeat(rows)), dim=-1)
            assert torch.allclose(p.draft_probs[b], q, atol=1e-5)
            assert bool((p.draft_probs[b][torch.arange(rows), p.draft_token_ids[b]] > 0).all())
            if method == "eagle3":
                assert float(p.draft_probs[b][:, ~prop.head.t2d].sum()) == 0.0
            checked.append(r.request_id)
        return p

    params = [SamplingParams(**st, max_tokens=12, seed=5 + i) for i, st in enumerate(settings)]
    with patched(prop, "propose", propose), torch.inference_mode():
        s.generate(PROMPTS[:3], params)
    assert len(set(checked)) == 2 and len(checked) >= 8
