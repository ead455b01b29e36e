"""Read and write EAGLE / EAGLE-3 heads in their published checkpoint layout.

A head folder holds ``config.json`` (a Llama config with ``num_hidden_layers: 1``, plus
the head's own keys) and ``model.safetensors`` (or several ``*.safetensors``):

* EAGLE (SafeAILab/EAGLE, ``yuhuili/EAGLE-*``): ``fc.weight``, ``fc.bias`` (unless
  config ``bias: false``), ``layers.{i}.*`` (layer 0 without ``input_layernorm``);
* EAGLE-3 (``yuhuili/EAGLE3-*``, vLLM's ``llama_eagle3``): ``fc.weight``, ``midlayer.*``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``; config ``draft_vocab_size`` and
  optionally ``eagle_aux_hidden_state_layer_ids`` (top level or inside ``eagle_config``)
  and ``target_hidden_size``.

Either may carry ``embed_tokens.weight`` (a copy of the target's embedding, which EAGLE
trains frozen): a copy equal to the target's is dropped (the head uses the target's),
a different one is kept as the head's own. The kind is told by the keys (``midlayer.*``
= EAGLE-3). The original releases ship ``pytorch_model.bin``; specc never unpickles and
refuses such a folder with the conversion to run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .eagle import EagleHead, EagleHeadBase
from .eagle3 import Eagle3Head, default_layer_ids
from .llama import LlamaForCausalLM, ModelConfig

__all__ = ["load_eagle_head", "save_eagle_head", "head_config_dict", "EAGLE_METHODS"]

EAGLE_METHODS = ("eagle", "eagle3")
WEIGHTS_FILE = "model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_EMBED = "embed_tokens.weight"
LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"  # vLLM's name


# ------------------------------------------------------------------------------------ load
def load_eagle_head(
    path: str | Path,
    target: LlamaForCausalLM,
    *,
    method: str | None = None,
    layer_ids: list[int] | tuple[int, ...] | None = None,
) -> EagleHeadBase:
    """Load the EAGLE or EAGLE-3 head in folder ``path`` for ``target``.

    Args:
        path: folder with ``config.json`` and ``*.safetensors``.
        target: the loaded target; the head takes its dtype and device and shares its
            embedding (and, for EAGLE, its final norm and ``lm_head``).
        method: ``"eagle"`` / ``"eagle3"`` to insist on a kind (None: whatever the keys say).
        layer_ids: EAGLE-3's target layers, overriding the head's config (HF numbering).

    Returns:
        an :class:`~specc.models.eagle.EagleHead` or :class:`~specc.models.eagle3.Eagle3Head`,
        in eval mode with gradients off.

    Raises:
        FileNotFoundError: no such folder, no ``config.json``, no weights.
        ValueError: only pickle weights (the message names the conversion); a head of the
            other kind than ``method``; a head whose hidden size or vocabulary differs from
            the target's; layer ids out of range; missing or unexpected keys (listed); a
            tensor of the wrong shape (key and both shapes); inconsistent ``d2t``/``t2d``.
    """
    folder = Path(path).expanduser()
    raw = _read_config(folder)
    sd = _read_weights(folder)
    kind = _kind(sd, folder)
    if method is not None and method != kind:
        other = {"eagle": "an EAGLE", "eagle3": "an EAGLE-3"}
        raise ValueError(f"{folder} holds {other[kind]} head ({_kind_evidence(kind)}), not {other[method]} "
                         f"head: set speculative_config.method: {kind}")
    config = _head_config(raw, folder)
    _check_matches_target(config, raw, target, folder)
    own_embed = _own_embedding(sd.pop(_EMBED, None), target, folder)
    if kind == "eagle":
        fc_bias = bool(raw.get("bias", "fc.bias" in sd))
        build = lambda: EagleHead(config, target, fc_bias=fc_bias)  # noqa: E731
    else:
        ids = resolve_layer_ids(raw, target.config.num_hidden_layers, layer_ids, sd.get("fc.weight"),
                                config.hidden_size, folder)
        draft_vocab = int(raw.get("draft_vocab_size") or config.vocab_size)
        nbr = bool(raw.get("norm_before_residual", False))
        build = lambda: Eagle3Head(config, target, layer_ids=ids, draft_vocab_size=draft_vocab,  # noqa: E731
                                   norm_before_residual=nbr)
        _default_vocab_maps(sd, draft_vocab, config.vocab_size)
    with torch.device("meta"):
        head = build()
    _assign(head, sd, folder, target)
    if own_embed is not None:
        head.embed_tokens = torch.nn.Embedding.from_pretrained(own_embed.to(**_like(target)), freeze=True)
    if kind == "eagle3":
        _check_vocab_maps(head, folder)
    return head.eval().requires_grad_(False)


def resolve_layer_ids(raw: dict, num_target_layers: int, override, fc_weight: torch.Tensor | None,
                      hidden: int, folder: Path | str = "") -> tuple[int, ...]:
    """EAGLE-3's target layers: ``override``, else the config's
    ``eagle_aux_hidden_state_layer_ids`` (top level, then ``eagle_config``), else vLLM's
    default; returned increasing. Raises ValueError for duplicates, ids outside
    ``[0, L]``, or a count that does not match ``fc.weight``'s ``count * hidden`` inputs."""
    eagle_cfg = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    given = override or raw.get(LAYER_IDS_KEY) or eagle_cfg.get(LAYER_IDS_KEY)
    ids = tuple(int(i) for i in given) if given else default_layer_ids(num_target_layers)
    where = ("speculative_config." + LAYER_IDS_KEY) if override else (
        f"{LAYER_IDS_KEY} in {folder}/config.json" if given else
        f"vLLM's default layers (2, L // 2, L - 3) for L = {num_target_layers}")
    bad = [i for i in ids if not 0 <= i <= num_target_layers]
    if bad:
        raise ValueError(f"{where}: layer ids {bad} are outside [0, {num_target_layers}] (the target has "
                         f"{num_target_layers} layers; 0 = embeddings, j = output of layer j-1); set "
                         f"speculative_config.{LAYER_IDS_KEY}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: layer ids {list(ids)} repeat a layer; give distinct ids")
    if fc_weight is not None and fc_weight.dim() == 2 and fc_weight.shape[1] != len(ids) * hidden:
        raise ValueError(f"{where}: {len(ids)} layer ids, but fc.weight {tuple(fc_weight.shape)} takes "
                         f"{fc_weight.shape[1]} = {fc_weight.shape[1] / hidden:g} x hidden_size {hidden} inputs")
    return tuple(sorted(ids))


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise FileNotFoundError(f"EAGLE head {folder}: no such folder (expected config.json + model.safetensors)")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"EAGLE head {folder}: no config.json")
    try:
        raw = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"EAGLE head {cfg}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"EAGLE head {cfg}: expected a JSON object")
    return raw


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
        if pickles:
            src = pickles[0]
            raise ValueError(
                f"EAGLE head {folder}: only pickle weights ({', '.join(pickles[:4])}); specc loads only "
                f"safetensors and never unpickles. Convert once, in a trusted environment: python -c "
                f"\"import torch; from safetensors.torch import save_file; save_file(torch.load('{src}', "
                f"map_location='cpu', weights_only=True), '{WEIGHTS_FILE}')\" (run inside {folder})")
        raise FileNotFoundError(f"EAGLE head {folder}: no {WEIGHTS_FILE} (no *.safetensors at all)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f), device="cpu"))
    return sd


def _kind(sd: dict[str, torch.Tensor], folder: Path) -> str:
    if any(k.startswith("midlayer.") for k in sd):
        return "eagle3"
    if any(k.startswith("layers.") for k in sd):
        return "eagle"
    raise ValueError(f"EAGLE head {folder}: neither an EAGLE head (layers.0.*) nor an EAGLE-3 head "
                     f"(midlayer.*); keys found: {sorted(sd)[:8]}")


def _kind_evidence(kind: str) -> str:
    return "midlayer.* keys" if kind == "eagle3" else "layers.* keys"


def _head_config(raw: dict[str, Any], folder: Path) -> ModelConfig:
    from transformers import LlamaConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
    try:
        return ModelConfig.from_hf(LlamaConfig(**fields))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"EAGLE head {folder}/config.json: {e}") from None


