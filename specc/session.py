"""`Session`: the Python runtime users call (`Session(config).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from specc.artifact import ArtifactError
from specc.config import ConfigError, SpeccConfig, load_config
from specc.outputs import RequestMetrics, RequestOutput, SpecMetrics
from specc.runtime.replay import cache_slots
from specc.sampling_params import SamplingParams

Prompt = str | list[dict] | list[int]


class Session:
    """Loads a target (and drafter) from a config or a compiled artifact and generates text.

    Three ways in: an artifact folder written by ``specc compile`` (opened without
    tracing or compiling; refused when stale or truncated, see :mod:`specc.artifact`);
    a config with ``enforce_eager: false`` (the default), compiled on first use into
    specc's cache (``$SPECC_CACHE_DIR/compiled/<key>``) and opened from there afterwards;
    a config with ``enforce_eager: true``, run on the eager reference path.

    Args:
        config: an artifact folder, a ``model.yaml`` path, a dict with the same fields,
            or a :class:`specc.config.SpeccConfig`.
        proposer: a custom :class:`specc.runtime.drafters.base.Proposer` used instead of
            the config's ``speculative_config`` (research and tests: oracle, scripted or
            adversarial drafters).
        verbose: print one-line progress messages (loading, conversion) to stderr.

    Raises:
        specc.config.ConfigError: the config is invalid or names weights that cannot load.
        specc.artifact.ArtifactError: the artifact is truncated, or stale (built with
            another torch / transformers, for another device kind, config or weights).

    Attributes:
        metrics: :class:`specc.outputs.SpecMetrics` summed over every request so far.
    """

    def __init__(
        self,
        config: str | os.PathLike | dict | SpeccConfig,
        *,
        proposer=None,
        verbose: bool = True,
    ):
        from specc.runtime.drafters.factory import build_proposer

        t0 = time.perf_counter()
        label = str(config) if isinstance(config, (str, os.PathLike)) else None
        if label is not None and Path(label).expanduser().is_dir():
            self._open_compiled(Path(label).expanduser(), verbose)  # an artifact folder
        else:
            self.config = load_config(config)
            _check_device(self.config.device, label)
            if self.config.enforce_eager:
                self.target = self._load_target(label)
                self.programs = None
            else:
                self._open_compiled(self._compiled_artifact(label, verbose), verbose, self.config)
        cfg = self.config
        self.tokenizer = self.target.tokenizer
        mc = self.target.config
        if cfg.max_model_len > mc.max_position_embeddings:
            raise ConfigError(
                f"max_model_len = {cfg.max_model_len} exceeds the target's max_position_embeddings = "
                f"{mc.max_position_embeddings} (positions it was trained for); lower max_model_len", label,
            )
        slots = cfg.max_num_seqs if self.programs is None else cache_slots(cfg.max_num_seqs, cfg.batch_buckets)
        self.kv_cache = self._allocate_cache(slots, label)
        # an EAGLE artifact's head state (its programs read and write it like the KV cache)
        self.draft_state = self.programs.draft_state(slots, cfg.device) if self.programs is not None else None
        try:
            self.proposer = proposer if proposer is not None else build_proposer(
                cfg, self.target, self.kv_cache,
                drafts_in_graph=self.programs is not None and self.programs.drafts_in_graph,
                program_state=self.draft_state)
        except ConfigError as e:
            if label is None or e.source is not None:
                raise
            raise ConfigError(e.errors, label) from e  # prefix the file name, as load_config does
        except (FileNotFoundError, ValueError) as e:  # a drafter that cannot load
            raise ConfigError(f"speculative_config.model = {cfg.speculative_config.model!r}: {e}", label) from e
        self.engine = self._engine(self.proposer)
        self.baseline_engine = self._engine(None) if self.proposer else self.engine
        self.eos_token_ids = self._eos_ids()
        self.metrics = SpecMetrics()
        self._seeds = itertools.count(cfg.seed * 1_000_003 + 1)
        self._ids = itertools.count()
        if verbose:
            mode = "eager" if self.programs is None else f"compiled, {len(self.artifact.programs)} programs"
            print(f"specc: loaded {cfg.target} ({mode}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    @property
    def compiled(self) -> bool:
        """True when the steps replay compiled programs (an artifact), False on the eager path."""
        return self.programs is not None

    # -- public --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool | None = None,
        on_text: Callable[[int, str], None] | None = None,
        use_speculation: bool = True,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt; requests run batched.

        Args:
            prompts: a string, a chat conversation (``[{"role": ..., "content": ...}]``), a
                list of token ids, or a list mixing those. Conversations get the
                tokenizer's chat template (with the generation prompt).
            params: one :class:`SamplingParams` for all, one per prompt, or None for the
                config's ``sampling`` defaults.
            chat: apply the chat template to string prompts too (``specc generate --chat``).
            on_text: streaming callback ``(prompt_index, new_text)``; never receives text past
                a stop string or end token.
            use_speculation: False runs plain one-token decoding with the same weights, cache
                and sampling code: the baseline every speed-up is measured against.

        Returns:
            one :class:`RequestOutput` per prompt, in order. A bad request (empty prompt,
            prompt not shorter than ``max_model_len``, token ids outside the vocabulary,
            a malformed prompt or conversation, invalid sampling values) gets
            ``finish_reason="error"`` and a message in ``error``; the others run normally.
        """
        items = _as_prompt_list(prompts)
        plist = self._params_list(params, len(items))
        outputs: list[RequestOutput | None] = [None] * len(items)
        live, index_of = [], {}
        for i, (prompt, p) in enumerate(zip(items, plist)):
            try:
                req = self._make_request(prompt, p, chat)
            except (ValueError, TypeError) as e:
                outputs[i] = RequestOutput(next(self._ids), prompt, [], "", [], "error", error=str(e))
                continue
            index_of[req.request_id] = i
            live.append(req)

        def stream(reqs):
            for r in reqs:
                delta = r.stream_delta()
                if delta:
                    on_text(index_of[r.request_id], delta)

        engine = self.engine if use_speculation else self.baseline_engine
        engine.run(live, on_step=stream if on_text else None)
        for req in live:
            if use_speculation:
                self.metrics.add(req.metrics.spec)
            outputs[index_of[req.request_id]] = RequestOutput(
                request_id=req.request_id,
                prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids,
                text=req.text,
                token_ids=req.output_token_ids,
                finish_reason=req.finish_reason,
                logprobs=req.logprobs,
                metrics=req.metrics,
                stop_reason=req.stop_reason,
            )
        return outputs  # type: ignore[return-value]

    def tokenize(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids the session feeds for ``prompt`` (chat template for conversations)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and not chat:
            return self.tokenizer.encode(prompt)
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
            raise TypeError(
                "a prompt must be a string, a chat conversation (list of {'role', 'content'} "
                f"dicts) or a list of token ids (ints); got {_describe(prompt)}"
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors on malformed messages: a per-request error
            raise ValueError(
                f"chat template failed on the conversation ({type(e).__name__}: {e}); each "
                "message needs 'role' and 'content'"
            ) from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- internals -----------------------------------------------------------------------
    def _load_target(self, label):
        from specc.models.loader import load_model

        cfg = self.config
        try:
            return load_model(cfg.target, dtype=cfg.torch_dtype, device=cfg.device)
        except ConfigError:
            raise
        except (FileNotFoundError, ValueError) as e:  # a target that cannot load
            raise ConfigError(f"target = {cfg.target!r}: {e}", label) from e

    def _compiled_artifact(self, label, verbose: bool) -> Path:
        """The artifact for this config in specc's compile cache, built on first use."""
        from specc.artifact import compiled_cache_key, model_files_hash, open_artifact
        from specc.compiler import check_compilable, compile_artifact, plan_programs
        from specc.models.gguf_cache import cache_dir
        from specc.models.loader import resolve_hf_folder, weights_hash

        cfg = self.config
        check_compilable(cfg, label)
        try:
            folder = resolve_hf_folder(cfg.target)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"target = {cfg.target!r}: {e}", label) from e
        path = cache_dir() / "compiled" / compiled_cache_key(cfg.to_dict(), weights_hash(folder),
                                                              model_files_hash(folder), self._draft_hash(label))
        if (path / "manifest.json").is_file():
            try:
                open_artifact(path)
                return path
            except ArtifactError as e:  # a damaged cache entry is rebuilt, not a dead end
                if verbose:
                    print(f"specc: cached artifact unusable, rebuilding it ({str(e).splitlines()[0]})",
                          file=sys.stderr)
        if verbose:
            print(f"specc: first use of this config: compiling {len(plan_programs(cfg))} programs into "
                  f"{path} (minutes on a small CPU; `enforce_eager: true` skips compilation)", file=sys.stderr)
        compile_artifact(cfg, path, progress=verbose, target=self._load_target(label))
        return path

    def _draft_hash(self, label) -> str | None:
        """:func:`specc.artifact.draft_hash` of the config's EAGLE head (None for other methods)."""
        from specc.artifact import draft_hash
        from specc.compiler import EAGLE_METHODS

        spec = self.config.speculative_config
        if spec is None or spec.method not in EAGLE_METHODS:
            return None
        try:
            return draft_hash(spec.model)
        except FileNotFoundError as e:
            raise ConfigError(f"speculative_config.model = {spec.model!r}: EAGLE head {e}", label) from e

    def _open_compiled(self, path: Path, verbose: bool, config: SpeccConfig | None = None) -> None:
        """Open an artifact (checked: see specc.artifact) and load its programs."""
        from transformers import AutoConfig, AutoTokenizer

        from specc.artifact import MODEL_DIR, model_files_hash, open_artifact, program_config_diff
        from specc.models.llama import ModelConfig
        from specc.models.loader import LoadedModel, weights_hash
        from specc.runtime.replay import ProgramSet

        art = open_artifact(path)
        if config is not None:
            diff = program_config_diff(art.config, config.to_dict())
            if diff:
                raise ArtifactError([f"{path}: built for another config: {d}" for d in diff] + [art.rebuild_hint()])
        self.config = config if config is not None else load_config(art.config)
        self._check_draft(art, config is not None)
        source = Path(art.manifest["source"]["target_folder"])
        if source.is_dir():  # the source is still here: it must be what the artifact was built from
            for what, now, built in (("weights", weights_hash(source), art.manifest["weights_hash"]),
                                     ("config / tokenizer files", model_files_hash(source),
                                      art.manifest.get("model_hash"))):
                if now != built:
                    raise ArtifactError(f"{path}: the target's {what} in {source} changed since the artifact "
                                        f"was built (sha256 {now[:12]}, built from {str(built)[:12]}); "
                                        f"{art.rebuild_hint()}")
        hf_config = AutoConfig.from_pretrained(art.path(MODEL_DIR))
        self.artifact = art
        self.programs = ProgramSet(art, self.config.device)
        self.target = LoadedModel(model=None, tokenizer=AutoTokenizer.from_pretrained(art.path(MODEL_DIR)),
                                  config=ModelConfig.from_hf(hf_config), hf_config=hf_config, folder=source,
                                  weights_hash=art.manifest["weights_hash"])

    def _check_draft(self, art, from_config: bool) -> None:
        """ArtifactError when the EAGLE head compiled into ``art`` is not the config's
        (opened for a config) or changed in its folder since (opened as a folder, the
        folder still there)."""
        from specc.artifact import draft_hash

        built = art.manifest.get("draft_hash")
        if built is None:
            return
        folder = Path(self.config.speculative_config.model if from_config else art.manifest["draft_folder"])
        if not from_config and not folder.expanduser().is_dir():
            return  # the head's folder is gone: the artifact holds its weights
        try:
            now = draft_hash(folder)
        except FileNotFoundError as e:
            raise ArtifactError(f"{art.root}: EAGLE head {e}; {art.rebuild_hint()}") from e
        if now != built:
            raise ArtifactError(f"{art.root}: built with another EAGLE head than {folder} (sha256 {now[:12]}, "
                                f"built from {built[:12]}); {art.rebuild_hint()}")

    def _allocate_cache(self, num_slots: int, label):
        from specc.models.kv_cache import KVCache

        cfg, mc = self.config, self.target.config
        try:
            return KVCache(mc.num_hidden_layers, num_slots, mc.num_key_value_heads,
                           cfg.max_model_len, mc.head_dim, cfg.torch_dtype, cfg.device)
        except RuntimeError as e:  # torch's allocator: not enough memory for the preallocated cache
            need = (2 * mc.num_hidden_layers * num_slots * mc.num_key_value_heads * (cfg.max_model_len + 1)
                    * mc.head_dim * torch.empty((), dtype=cfg.torch_dtype).element_size())
            raise ConfigError(
                f"max_model_len = {cfg.max_model_len}, max_num_seqs = {cfg.max_num_seqs}: the KV cache "
                f"({need / 2**30:.1f} GiB, preallocated for max_num_seqs x max_model_len) cannot be allocated on "
                f"{cfg.device}; lower max_model_len or max_num_seqs ({str(e).splitlines()[0][:200]})", label,
            ) from e

    def _engine(self, proposer):
        from specc.runtime.engine import Engine
        from specc.runtime.replay import CompiledEngine

        n = self.config.max_num_seqs
        if self.programs is None:
            return Engine(self.target.model, self.kv_cache, self._detokenize, proposer, max_num_seqs=n)
        return CompiledEngine(self.programs, self.kv_cache, self._detokenize, proposer, max_num_seqs=n,
                              draft_state=self.draft_state)

    def _make_request(self, prompt: Prompt, params: SamplingParams, chat: bool | None):
        from specc.runtime.request import Request

        params.validate()
        ids = self.tokenize(prompt, chat)
        limit = self.config.max_model_len
        if not ids:
            raise ValueError("prompt is empty: give at least one token of prompt")
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {limit}: shorten the "
                "prompt or raise max_model_len in the config"
            )
        vocab = self.target.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is out of range"
                + (f" ({len(bad)} such ids)" if len(bad) > 1 else "")
                + f": token ids must lie in [0, {vocab}) (the model's vocab_size)"
            )
        seed = params.seed if params.seed is not None else next(self._seeds)
        return Request(
            request_id=next(self._ids),
            prompt=prompt,
            prompt_token_ids=ids,
            params=params,
            # torch seeds are 64-bit and wrap negatives mod 2**64; any Python int works the same way
            generator=torch.Generator().manual_seed(seed % 2**64),
            eos_token_ids=self.eos_token_ids,
            max_model_len=limit,
            metrics=RequestMetrics(num_prompt_tokens=len(ids)),
        )

    def _params_list(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams.from_defaults(self.config.sampling) for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
        return params

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for v in (self.tokenizer.eos_token_id, getattr(self.target.hf_config, "eos_token_id", None)):
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        return frozenset(ids)


def _as_prompt_list(prompts) -> list[Prompt]:
    """Normalise the accepted prompt forms into a list of single prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts]  # one conversation
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one tokenized prompt
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(
        "prompts must be a string, a chat conversation (list of {'role', 'content'} dicts), "
        f"a list of token ids, or a list of those; got {type(prompts).__name__}"
    )


def _describe(x) -> str:
    """Short type description for error messages (``list containing int and str``)."""
    if isinstance(x, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in x})
        return f"{type(x).__name__} containing {' and '.join(kinds)}" if kinds else f"empty {type(x).__name__}"
    return type(x).__name__


def _check_device(device: str, label: str | None) -> None:
    """ConfigError when the configured device is not usable in this process."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = 'cuda': no CUDA device is available (torch.cuda.is_available() is False)", label)
    if device == "npu":
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise ConfigError("device = 'npu': no Ascend NPU is available (is torch_npu installed and imported?)", label)
