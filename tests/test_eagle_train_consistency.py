"""What ``specc train`` optimises is what the eager drafter drafts with.

The training path (``specc extract``'s hidden states of prompt + greedy answer,
:func:`specc.train.make_batch`, :func:`specc.train.teacher_forced_outputs`) and a real
eager generation (runtime/drafters/eagle.py through the engine) must pair the same
target feature with the same token at the same position: the head at position ``p`` reads
``f_p`` and the embedding of ``x_{p+1}`` and its logits score ``x_{p+2}``. So at every
step of a greedy generation the proposer's first-draft logits (after verified tokens
``x_0 .. x_{n-1}``, last token ``x_n``) equal the training forward's logits at ``p = n - 1``,
and its first draft is their argmax. A mismatch here (which feature goes with which
embedding, pre- vs post-norm features, RoPE offset, dtype, stale head K/V after a
verify) makes a head that scores well in training draft poorly; the test checks it with
random tiny heads, batched, through slot moves, greedy output still lossless.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import drafter_spec, greedy, make_session, patched
from specc.datasets import read_jsonl
from specc.extract import extract_hidden_states
from specc.runtime.drafters.eagle import EagleProposer
from specc.train import head_layers, make_batch, teacher_forced_outputs
from specc.train_data import load_sequences

PROMPTS = ["Hello there, how are you today?", "The capital of France is", "1 2 3 4 5 6",
           "def f(x):\n    return", "Once upon a time"]
MAX_TOKENS = 16


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_first_draft_equals_teacher_forced_training_prediction(tiny_llama_dir, tiny_eagle_heads, tmp_path,
                                                               method):
    k = 3
    spec = make_session(tiny_llama_dir, drafter_spec(method, k, tiny_eagle_heads[method]), max_num_seqs=2)
    prop: EagleProposer = spec.proposer
    head = prop.head
    first: list[tuple[str, int, torch.Tensor]] = []  # (request id, num_computed, first-draft logits)

    def propose(batch, max_drafts, uniforms):
        calls = []
        real = head.compute_logits

        def logits(h):
            out = real(h)
            calls.append(out.clone())
            return out

        with patched(head, "compute_logits", logits):
            p = EagleProposer.propose(prop, batch, max_drafts, uniforms)
        for b, r in enumerate(batch.requests):
            if max_drafts[b] > 0:
                assert int(p.draft_token_ids[b, 0]) == int(calls[0][b].argmax())
                first.append((r.request_id, r.num_computed, calls[0][b]))
        return p

    with patched(prop, "propose", propose):
        outs = spec.generate(PROMPTS, greedy(MAX_TOKENS), chat=False)
    want = spec.generate(PROMPTS, greedy(MAX_TOKENS), chat=False, use_speculation=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]  # lossless

    # the training data path: extract (greedy answers + hidden states), make_batch, forward
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"id": str(i), "prompt": t, "chat": False}) + "\n"
                             for i, t in enumerate(PROMPTS)))
    L = spec.target.config.num_hidden_layers
    layers, fused = head_layers(method, L, list(head.hidden_layers) if method == "eagle3" else None)
    cfg = {"target": str(tiny_llama_dir), "max_model_len": 256, "max_num_seqs": 2}
    hs = extract_hidden_states(cfg, read_jsonl(jsonl), layers, tmp_path / "hs", max_tokens=MAX_TOKENS,
                               progress=False)
    seqs, _ = load_sequences(hs)
    by_id = {}
    for o, seq in zip(outs, seqs):
        assert seq.token_ids.tolist() == list(o.prompt_token_ids) + list(o.token_ids)
        batch = make_batch([seq], len(fused), spec.target.model.model.norm)
        with torch.inference_mode():
            by_id[o.request_id] = head.compute_logits(teacher_forced_outputs(head, batch))[0]  # [T, V]

    assert len({rid for rid, _, _ in first}) == len(PROMPTS) and len(first) > 2 * len(PROMPTS)
    for rid, n, got in first:
        ref = by_id[rid][n - 1]  # pair (f_{n-1}, x_n) scores x_{n+1}, the first draft
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"request {rid}, num_computed {n}")
        assert int(got.argmax()) == int(ref.argmax()), (rid, n)