def _check_matches_target(config: ModelConfig, raw: dict, target: LlamaForCausalLM, folder: Path) -> None:
    t = target.config
    problems = []
    if config.hidden_size != t.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} differs from the target's {t.hidden_size}")
    th = raw.get("target_hidden_size")
    if th is not None and th != t.hidden_size:
        problems.append(f"target_hidden_size {th} differs from the target's hidden_size {t.hidden_size}")
    if config.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} differs from the target's {t.vocab_size}")
    if problems:
        raise ValueError(f"EAGLE head {folder} was not trained for this target: " + "; ".join(problems))


def _like(target: LlamaForCausalLM) -> dict[str, Any]:
    w = target.lm_head.weight
    return {"dtype": w.dtype, "device": w.device}


def _own_embedding(emb: torch.Tensor | None, target: LlamaForCausalLM, folder: Path) -> torch.Tensor | None:
    """The checkpoint's embedding when it differs from the target's, else None (shared)."""
    if emb is None:
        return None
    ref = target.model.embed_tokens.weight
    if tuple(emb.shape) != tuple(ref.shape):
        raise ValueError(f"EAGLE head {folder}: {_EMBED} has shape {tuple(emb.shape)}, the target's "
                         f"embedding {tuple(ref.shape)}")
    same = torch.equal(emb.to(dtype=ref.dtype, device=ref.device), ref)
    return None if same else emb


