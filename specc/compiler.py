"""`specc compile`: trace, transform and lower every program for every batch bucket.

For each program (see DESIGN.md, "Programs"):

1. export the plain module (:mod:`specc.runtime.programs`) with example inputs of the
   program's static shapes → a flat FX graph (:func:`specc.passes.signature.export_flat`);
2. run the passes: :func:`~specc.passes.fuse_projections.fuse_projections` (one GEMM for
   q/k/v and one for gate/up); for the step programs
   :func:`~specc.passes.accept_reject.fuse_accept_reject` (accept/reject, sampling and
   logprobs on the device: the program returns tokens and counts, never logits) and
   :func:`~specc.passes.bucket_padding.pad_rows` (padded rows of a bucket are inert);
   a tree step gets :func:`~specc.passes.tree_accept_reject.fuse_tree_accept_reject`
   instead of the chain's accept/reject;
3. export the transformed graph again and lower it with AOTInductor into a ``.pt2``
   package whose constants are kept out of the package: the artifact stores one
   ``weights.safetensors`` for all programs and every program binds the same tensors at
   load (:mod:`specc.runtime.replay`).

Programs: ``prefill`` (batch 1, one prompt chunk of 2..:data:`PREFILL_CHUNK` tokens: the
chunk length is a symbolic size, like kv_len), ``decode_b{b}`` (one token per row: the non-speculative step,
also used by a speculative session on steps where no row has drafts) and, with
speculation, ``spec_step_b{b}`` (``[last token, d_1..d_k]`` per row) for every bucket
``b``. For host drafters (``ngram``, ``suffix``) the drafts are inputs of ``spec_step``;
for an early-exit drafter (``draft_model`` with ``num_draft_layers``) ``spec_step`` is the
fused draft-then-verify program: :class:`~specc.runtime.programs.EarlyExitStepProgram`
(k draft steps through the first N layers, then the verify, traced as one module so both
read the same weight constants) with the accept/reject spliced on using the drafter's q;
for an EAGLE / EAGLE-3 head (``eagle``, ``eagle3``) ``spec_step`` is
:class:`~specc.runtime.programs.EagleStepProgram` (the head's catch-up and k chain steps,
the verify, accept/reject with the head's q) and ``prefill`` is
:class:`~specc.runtime.programs.EaglePrefillProgram` (the target's chunk and the head's
prompt pass), both with the head's KV cache and feature buffer as state inputs
(``drafter`` in the manifest; docs/compile.md, "EAGLE programs");
for a drafter that proposes token trees (:func:`proposes_trees`) also
``tree_step_b{b}`` (``k + 1`` tree nodes per row, the tree's parents an input; tree
accept/reject and KV compaction by :mod:`specc.passes.tree_accept_reject`).

Why AOTInductor packages rather than Inductor's caches: opening a package is a
``dlopen`` (~0.2 s per program, measured) with no tracing at all, whereas a warm
``torch.compile`` cache still re-traces the model with Dynamo on every start.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from specc.artifact import FORMAT_VERSION, MODEL_DIR, PROGRAMS_DIR, WEIGHTS, environment, write_artifact
from specc.config import ConfigError, SpeccConfig, load_config
from specc.sampling_params import MAX_LOGPROBS

__all__ = ["compile_artifact", "plan_programs", "PREFILL_CHUNK", "COMPILED_METHODS", "KV_LEN_ALIGN"]

#: Longest prompt chunk of the prefill program (batch 1, dynamic length 2..this). A prompt
#: runs as chunks of this many tokens and an exact tail (a 1-token tail gets one pad).
#: Measured on SmolLM2-135M, one thread: one 64-token forward 205 ms, two 32-token
#: forwards 278 ms, so chunks are as long as memory allows rather than bucketed.
PREFILL_CHUNK = 256
#: The runtime rounds each call's kv_len (keys attended) up to a multiple of this.
KV_LEN_ALIGN = 32
#: Drafting methods whose step has a compiled program (None = no speculation). Host
#: drafters' tokens are inputs of ``spec_step``, so one program serves both (the artifact
#: still records the method it was built for); ``draft_model`` compiles for early exit
#: (``num_draft_layers``) only, whose drafts are made inside ``spec_step``, as are an
#: EAGLE / EAGLE-3 head's.
COMPILED_METHODS = (None, "ngram", "suffix", "draft_model", "eagle", "eagle3")
#: Methods whose head runs inside ``prefill`` and ``spec_step`` (:func:`plan_programs`).
EAGLE_METHODS = ("eagle", "eagle3")
#: Choices of :func:`apply_linear_passes` (``specc compile --linear-passes``); ``"auto"``
#: is :func:`default_linear_passes`.
LINEAR_PASSES = ("pretranspose", "small_m", "gemv", "none")
#: The lowering where ``specc::small_m_linear`` cannot run (no AVX512_BF16 CPU, no C++
#: toolchain, CUDA); also what :func:`build_program` uses when not told.
DEFAULT_LINEAR_PASSES = "pretranspose"


def default_linear_passes(dtype: torch.dtype, device: str) -> str:
    """The linear lowering ``specc compile`` picks: ``"gemv"`` for fp32 and bf16 CPU
    programs where the ``specc::small_m_linear`` C++ kernel builds and loads (it is built
    here, once, so the artifact's first step does not wait for it), else
    :data:`DEFAULT_LINEAR_PASSES`. Measured (docs/compile.md, "Verify cost"): SmolLM2-135M
    fp32, one thread, whole programs: a 5-token verify 1.11x a decode step (MKL GEMMs:
    1.91x), decode itself 1.03x; bf16: decode 0.57-0.78x of oneDNN's packed decode."""
    from specc.kernels.small_m_gemv import kernel_available
    from specc.passes.small_m_gemv import DTYPES

    if device == "cpu" and dtype in DTYPES and kernel_available():
        return "gemv"
    return DEFAULT_LINEAR_PASSES


def plan_programs(config: SpeccConfig) -> list[dict[str, Any]]:
    """The programs an artifact for ``config`` holds: ``{name, kind, batch, tokens}``
    (``tokens`` = positions per row: the chunk length, 1, or k + 1); a ``spec_step`` that
    drafts inside the program also has ``draft_layers`` (N of the early-exit drafter) or
    ``drafter`` (``"eagle"`` / ``"eagle3"``: the head runs in it), as has the prefill of
    an EAGLE artifact (the head's prompt pass)."""
    spec = config.speculative_config
    k = spec.num_speculative_tokens if spec else 0
    head = dict(drafter=spec.method) if spec and spec.method in EAGLE_METHODS else {}
    in_graph = dict(draft_layers=spec.num_draft_layers) if spec and spec.is_early_exit else head
    plan = [dict(name="prefill", kind="prefill", batch=1, tokens=prefill_chunk(config.max_model_len), **head)]
    for b in config.batch_buckets:
        plan.append(dict(name=f"decode_b{b}", kind="decode", batch=b, tokens=1))
        if k:
            plan.append(dict(name=f"spec_step_b{b}", kind="spec_step", batch=b, tokens=k + 1, **in_graph))
        if k and proposes_trees(config):
            plan.append(dict(name=f"tree_step_b{b}", kind="tree_step", batch=b, tokens=k + 1))
    return plan


def proposes_trees(config: SpeccConfig) -> bool:
    """Whether ``config``'s drafter can propose token trees (``suffix_decoding_propose_tree``
    or ``ngram_propose_tree``): its artifact then holds ``tree_step_b{b}``. Both drafters'
    trees hold at most ``num_speculative_tokens`` drafts, so a tree step verifies
    ``N = k + 1`` nodes, the chain step's width."""
    spec = config.speculative_config
    return spec is not None and spec.tree_field is not None


def check_compilable(config: SpeccConfig, label: str | None = None) -> None:
    """ConfigError when ``config`` asks for something no compiled program implements yet."""
    method = config.speculative_config.method if config.speculative_config else None
    if method not in COMPILED_METHODS:
        raise ConfigError(
            f"speculative_config.method = {method!r}: compiled programs exist for 'ngram', 'suffix', "
            "early exit ('draft_model' with num_draft_layers), 'eagle', 'eagle3' and for non-speculative decoding "
            "so far; set "
            "enforce_eager: true (specc generate/bench/profile: --enforce-eager) to run this method on the "
            "eager path", label)
    if method == "draft_model" and not config.speculative_config.is_early_exit:
        raise ConfigError(
            "speculative_config: a separate draft model (model:) has no compiled program yet (only early exit, "
            "num_draft_layers, drafts inside spec_step); set enforce_eager: true (specc generate/bench/profile: "
            "--enforce-eager) to run it on the eager path", label)
    if config.device == "npu":
        raise ConfigError("device = 'npu': the torchair backend is not built yet; set enforce_eager: true",
                          label)
    if method in EAGLE_METHODS and config.speculative_config.tree_field is not None:
        raise ConfigError(
            f"speculative_config.{config.speculative_config.tree_field}: method {method!r} drafts token trees "
            "on the eager "
            "path only (no compiled program drafts an EAGLE tree yet); set enforce_eager: true (specc "
            "generate/bench/profile: --enforce-eager), or drop it for compiled chain "
            "drafting", label)
    if method in EAGLE_METHODS and config.device == "cuda":
        raise ConfigError(f"speculative_config.method = {method!r} on device 'cuda': the EAGLE programs' "
                          "head state is not captured into CUDA graphs yet; set enforce_eager: true", label)


def compile_artifact(config: str | os.PathLike | dict | SpeccConfig, out_dir: str | os.PathLike, *,
                     progress: bool = True, target=None, head=None, linear_passes: str = "auto") -> Path:
    """Build the artifact folder for ``config`` at ``out_dir`` (atomically).

    Args:
        config: a ``model.yaml`` path, dict or :class:`SpeccConfig`.
        out_dir: destination folder (an earlier artifact there is replaced).
        progress: show a progress bar and per-program times on stderr.
        target: an already loaded :class:`specc.models.loader.LoadedModel` (skips loading).
        head: an already loaded EAGLE head for ``target`` (``eagle`` / ``eagle3``; skips
            loading ``speculative_config.model``).
        linear_passes: the linear lowering of every program, one of :data:`LINEAR_PASSES`,
            or ``"auto"`` (:func:`default_linear_passes`); the manifest records it.

    Returns:
        the artifact folder.

    Raises:
        ConfigError: invalid config, a method without compiled programs, unloadable weights.
        ArtifactError: ``out_dir`` exists and is not an artifact.
        ValueError: unknown ``linear_passes``.
    """
    from specc.artifact import check_output_dir, draft_hash, model_files_hash
    from specc.models.loader import load_model
    from specc.passes.packed_weights import uses_packed_weights
    from specc.session import _check_device

    label = str(config) if isinstance(config, (str, os.PathLike)) else None
    cfg = load_config(config)
    check_compilable(cfg, label)
    _check_device(cfg.device, label)
    check_output_dir(out_dir)  # before minutes of loading and compiling
    if linear_passes != "auto" and linear_passes not in LINEAR_PASSES:
        raise ValueError(f"linear_passes = {linear_passes!r}: expected 'auto' or one of {', '.join(LINEAR_PASSES)}")
    if target is None:
        try:
            target = load_model(cfg.target, dtype=cfg.torch_dtype, device=cfg.device)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"target = {cfg.target!r}: {e}", label) from e
    plan = plan_programs(cfg)
    packed = uses_packed_weights(cfg.torch_dtype, cfg.device)
    if linear_passes == "auto":
        linear_passes = default_linear_passes(cfg.torch_dtype, cfg.device)
    if progress:
        print(f"specc: linear lowering {linear_passes!r}", file=sys.stderr)
    spec = cfg.speculative_config
    if head is None and spec is not None and spec.method in EAGLE_METHODS:
        head = _load_head(cfg, target, label)

    def build(tmp: Path) -> dict[str, Any]:
        (tmp / PROGRAMS_DIR).mkdir()
        constants: dict[str, torch.Tensor] = {}
        bar = _progress(plan, progress)
        for prog in bar:
            if hasattr(bar, "set_description"):
                bar.set_description(f"specc compile {prog['name']}")
            t0 = time.perf_counter()
            with warnings.catch_warnings():  # torch-internal deprecation noise from export / pytree
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                gm, args, dynamic_shapes = build_program(target.model, cfg, prog, head=head,
                                                         linear_passes=linear_passes)
                prog["packed_constants"] = _lower(gm, args, dynamic_shapes,
                                                  tmp / PROGRAMS_DIR / f"{prog['name']}.pt2", packed=packed)
            prog["file"] = f"{PROGRAMS_DIR}/{prog['name']}.pt2"
            prog["inputs"] = _signature(gm, args, dynamic_shapes)
            prog["compile_seconds"] = round(time.perf_counter() - t0, 2)
            for name, t in _constants(gm).items():
                constants.setdefault(name, t)
            if progress:
                print(f"specc: compiled {prog['name']} in {prog['compile_seconds']:.1f}s", file=sys.stderr)
        stored = _save_weights(constants, tmp / WEIGHTS)
        target.tokenizer.save_pretrained(tmp / MODEL_DIR)
        target.hf_config.save_pretrained(tmp / MODEL_DIR)
        return {
            "format": FORMAT_VERSION,
            "config": cfg.to_dict(),
            "source": {"config": str(Path(label).resolve()) if label else None, "target": cfg.target,
                       "target_folder": str(target.folder)},
            "environment": environment(cfg.device),
            "weights_hash": target.weights_hash,
            "model_hash": model_files_hash(target.folder),
            **({"draft_hash": draft_hash(spec.model), "draft_folder": str(Path(spec.model).expanduser().resolve())}
               if head is not None else {}),
            "max_logprobs": MAX_LOGPROBS,
            "linear_passes": linear_passes,
            "programs": plan,
            "constants": stored,
        }

    return write_artifact(out_dir, build)


