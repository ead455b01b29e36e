"""specc.models.llama / kv_cache against transformers' own implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama

from specc.models.kv_cache import KVCache
from specc.models.llama import LlamaForCausalLM, ModelConfig, rope_inv_freq
from specc.models.loader import load_model

TOL = 1e-4  # fp32, tiny models


def _load_pair(folder):
    ours = load_model(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, hf


@torch.no_grad()
def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    """HF logits [len(seq), V] of one sequence, no cache, no padding."""
    return hf(torch.tensor([seq])).logits[0].float()


@torch.no_grad()
def _run_steps(model, cache, steps):
    """Feed ``steps`` = list of per-step rows ``[(tokens, start_pos, n_real)]`` through
    ``model``; pads (beyond n_real) get trash_pos. Returns per-step logits [B, T, V] and
    the per-row real token sequences."""
    seqs = [[] for _ in steps[0]]
    outs = []
    for step in steps:
        t = max(len(tokens) for tokens, _, _ in step)
        ids = torch.zeros(len(step), t, dtype=torch.long)
        pos = torch.full((len(step), t), cache.trash_pos, dtype=torch.long)
        for b, (tokens, start, n_real) in enumerate(step):
            ids[b, :len(tokens)] = torch.tensor(tokens)
            pos[b, :n_real] = torch.arange(start, start + n_real)
            seqs[b] += tokens[:n_real]
        outs.append(model(ids, pos, cache, kv_len=None if t > 1 else 24).logits)
    return outs, seqs


@pytest.mark.parametrize("which", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_prefill_decode_and_multi_token_step_match_hf(which, request):
    ours, hf = _load_pair(request.getfixturevalue(which))
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(0, ours.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731

    # row 0: 7-token prompt; row 1: 4-token prompt padded to 7 (pads at trash_pos)
    steps = [[(tok(7), 0, 7), (tok(4) + [0, 0, 0], 0, 4)]]
    for i in range(5):  # 5 one-token decode steps
        steps.append([(tok(1), 7 + i, 1), (tok(1), 4 + i, 1)])
    steps.append([(tok(3), 12, 3), (tok(2) + [0], 9, 2)])  # multi-token step, row 1 padded

    cache = KVCache.for_model(ours.config, num_slots=2, max_model_len=32)
    outs, seqs = _run_steps(ours.model, cache, steps)
    refs = [_hf_logits(hf, s) for s in seqs]

    worst = 0.0
    for step, out in zip(steps, outs):
        for b, (_, start, n_real) in enumerate(step):
            diff = (out[b, :n_real] - refs[b][start:start + n_real]).abs().max().item()
            worst = max(worst, diff)
    assert outs[0].dtype == torch.float32
    assert worst < TOL, f"max |dlogits| {worst:.2e}"


@torch.no_grad()
def test_early_exit_and_hidden_layers_match_hf(tiny_llama_dir):
    ours, hf = _load_pair(tiny_llama_dir)
    ids = torch.randint(0, ours.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)[None]
    ref = hf(ids, output_hidden_states=True)
    n = ours.config.num_hidden_layers

    cache = KVCache.for_model(ours.config, 1, 16)
    out = ours.model(ids, pos, cache, hidden_layers=tuple(range(n + 1)))
    assert sorted(out.hidden_states) == list(range(n + 1))
    for i in range(n):  # HF's last entry is after the final norm; ours is before it
        assert (out.hidden_states[i] - ref.hidden_states[i]).abs().max() < TOL
    assert (ours.model.model.norm(out.hidden_states[n]) - ref.hidden_states[n]).abs().max() < TOL
    assert (out.logits - ref.logits).abs().max() < TOL

    # early exit after 1 layer == HF layers[:1] + final norm + lm_head
    early = ours.model(ids, pos, KVCache.for_model(ours.config, 1, 16), num_layers=1, hidden_layers=(1,))
    ref_early = hf.lm_head(hf.model.norm(ref.hidden_states[1]))
    assert (early.logits - ref_early).abs().max() < TOL
    assert (early.hidden_states[1] - ref.hidden_states[1]).abs().max() < TOL
    with pytest.raises(ValueError, match="hidden_layers"):
        ours.model(ids, pos, cache, num_layers=1, hidden_layers=(2,))


@torch.no_grad()
def test_pad_tokens_at_trash_pos_do_not_change_real_rows(tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir).model
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    big = KVCache.for_model(cfg, 2, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, big.trash_pos, big.trash_pos]])
    padded = model(ids, pos, big).logits

    alone_cache = KVCache.for_model(cfg, 1, 16)
    alone = model(ids[1:, :3], pos[1:, :3], alone_cache).logits
    assert torch.allclose(padded[1, :3], alone[0], atol=1e-5)
    for k_big, k_alone in zip(big.k, alone_cache.k):
        assert torch.allclose(k_big[1, :, :3], k_alone[0, :, :3], atol=1e-6)
        assert k_big[1, :, big.trash_pos].abs().sum() > 0  # the pads were written there

    # the next decode step of row 1 is unaffected too
    nxt = torch.tensor([[7]])
    a = model(torch.cat([ids[:1, :1], nxt]), torch.tensor([[5], [3]]), big).logits[1]
    b = model(nxt, torch.tensor([[3]]), alone_cache).logits[0]
    assert torch.allclose(a, b, atol=1e-5)


@torch.no_grad()
def test_explicit_mask_and_kv_len_equal_default(tiny_llama_dir):
    model = load_model(tiny_llama_dir).model
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    ref = model(ids, pos, KVCache.for_model(cfg, 2, 16)).logits
    mask = torch.arange(8)[None, None, :] <= pos[:, :, None]
    got = model(ids, pos, KVCache.for_model(cfg, 2, 16), attn_mask=mask, kv_len=8).logits
    assert torch.allclose(ref, got, atol=1e-5)
    with pytest.raises(ValueError, match="attn_mask"):
        model(ids, pos, KVCache.for_model(cfg, 2, 16), attn_mask=mask, kv_len=9)


@torch.no_grad()
def test_kv_cache_rows_copy_slot_and_errors(tiny_llama_dir):
    model = load_model(tiny_llama_dir).model
    cfg = model.config
    cache = KVCache.for_model(cfg, num_slots=3, max_model_len=16)
    assert cache.trash_pos == 16 and cache.k[0].shape == (3, cfg.num_key_value_heads, 17, cfg.head_dim)
    assert cache.nbytes == 2 * cfg.num_hidden_layers * 3 * cfg.num_key_value_heads * 17 * cfg.head_dim * 4
    view = cache.rows(2)
    assert view.num_slots == 2 and view.k[0].data_ptr() == cache.k[0].data_ptr()

    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    model(ids, torch.arange(3).repeat(2, 1), view)
    assert cache.k[1][1, :, :3].abs().sum() > 0  # writes through the view land in the parent

    cache.copy_slot(1, 2)  # slot 2 continues sequence 1
    a = model(torch.tensor([[11]] * 3), torch.tensor([[3]] * 3), cache).logits[2]
    moved = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 16, cfg.head_dim)
    for src, dst in zip((*cache.k, *cache.v), (*moved.k, *moved.v)):
        dst[0].copy_(src[2])
    b = model(torch.tensor([[11]]), torch.tensor([[3]]), moved).logits[0]
    assert torch.allclose(a, b, atol=1e-5)

    with pytest.raises(ValueError, match="rows"):
        model(ids, torch.arange(3).repeat(2, 1), cache)  # 3 slots for a batch of 2
    with pytest.raises(ValueError):
        cache.rows(4)
    with pytest.raises(IndexError):
        cache.copy_slot(0, 3)


def test_model_config_from_hf_errors():
    with pytest.raises(ValueError, match="'mistral'.*llama, qwen2"):
        ModelConfig.from_hf(MistralConfig())
    yarn = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf(yarn)
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf(Qwen2Config(use_sliding_window=True, sliding_window=16))
    cfg = ModelConfig.from_hf(LlamaConfig(eos_token_id=[2, 5]))
    assert cfg.eos_token_ids == (2, 5)
    assert hash(cfg) == hash(ModelConfig.from_hf(LlamaConfig(eos_token_id=[2, 5])))


@torch.no_grad()
def test_llama3_rope_scaling_matches_hf():
    hf_cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})
    torch.manual_seed(4)
    hf = HFLlama(hf_cfg).eval()
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert torch.allclose(rope_inv_freq(cfg), hf.model.rotary_emb.inv_freq, rtol=1e-6)

    ours = LlamaForCausalLM.from_state_dict(cfg, hf.state_dict())
    ids = torch.randint(0, 128, (1, 40))
    pos = torch.arange(1000, 1040)[None]  # far positions: where the scaling matters
    j = torch.arange(1041)[None, None, :]
    mask = (j >= 1000) & (j <= pos[:, :, None])  # HF sees only these 40 tokens
    got = ours(ids, pos, KVCache.for_model(cfg, 1, 1040), attn_mask=mask).logits
    ref = hf(ids, position_ids=pos).logits
    assert (got - ref).abs().max() < TOL


@torch.no_grad()
def test_bf16_cast_keeps_rope_fp32_and_float_logits(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype=torch.bfloat16).model
    assert model.lm_head.weight.dtype == torch.bfloat16
    model.to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    cache = KVCache.for_model(model.config, 1, 8, dtype=torch.bfloat16)
    out = model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


@pytest.mark.real_model
@torch.no_grad()
def test_real_model_prefill_and_decode_match_hf(smollm2_dir, capsys):
    ours, hf = _load_pair(smollm2_dir)
    prompt = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    n = len(prompt)
    cache = KVCache.for_model(ours.config, 1, 128)
    logits = [ours.model(torch.tensor([prompt]), torch.arange(n)[None], cache).logits[0]]
    seq = list(prompt)
    for i in range(8):  # greedy decode through our cache
        nxt = int(logits[-1][-1].argmax())
        seq.append(nxt)
        step = ours.model(torch.tensor([[nxt]]), torch.tensor([[n + i]]), cache, kv_len=n + 8)
        logits.append(step.logits[0])
    ref = _hf_logits(hf, seq)[: n + 8]
    diff = (torch.cat(logits) - ref).abs().max().item()
    with capsys.disabled():
        print(f"\nSmolLM2-135M fp32 prefill({n}) + 8 decode steps: max |dlogits| vs HF = {diff:.2e}")
    assert diff < 1e-3