def _default_vocab_maps(sd: dict[str, torch.Tensor], draft_vocab: int, vocab: int) -> None:
    """A full-vocabulary EAGLE-3 head may omit d2t/t2d: identity maps."""
    if draft_vocab == vocab:
        sd.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        sd.setdefault("t2d", torch.ones(vocab, dtype=torch.bool))


def _assign(head: EagleHeadBase, sd: dict[str, torch.Tensor], folder: Path, target: LlamaForCausalLM) -> None:
    """Put the checkpoint's tensors into ``head`` (built on the meta device), cast to the
    target's dtype (floating tensors only) and device. ValueError lists every problem."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)}, expected {tuple(expected[k].shape)}"
              for k in sorted(set(sd) & set(expected)) if tuple(sd[k].shape) != tuple(expected[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if shapes:
        problems.append("wrong shapes: " + "; ".join(shapes))
    if problems:
        raise ValueError(f"EAGLE head {folder} does not match its config ({head.method} layout, "
                         f"hidden_size {head.config.hidden_size}): " + "; ".join(problems))
    like = _like(target)
    cast = {k: v.to(**like) if v.is_floating_point() else v.to(device=like["device"]) for k, v in sd.items()}
    head.load_state_dict(cast, strict=True, assign=True)
    head.rotary_emb.reset_inv_freq(like["device"])


def _check_vocab_maps(head, folder: Path) -> None:
    """``d2t`` must map draft ids to distinct target ids that ``t2d`` marks."""
    ids = head.draft_to_target()
    v = head.config.vocab_size
    if bool(((ids < 0) | (ids >= v)).any()):
        raise ValueError(f"EAGLE-3 head {folder}: d2t maps draft ids outside the target vocabulary [0, {v})")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"EAGLE-3 head {folder}: d2t maps two draft ids to the same target id")
    if int(head.t2d.sum()) != head.draft_vocab_size or not bool(head.t2d[ids].all()):
        raise ValueError(f"EAGLE-3 head {folder}: t2d does not mark exactly the target ids d2t maps to "
                         f"(t2d has {int(head.t2d.sum())} True, draft_vocab_size is {head.draft_vocab_size})")


# ------------------------------------------------------------------------------------ save
def head_config_dict(head: EagleHeadBase) -> dict[str, Any]:
    """The head's ``config.json`` in the published layout (a Llama config with the head's
    own keys: EAGLE ``bias``; EAGLE-3 ``draft_vocab_size``,
    ``eagle_aux_hidden_state_layer_ids``, ``target_hidden_size``)."""
    c = head.config
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if head.method == "eagle" else "LlamaForCausalLMEagle3"],
        "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias, "tie_word_embeddings": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
    }
    if head.method == "eagle":
        d["bias"] = head.fc.bias is not None
    else:
        d.update(draft_vocab_size=head.draft_vocab_size, target_hidden_size=c.hidden_size,
                 norm_before_residual=head.midlayer.norm_before_residual)
        d[LAYER_IDS_KEY] = list(head.hidden_layers)
    return d


def save_eagle_head(head: EagleHeadBase, path: str | Path) -> Path:
    """Write ``head`` as ``config.json`` + ``model.safetensors`` (the published layout)
    into folder ``path`` (created; existing files of those names are replaced).
    :func:`load_eagle_head` reads it back to identical tensors."""
    from safetensors.torch import save_file

    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(head_config_dict(head), indent=2) + "\n")
    return folder