def build_program(model, cfg: SpeccConfig, prog: dict[str, Any], *, linear_passes: str = DEFAULT_LINEAR_PASSES,
                  head=None):
    """The transformed flat graph of one program, its example inputs (flat tuple) and
    their ``dynamic_shapes`` (``key_positions``' length, kv_len, is the one symbolic size;
    a prefill's chunk length another).

    Input order: ``input_ids, positions, [last_index,] kv_0 .. kv_{2L-1}, key_positions``
    then, for the step programs, the inputs the passes add (``num_draft_tokens, uniforms,
    temperature, top_k, top_p, num_rows``). An early-exit ``spec_step`` (``draft_layers``)
    takes ``input_ids [b, 1]`` (the last tokens) and its draft loop's ``uniforms,
    temperature, top_k, top_p`` right after ``key_positions``, then ``num_draft_tokens,
    num_rows``; an EAGLE ``spec_step`` (``drafter``) the same with the head's state
    ``head_kv_0 .. head_kv_{2L'-1}, features`` and its catch-up pairs ``pair_ids,
    pair_positions`` after ``top_p``; an EAGLE ``prefill`` takes ``head_kv_*, features``
    last. A ``tree_step``: ``input_ids, start, parents, num_draft_tokens, kv_0 ..
    kv_{2L-1}, key_positions, uniforms, temperature, top_k, top_p, num_rows``.

    Args:
        head: the loaded EAGLE head of a program with ``drafter`` (None otherwise).

    Raises:
        ValueError: a program with ``drafter`` and no ``head``.
    """
    from specc.models.kv_cache import KVCache
    from specc.passes.accept_reject import fuse_accept_reject
    from specc.passes.bucket_padding import CHAIN_FILLS, TREE_FILLS, pad_rows
    from specc.passes.signature import export_flat, placeholders
    from specc.passes.tree_accept_reject import fuse_tree_accept_reject
    from specc.runtime.programs import (EaglePrefillProgram, EagleStepProgram, EarlyExitStepProgram, PrefillProgram,
                                        TreeVerifyProgram, VerifyProgram, flat_kv)

    if prog.get("drafter") and head is None:
        raise ValueError(f"program {prog['name']} runs an EAGLE head: pass head=")
    b, t, S, dev = prog["batch"], prog["tokens"], cfg.max_model_len, cfg.device
    kv = flat_kv(KVCache.for_model(model.config, b, S, cfg.torch_dtype, dev))
    ids = torch.zeros(b, t, dtype=torch.long, device=dev)
    pos = torch.arange(t, device=dev).repeat(b, 1)
    keys = torch.arange(max(S // 2, 3), device=dev)  # example kv_len, not a bound
    kv_dim = torch.export.Dim("kv_len", min=2, max=S)
    no_kv = (None,) * len(kv)
    k = t - 1
    values = {**step_example_inputs(b, k, dev), **{f"kv_{i}": x for i, x in enumerate(kv)}, "key_positions": keys}
    dims: dict[str, dict] = {"key_positions": {0: kv_dim}}
    state, state_dyn = (), ()
    if head is not None and prog.get("drafter"):  # the head's state, after the program's own inputs
        head_kv = flat_kv(head.make_cache(b, S))
        features = torch.zeros(b, S + 1, head.config.hidden_size, dtype=head.fc.weight.dtype, device=dev)
        state, state_dyn = (head_kv, features), ((None,) * len(head_kv), None)
        values.update({f"head_kv_{i}": x for i, x in enumerate(head_kv)}, features=features)
    with torch.no_grad():
        if prog["kind"] == "prefill":
            chunk = torch.export.Dim("chunk", min=2, max=t)
            ids, pos = ids[:, : min(t, 16)], pos[:, : min(t, 16)]  # example length, not a bound
            last = torch.tensor([ids.shape[1] - 1], device=dev)
            values.update(input_ids=ids, positions=pos, last_index=last)
            dims.update(input_ids={1: chunk}, positions={1: chunk})
            module = EaglePrefillProgram(model, head, S) if state else PrefillProgram(model, S)
            gm = export_flat(module, (ids, pos, last, kv, keys, *state),
                             ({1: chunk}, {1: chunk}, None, no_kv, {0: kv_dim}, *state_dyn))
            apply_linear_passes(gm, linear_passes)
        elif prog["kind"] == "tree_step":
            head_in = (ids, torch.zeros(b, dtype=torch.long, device=dev), chain_parents(b, k, dev),
                       torch.zeros(b, dtype=torch.long, device=dev))
            values.update(zip(("input_ids", "start", "parents", "num_draft_tokens"), head_in))
            gm = export_flat(TreeVerifyProgram(model, S), (*head_in, kv, keys), (*[None] * 4, no_kv, {0: kv_dim}))
            apply_linear_passes(gm, linear_passes)
            gm = fuse_tree_accept_reject(gm, num_speculative_tokens=k, max_logprobs=MAX_LOGPROBS, trash_pos=S)
            gm = pad_rows(gm, trash_pos=S, fills=TREE_FILLS)
        else:
            fills = CHAIN_FILLS
            values.update(input_ids=ids, positions=pos)
            sampling = tuple(values[n] for n in ("uniforms", "temperature", "top_k", "top_p"))
            if prog.get("draft_layers") or prog.get("drafter"):  # the drafts are made inside the program
                ids = values["input_ids"] = torch.zeros(b, 1, dtype=torch.long, device=dev)  # contiguous: strides are compiled in
                if state:
                    pairs = (torch.zeros(b, t, dtype=torch.long, device=dev), pos.clone())
                    values.update(pair_ids=pairs[0], pair_positions=pairs[1])
                    fills = {**CHAIN_FILLS, "pair_ids": 0, "pair_positions": "trash"}
                    drafter, extra = EagleStepProgram(model, head, S, k), (*state, *pairs)
                else:
                    drafter, extra = EarlyExitStepProgram(model, S, prog["draft_layers"], k), ()
                gm = export_flat(drafter, (ids, pos, kv, keys, *sampling, *extra),
                                 (None, None, no_kv, {0: kv_dim}, *[None] * len(sampling), *state_dyn,
                                  *[None] * (len(extra) - len(state))))
            else:
                gm = export_flat(VerifyProgram(model, S), (ids, pos, kv, keys), (None, None, no_kv, {0: kv_dim}))
            apply_linear_passes(gm, linear_passes)
            # CUDA programs are replayed as CUDA graphs: no data-dependent branch (runtime/cuda_graphs.py)
            gm = fuse_accept_reject(gm, num_speculative_tokens=k, max_logprobs=MAX_LOGPROBS,
                                    branch_free=dev == "cuda")
            gm = pad_rows(gm, trash_pos=S, fills=fills)
    names = list(placeholders(gm))
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"program {prog['name']}: no example value for inputs {missing}")
    return gm, tuple(values[n] for n in names), tuple(dims.get(n) for n in names)


def _load_head(cfg: SpeccConfig, target, label):
    """The EAGLE head ``speculative_config.model`` for ``target`` (ConfigError if it cannot load)."""
    from specc.models.eagle_checkpoint import load_eagle_head

    spec = cfg.speculative_config
    try:
        return load_eagle_head(spec.model, target.model, method=spec.method,
                               layer_ids=spec.eagle_aux_hidden_state_layer_ids)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"speculative_config.model = {spec.model!r}: {e}", label) from e


