"""``specc train``: train an EAGLE or EAGLE-3 draft head on the target's own answers
(self-distillation).

Data (:mod:`specc.train_data`): training prompts that do not overlap the evaluation set,
the target's greedy answers, and the hidden states :mod:`specc.extract` records for prompt
+ answer. For a sequence ``x_0 .. x_{n-1}`` with target features ``f_p`` (EAGLE: the last
layer after the final norm, what ``lm_head`` reads), the head at position ``p`` reads the
pair (``fuse``d target state at ``p``, embedding of ``x_{p+1}``) and is trained on
positions ``p`` whose next-next token ``x_{p+2}`` is an answer token (``p >= prompt_len - 2``):

* EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", Sec. 4.2; SafeAILab/EAGLE's train config): the head's output predicts
  ``f_{p+1}``: ``L = 1.0 * SmoothL1(out, f_{p+1}) + 0.1 * CE(softmax(lm_head(f_{p+1})),
  log_softmax(lm_head(out)))`` (regression + classification against the target's
  distribution), with uniform noise ``U(-0.1, 0.1)`` (``noise_std`` 0.2) added to the
  input features, as EAGLE trains for the drift of its own drafted features.
* EAGLE-3 (Li et al. 2025): the paper trains with *training-time test* (the head unrolled
  over its own outputs for several steps). specc does **not** do that yet: it trains the
  single step, the fused low/mid/high features ``fc([h_low; h_mid; h_high])`` in, the
  cross-entropy of the head's draft-vocabulary logits against the target's distribution
  restricted to the draft vocabulary out (positions whose target argmax lies outside it are
  skipped), no feature regression. The draft vocabulary is the ``draft_vocab_size`` most
  frequent answer tokens (:func:`specc.train_data.draft_vocabulary`).

Optimizer: AdamW (betas 0.9, 0.95, as EAGLE), linear warm-up then cosine decay to 0 over
``epochs`` passes, gradient clipping at 0.5, fixed seed: the head's initial weights come
from ``seed``, epoch ``e``'s order from ``seed + e`` and step ``s``'s noise from
``seed`` and ``s``, so a resumed run (:mod:`specc.train_checkpoint`) equals an
uninterrupted one.

Output folder ``DIR``: the head (``config.json`` + ``model.safetensors``, the published
layout of :func:`specc.models.eagle_checkpoint.save_eagle_head`; ``config.json`` is moved
in last and marks a complete head), ``train.json`` (settings), ``metrics.jsonl`` (one line
per step), ``loss.png``, ``checkpoints/step_N/``, ``data/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specc.models.eagle import EagleHead, EagleHeadBase
from specc.models.eagle3 import Eagle3Head, default_layer_ids
from specc.models.kv_cache import KVCache
from specc.train_checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from specc.train_data import Sequence, draft_vocabulary, load_sequences, prepare_data

__all__ = ["TrainSettings", "train", "build_head", "head_loss", "teacher_forced_outputs", "Batch", "make_batch"]

MAX_LEN = 2048  # tokens of a sequence used for training (EAGLE's max_len)
DEFAULT_OUT = "heads/smollm2-eagle"
# settings that may change on --resume without changing the result
_RESUMABLE = ("max_steps", "save_every", "keep_checkpoints")


@dataclass
class TrainSettings:
    """Every knob of a ``specc train`` run (CLI flags of the same names)."""

    method: str = "eagle"            # eagle | eagle3
    prompts: str = "self"            # "self" or a JSONL file (specc.train_data)
    exclude: list[str] = field(default_factory=list)  # evaluation JSONL files to stay clear of
    num_prompts: int = 512           # ~1 h end to end on one core of this CPU (docs/speculative.md)
    max_tokens: int = 96             # greedy answer tokens per prompt
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 4              # sequences per step
    max_steps: int | None = None     # stop early (smoke runs); the schedule still spans `epochs`
    warmup_steps: int | None = None  # default: 3% of the schedule, at least 1
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    noise_std: float = 0.2           # EAGLE input-feature noise U(-std/2, std/2); 0 = off
    reg_weight: float = 1.0          # EAGLE: feature regression weight (v_w)
    cls_weight: float = 0.1          # EAGLE: classification weight (p_w)
    draft_vocab_size: int = 32000    # EAGLE-3 (capped at the target's vocabulary)
    layer_ids: list[int] | None = None  # EAGLE-3 target layers (default vLLM's 2, L//2, L-3)
    save_every: int = 50             # checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2        # newest checkpoints kept (< 1: all)

    def check(self) -> None:
        """Raises ValueError for a value out of range (named with its flag)."""
        if self.method not in ("eagle", "eagle3"):
            raise ValueError(f"--method {self.method!r}: choose eagle or eagle3")
        for name in ("num_prompts", "max_tokens", "epochs", "batch_size", "save_every", "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps {self.max_steps}: must be >= 1")
        if not self.lr > 0 or self.grad_clip <= 0 or self.noise_std < 0:
            raise ValueError(f"--lr {self.lr} and grad_clip {self.grad_clip} must be > 0, noise_std >= 0")
        if self.prompts != "self" and not Path(self.prompts).is_file():
            raise ValueError(f"--prompts {self.prompts}: no such file (give a JSONL file or 'self')")
        missing = [p for p in self.exclude if not Path(p).is_file()]
        if missing:
            raise ValueError(f"--exclude: no such file {', '.join(missing)}")


# ------------------------------------------------------------------------------ head
def build_head(method: str, target, *, layer_ids=None, d2t=None, t2d=None) -> EagleHeadBase:
    """A fresh head for ``target`` (:class:`~specc.models.llama.LlamaForCausalLM`): the
    target's decoder config with one layer; EAGLE with ``fc`` bias, EAGLE-3 over
    ``layer_ids`` with the draft vocabulary ``d2t``/``t2d``. Weights from torch's
    default initialisation (seed it first)."""
    config = dataclasses.replace(target.config, num_hidden_layers=1)
    if method == "eagle":
        return EagleHead(config, target, fc_bias=True)
    head = Eagle3Head(config, target, layer_ids=tuple(layer_ids), draft_vocab_size=len(d2t))
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    return head


def head_layers(method: str, num_target_layers: int, layer_ids=None) -> tuple[list[int], list[int]]:
    """(layers to extract, EAGLE-3's fused layers): EAGLE ``[L]``; EAGLE-3 its three
    layers then ``L`` (the last layer gives the target's distribution)."""
    n = num_target_layers
    if method == "eagle":
        return [n], []
    ids = sorted(layer_ids) if layer_ids else list(default_layer_ids(n))
    bad = [i for i in ids if not 0 <= i <= n]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(f"--layer-ids {ids}: give distinct ids in [0, {n}]")
    return (ids if ids[-1] == n else ids + [n]), ids


# ------------------------------------------------------------------------------ batches
@dataclass
class Batch:
    """Padded training pairs of B sequences (T = longest sequence - 1)."""

    input_ids: torch.Tensor  # [B, T] int64: x_{p+1} of the pair at p
    states: torch.Tensor     # [B, T, K, H] float32: the target states head.fuse reads, at p
    target: torch.Tensor     # [B, T, H] float32: f_{p+1}, the target's normed last layer
    mask: torch.Tensor       # [B, T] bool: positions whose loss counts


@torch.no_grad()
def make_batch(seqs: list[Sequence], num_fused: int, norm) -> Batch:
    """Pairs of ``seqs`` (extracted layers: the ``num_fused`` ones ``fuse`` reads, last =
    layer L; EAGLE reads layer L itself), padded at the end (causal: padding is never seen)."""
    t = max(min(len(s.token_ids), MAX_LEN) - 1 for s in seqs)
    b, h = len(seqs), seqs[0].hidden.shape[-1]
    k = max(num_fused, 1)
    ids = torch.zeros(b, t, dtype=torch.long)
    states = torch.zeros(b, t, k, h)
    target = torch.zeros(b, t, h)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = min(len(s.token_ids), MAX_LEN)
        ids[i, : n - 1] = s.token_ids[1:n]
        states[i, : n - 1] = s.hidden[: n - 1, :k] if num_fused else s.hidden[: n - 1, -1:]
        target[i, : n - 1] = norm(s.hidden[1:n, -1])
        mask[i, max(s.prompt_length - 2, 0) : n - 1] = True
    return Batch(ids, states, target, mask)


# ------------------------------------------------------------------------------ loss
def teacher_forced_outputs(head: EagleHeadBase, batch: Batch, noise_std: float = 0.0,
                           noise: torch.Generator | None = None) -> torch.Tensor:
    """The training forward: the head over every pair of ``batch`` at once (pair ``p`` =
    ``fuse``d target state at ``p`` + embedding of ``x_{p+1}``, RoPE position ``p``, causal),
    with uniform noise ``U(-noise_std/2, noise_std/2)`` on the features when ``noise_std > 0``.

    Returns ``[B, T, H]`` head outputs; ``head.compute_logits`` of row ``p`` scores
    ``x_{p+2}``. With ``noise_std = 0`` this is what the eager drafter computes for its
    first draft after the pair at ``p`` (tests/test_eagle_train_consistency.py)."""
    b, t = batch.input_ids.shape
    feats = head.fuse(batch.states)                                        # [B, T, H]
    if noise_std > 0:
        feats = feats + (torch.rand(feats.shape, generator=noise) - 0.5) * noise_std
    cache = KVCache.for_model(head.config, b, t, feats.dtype, feats.device)
    pos = torch.arange(t)[None].expand(b, t)
    return head(batch.input_ids, feats, pos, cache, kv_len=t)


def head_loss(head: EagleHeadBase, batch: Batch, settings: TrainSettings,
              noise: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of ``batch`` (module docstring) and its parts.

    Returns:
        (scalar loss with gradients, ``{"loss", "reg", "cls", "acc", "tokens"}``): ``acc`` is
        the fraction of counted positions where the head's top token equals the target's.
    """
    noise_std = settings.noise_std if head.method == "eagle" else 0.0
    out = teacher_forced_outputs(head, batch, noise_std, noise)[batch.mask]  # [N, H]
    tgt = batch.target[batch.mask]                                         # [N, H]
    with torch.no_grad():
        t_logits = head.target.lm_head(tgt).float()                        # [N, V]
        t_top = t_logits.argmax(-1)
    if head.method == "eagle":
        logp = torch.log_softmax(head.compute_logits(out), -1)
        cls = -(torch.softmax(t_logits, -1) * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(out, tgt)
        loss = settings.reg_weight * reg + settings.cls_weight * cls
        acc = (logp.argmax(-1) == t_top).float().mean()
    else:
        ids = head.draft_to_target()
        keep = head.t2d[t_top]                                             # target top in draft vocab
        d_logp = torch.log_softmax(head.lm_head(head.norm(out)).float(), -1)   # [N, V_draft]
        p = torch.softmax(t_logits[:, ids], -1)
        per = -(p * d_logp).sum(-1)
        cls = per[keep].mean() if bool(keep.any()) else per.sum() * 0
        reg = torch.zeros(())
        loss = cls
        acc = (ids[d_logp.argmax(-1)] == t_top).float().mean()
    return loss, {"loss": loss.item(), "reg": reg.item(), "cls": cls.item(), "acc": acc.item(),
                  "tokens": int(batch.mask.sum())}


def lr_at(step: int, total: int, warmup: int, base: float) -> float:
    """Learning rate of 0-based ``step``: linear warm-up over ``warmup`` steps, then
    cosine decay to 0 at ``total``."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


# ------------------------------------------------------------------------------ the run
def train(config, out_dir: str | os.PathLike, settings: TrainSettings, *, resume: bool = False,
          progress: bool = True) -> dict:
    """Train a head (module docstring) into ``out_dir``.

    Args:
        config: the target's ``model.yaml`` (path, dict or SpeccConfig); its
            ``speculative_config`` is ignored, the target runs in float32.
        out_dir: output folder; must be absent or empty unless ``resume``.
        settings: the run's settings (:class:`TrainSettings`).
        resume: reuse ``out_dir``'s data and continue from its newest checkpoint (once a
            checkpoint exists, settings must match the ones in its ``train.json``, except
            max_steps / save_every / keep_checkpoints; the data's own settings always).

    Returns:
        ``{"head": path, "steps": steps done, "total_steps": ..., "final": last metrics}``.

    Raises:
        ValueError: a setting out of range, ``out_dir`` not empty without ``resume`` or
            holding another run's settings, and the data's errors (:mod:`specc.train_data`).
        ConfigError: an invalid config or a target that cannot load.
    """
    settings.check()
    out = Path(out_dir).expanduser().resolve()
    _check_out_dir(out, settings, resume)
    target = _load_target(config)
    layers, fused = head_layers(settings.method, target.config.num_hidden_layers, settings.layer_ids)
    hs = prepare_data(config, out / "data", layers=layers, prompts=settings.prompts, num_prompts=settings.num_prompts,
                      max_tokens=settings.max_tokens, seed=settings.seed, exclude=settings.exclude, progress=progress)
    seqs, _ = load_sequences(hs)

    torch.manual_seed(settings.seed)
    if settings.method == "eagle3":
        d2t, t2d = draft_vocabulary(seqs, min(settings.draft_vocab_size, target.config.vocab_size),
                                    target.config.vocab_size)
        head = build_head("eagle3", target, layer_ids=fused, d2t=d2t, t2d=t2d)
    else:
        head = build_head("eagle", target)
    head.train()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr,
                                  betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    per_epoch = math.ceil(len(seqs) / settings.batch_size)
    total = settings.epochs * per_epoch
    warmup = settings.warmup_steps if settings.warmup_steps is not None else max(1, round(0.03 * total))
    stop = min(total, settings.max_steps) if settings.max_steps else total
    ckpt_dir = out / "checkpoints"
    start = 0
    if resume and (last := latest_checkpoint(ckpt_dir)) is not None:
        start = load_checkpoint(last, head, optimizer)
    metrics_file = out / "metrics.jsonl"
    history = _read_metrics(metrics_file, upto=start)
    _write_metrics(metrics_file, history)

    bar = _progress(stop, start, progress)
    t0 = time.perf_counter()
    step = start
    with metrics_file.open("a", encoding="utf-8") as log:
        for step in range(start, stop):
            epoch, k = divmod(step, per_epoch)
            order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(settings.seed + epoch))
            idx = order[k * settings.batch_size : (k + 1) * settings.batch_size].tolist()
            batch = make_batch([seqs[i] for i in idx], len(fused), target.model.norm)
            lr = lr_at(step, total, warmup, settings.lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            noise = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
            loss, m = head_loss(head, batch, settings, noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
            optimizer.step()
            row = {"step": step + 1, "epoch": epoch, "lr": lr, **m, "grad_norm": float(gnorm),
                   "time": time.perf_counter() - t0}
            history.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.2f}", lr=f"{lr:.1e}")
            if (step + 1) % settings.save_every == 0 or step + 1 == stop:
                save_checkpoint(ckpt_dir, step + 1, head, optimizer)
                prune_checkpoints(ckpt_dir, settings.keep_checkpoints)
                plot_losses(history, out / "loss.png")
    bar.close()
    if stop == start:  # nothing left to run: still make sure the outputs exist
        plot_losses(history, out / "loss.png")
    head.eval()
    _write_head(head, out)
    return {"head": out, "steps": stop, "total_steps": total, "final": history[-1] if history else None}


def _load_target(config):
    from specc.config import ConfigError, load_config
    from specc.models.loader import load_model

    cfg = load_config(config, overrides={"enforce_eager": True, "speculative_config": None, "dtype": "float32"})
    try:
        loaded = load_model(cfg.target, dtype=torch.float32, device=cfg.device)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"target = {cfg.target!r}: {e}") from e
    return loaded.model.requires_grad_(False)


def _check_out_dir(out: Path, settings: TrainSettings, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a folder")
    meta = out / "train.json"
    current = {k: v for k, v in dataclasses.asdict(settings).items() if k not in _RESUMABLE}
    if not resume:
        if out.is_dir() and any(out.iterdir()):
            raise ValueError(f"--out {out}: not empty; pass --resume to continue the run there, or choose "
                             "an empty folder")
    elif meta.is_file() and latest_checkpoint(out / "checkpoints") is not None:
        old = json.loads(meta.read_text())
        diff = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in current.items() if old.get(k) != v]
        if diff:
            raise ValueError(f"--resume {out}: the run there used other settings ({'; '.join(diff)})")
    out.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(current, indent=2) + "\n")


def _write_head(head: EagleHeadBase, out: Path) -> None:
    """``save_eagle_head`` into a temporary folder inside ``out``, then move its files in,
    ``config.json`` last (its presence marks a complete head)."""
    from specc.models.eagle_checkpoint import save_eagle_head

    (out / "config.json").unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".head.tmp-", dir=out))
    try:
        save_eagle_head(head, tmp)
        os.replace(tmp / "model.safetensors", out / "model.safetensors")
        os.replace(tmp / "config.json", out / "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_metrics(path: Path, upto: int) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def _write_metrics(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plot_losses(history: list[dict], path: Path) -> None:
    """Loss (and its parts) and top-1 agreement per step as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in history], color="tab:blue", label="loss")
    if any(r["reg"] for r in history):
        ax.plot(steps, [r["reg"] for r in history], color="tab:orange", alpha=0.6, label="feature regression")
        ax.plot(steps, [r["cls"] for r in history], color="tab:green", alpha=0.6, label="classification")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["acc"] for r in history], color="tab:red", linestyle="--", alpha=0.6,
             label="top-1 = target's (right axis)")
    ax2.set_ylabel("top-1 agreement")
    ax2.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax.set_title("specc train")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="step", desc="specc train", file=sys.stderr, disable=not enabled)