def apply_linear_passes(gm, which: str = DEFAULT_LINEAR_PASSES) -> None:
    """The linear-layer passes, the same in every program of an artifact (their constants
    are shared by name, so a per-program choice would store weights twice).

    * ``"pretranspose"`` (default): q/k/v and gate/up fused into one projection each
      (:mod:`~specc.passes.fuse_projections`), then every weight stored transposed
      (:mod:`~specc.passes.pretranspose_weights`) so each projection is an MKL NN GEMM.
      SmolLM2-135M, AOTInductor, one thread, kv_len 128, speed-up over no pass
      (bench/fuse_projections_speed.py): b=1 T=1 1.13-1.17x, b=1 T=5 1.02-1.08x, b=2 T=5
      1.18-1.22x, b=2 T=1 0.87x (MKL's NT kernel is faster for 2-3 rows).
    * ``"small_m"``: fusion, then linears over at most 8 static rows as fused row
      reductions (:mod:`~specc.passes.small_m_linear`). Faster than MKL in isolation for
      the layers' shapes, but slower in the whole program (b=1 T=1 0.88x, T=5 1.02x of no
      pass) and on the 49152-row lm_head (15 vs 8 ms): not the default; kept for the
      benchmarks (docs/compile.md, "Verify cost").
    * ``"gemv"`` (what ``specc compile`` picks on CPUs where the kernel builds,
      :func:`default_linear_passes`): fusion, then bf16 linears over at most 16 and fp32
      ones over at most 40 static rows (decode and step programs; not the prefill chunk) through
      ``specc::small_m_linear`` (:mod:`~specc.passes.small_m_gemv`: weights stay plain
      ``[N, K]``, each streamed once for all rows); the others stay ``aten.linear``
      (MKL; in bf16 freezing packs them for oneDNN). Measured in docs/compile.md,
      "Verify cost".
    * ``"none"``: the exported graph as is.

    Raises:
        ValueError: unknown ``which``.
    """
    from specc.passes.fuse_projections import fuse_projections
    from specc.passes.pretranspose_weights import pretranspose_weights
    from specc.passes.small_m_gemv import small_m_gemvs
    from specc.passes.small_m_linear import small_m_linears

    if which not in LINEAR_PASSES:
        raise ValueError(f"linear passes {which!r}: expected one of {', '.join(LINEAR_PASSES)}")
    if which == "none":
        return
    fuse_projections(gm)
    if which == "small_m":
        small_m_linears(gm)
    elif which == "gemv":
        small_m_gemvs(gm)
    else:
        pretranspose_weights(gm)


def prefill_chunk(max_model_len: int) -> int:
    """Longest chunk of the prefill program: PREFILL_CHUNK, or less for a short cache."""
    return min(PREFILL_CHUNK, max_model_len)


def chain_parents(b: int, k: int, device) -> torch.Tensor:
    """``[b, k]`` int64 parents of a chain (node ``i + 1``'s parent is ``i``): example trees."""
    return torch.arange(k, device=device).repeat(b, 1)


def step_example_inputs(b: int, k: int, device) -> dict[str, torch.Tensor]:
    """Example values of the inputs the step passes add, by placeholder name."""
    return {
        "num_draft_tokens": torch.zeros(b, dtype=torch.long, device=device),
        "uniforms": torch.zeros(b, 2 * k + 1, dtype=torch.float32, device=device),
        "temperature": torch.zeros(b, dtype=torch.float32, device=device),
        "top_k": torch.zeros(b, dtype=torch.long, device=device),
        "top_p": torch.ones(b, dtype=torch.float32, device=device),
        "num_rows": torch.tensor(b, dtype=torch.long, device=device),
    }


def _lower(gm, args, dynamic_shapes, path: Path, *, packed: bool = False) -> dict[str, dict[str, Any]]:
    """Export the transformed graph again and compile it into an AOTInductor package with
    its constants kept outside (bound at load).

    With ``packed`` (bf16/fp16 on CPU, :func:`~specc.passes.packed_weights.uses_packed_weights`)
    the linears get oneDNN-packed weights (Inductor freezing); returns the map from the
    package's packed constants to the artifact constants they are rebuilt from at load
    (empty without packing)."""
    from specc.passes.packed_weights import lower_packed

    with torch.no_grad():
        ep = torch.export.export(gm, tuple(args), dynamic_shapes=tuple(dynamic_shapes), strict=False)
        if packed:
            return lower_packed(ep, _constants(gm), path)
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(path),
            inductor_configs={"aot_inductor.package_constants_in_so": False})
    return {}


def _signature(gm, args, dynamic_shapes) -> list[dict[str, Any]]:
    """Name, dtype and shape of every input; a dynamic dimension is given by its name."""
    from specc.passes.signature import placeholders

    out = []
    for n, a, dyn in zip(placeholders(gm), args, dynamic_shapes):
        shape = [dyn[i].__name__ if dyn and i in dyn else s for i, s in enumerate(a.shape)]
        out.append({"name": n, "shape": shape, "dtype": str(a.dtype).removeprefix("torch.")})
    return out


def _constants(gm) -> dict[str, torch.Tensor]:
    return {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}


def _save_weights(constants: dict[str, torch.Tensor], path: Path) -> dict[str, str]:
    """Write each distinct tensor once; returns ``{constant name: stored name}`` (tied
    weights such as a shared embedding / lm_head map to one stored tensor)."""
    from safetensors.torch import save_file

    stored: dict[str, str] = {}
    by_storage: dict[tuple, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(constants):
        t = constants[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in by_storage:
            stored[name] = by_storage[key]
            continue
        by_storage[key] = stored[name] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(path))
    return stored


def _progress(items, enabled: bool):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, unit="program", file=sys.stderr, disable=not sys.stderr.isatty())
