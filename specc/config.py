"""The ``model.yaml`` schema: :class:`SpeccConfig` and :func:`load_config`.

A config names the target model, the device/dtype it runs in, the batch buckets the
programs are built for, the optional speculative-decoding method (field names follow
vLLM's ``speculative_config``) and the default sampling parameters of the CLI.

Every model forbids unknown fields. Validation problems are reported as a
:class:`ConfigError` with one line per problem, each naming the field path, the value
given and what is allowed, e.g.::

    model.yaml: speculative_config.num_speculative_tokens = -1: must be >= 1

See ``docs/config.md`` for the reference of every field.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union, get_args, get_origin

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "ConfigError",
    "SPECULATIVE_METHODS",
    "SUFFIX_DEFAULTS",
    "SamplingDefaults",
    "SpeccConfig",
    "SpeculativeConfig",
    "load_config",
]


class ConfigError(ValueError):
    """An invalid ``model.yaml`` / config dict.

    ``str(err)`` is one line per problem; the lines are also in ``err.errors`` and the
    file (or ``None`` for a dict) in ``err.source``.
    """

    def __init__(self, errors: str | list[str], source: str | None = None):
        lines = [errors] if isinstance(errors, str) else list(errors)
        if source:
            lines = [f"{source}: {line}" for line in lines]
        self.errors: list[str] = lines
        self.source = source
        super().__init__("\n".join(lines))


class _FieldError(ValueError):
    """Raised inside model validators to attach a field name (and value) to an error,
    so the :class:`ConfigError` line names e.g. ``speculative_config.model``."""

    _NO_VALUE = object()

    def __init__(self, field: str | None, message: str, value: Any = _NO_VALUE):
        super().__init__(message)
        self.field = field
        self.value = value


def _reject_bool(v: Any) -> Any:
    # pydantic's lax mode turns True/False into 1/0 for int fields; a YAML `yes` in an
    # int field is almost certainly a mistake.
    if isinstance(v, bool):
        raise ValueError("must be an integer, not a boolean")
    return v


Int = Annotated[int, BeforeValidator(_reject_bool)]

# ---------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------

# Method registry: method name -> the method-specific fields it accepts. Every field in
# the union of these sets may only be set (non-null) for a method that lists it. Adding
# a method (suffix, eagle, eagle3, mtp, ...) is one line here, plus any extra rule in
# SpeculativeConfig._check_method_rules if it has required fields.
_METHOD_FIELDS: dict[str, frozenset[str]] = {
    "ngram": frozenset({"prompt_lookup_min", "prompt_lookup_max", "ngram_propose_tree"}),
    "draft_model": frozenset({"model", "num_draft_layers"}),
    "suffix": frozenset({
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
        "suffix_decoding_propose_tree",
    }),
    "eagle": frozenset({"model", "speculative_token_tree", "eagle_dynamic_tree"}),
    "eagle3": frozenset({"model", "eagle_aux_hidden_state_layer_ids", "speculative_token_tree", "eagle_dynamic_tree"}),
}
# specc's own switches (vLLM has none) that make a host drafter propose token trees,
# verified on the eager path only
_TREE_SWITCHES = ("ngram_propose_tree", "suffix_decoding_propose_tree")
# methods whose `model` is a head folder (config.json + model.safetensors), required
_HEAD_METHODS = {"eagle": "an EAGLE head", "eagle3": "an EAGLE-3 head"}
SPECULATIVE_METHODS: tuple[str, ...] = tuple(_METHOD_FIELDS)
SpeculativeMethod = Literal[SPECULATIVE_METHODS]  # type: ignore[valid-type]

# vLLM's defaults for prompt lookup when neither bound is given (vllm/config/speculative.py:
# "arbitrarily chosen"); when only one is given the other takes the same value.
DEFAULT_PROMPT_LOOKUP_MIN = 5
DEFAULT_PROMPT_LOOKUP_MAX = 5
MAX_SPECULATIVE_TOKENS = 16
# vLLM's / Arctic Inference's defaults for suffix decoding (vllm/config/speculative.py).
SUFFIX_DEFAULTS: dict[str, Any] = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
    # specc's own switch (vLLM / Arctic verify suffix drafts as chains): propose the
    # candidate tree, verified under the tree attention mask (compiled: tree_step programs)
    "suffix_decoding_propose_tree": False,
}


class DynamicTreeConfig(BaseModel):
    """``speculative_config.eagle_dynamic_tree`` (specc's): EAGLE-2's dynamic draft tree
    (Li et al. 2024): ``depth`` head steps, each expanding the ``topk`` best frontier
    nodes by cumulative probability into ``topk`` children each; the best
    ``num_speculative_tokens`` candidates form the tree."""

    model_config = ConfigDict(extra="forbid")

    depth: Int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    topk: Int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)

    @property
    def num_candidates(self) -> int:
        """Candidates the expansion proposes: ``topk + (depth - 1) * topk**2``."""
        return self.topk + (self.depth - 1) * self.topk ** 2


class SpeculativeConfig(BaseModel):
    """``speculative_config`` (vLLM names).

    * ``ngram``: prompt lookup; ``prompt_lookup_min``/``prompt_lookup_max`` bound the
      n-gram length matched against the context; ``ngram_propose_tree`` (specc's, default
      false) proposes the continuations of the n-gram's several earlier occurrences
      merged into one token tree instead of the most recent one's chain (compiled:
      ``tree_step`` programs).
    * ``draft_model``: an independent drafter (``model``: HF folder, ``.gguf`` or an
      embedded name), or an early-exit self-draft (``num_draft_layers: N``, ``model``
      omitted): the target's first N layers + its final norm + lm_head.
    * ``suffix``: SuffixDecoding (per-request and global suffix trees); the
      ``suffix_decoding_*`` fields take vLLM's defaults (:data:`SUFFIX_DEFAULTS`) when
      omitted; ``suffix_decoding_propose_tree`` (specc's, default false) proposes the
      candidate token tree instead of the best chain (compiled artifacts then hold
      ``tree_step`` programs).
    * ``eagle`` / ``eagle3``: a feature-level draft head (``model``: its folder, required);
      ``eagle_aux_hidden_state_layer_ids`` (eagle3, vLLM's name) overrides the target
      layers the head fuses (default: the head's config.json, else (2, L//2, L-3));
      ``speculative_token_tree`` (vLLM's name and format: child-rank paths, e.g.
      ``"[(0,), (1,), (0, 0)]"``) drafts that static token tree each step instead of a
      chain; ``num_speculative_tokens`` must equal its node count (taken from it when
      omitted). Eager path only (``enforce_eager: true``). ``eagle_dynamic_tree``
      (specc's, ``{depth, topk}``) drafts EAGLE-2's dynamic tree of
      ``num_speculative_tokens`` nodes instead (eager only).
    """

    model_config = ConfigDict(extra="forbid")

    method: SpeculativeMethod
    num_speculative_tokens: Int = Field(default=4, ge=1, le=MAX_SPECULATIVE_TOKENS)
    model: str | None = None
    num_draft_layers: Int | None = Field(default=None, ge=1)
    prompt_lookup_min: Int | None = Field(default=None, ge=1)
    prompt_lookup_max: Int | None = Field(default=None, ge=1)
    ngram_propose_tree: bool | None = None
    suffix_decoding_max_tree_depth: Int | None = Field(default=None, ge=1)
    suffix_decoding_max_cached_requests: Int | None = Field(default=None, ge=0)
    suffix_decoding_max_spec_factor: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    suffix_decoding_min_token_prob: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    suffix_decoding_propose_tree: bool | None = None
    eagle_aux_hidden_state_layer_ids: list[Int] | None = None
    speculative_token_tree: str | list[list[Int]] | None = None
    eagle_dynamic_tree: DynamicTreeConfig | None = None

    @field_validator("eagle_aux_hidden_state_layer_ids")
    @classmethod
    def _layer_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must list at least one target layer id (HF numbering: 0 = embeddings)")
        if any(i < 0 for i in v):
            raise ValueError("layer ids must be >= 0 (0 = embeddings, j = output of decoder layer j-1)")
        if len(set(v)) != len(v):
            raise ValueError("layer ids must be distinct")
        return v

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must be a non-empty path or model name")
        return v

    @model_validator(mode="after")
    def _check_method_rules(self) -> "SpeculativeConfig":
        allowed = _METHOD_FIELDS[self.method]
        method_specific = frozenset().union(*_METHOD_FIELDS.values())
        for name in sorted(method_specific - allowed):
            value = getattr(self, name)
            if value is not None:
                users = [m for m, fs in _METHOD_FIELDS.items() if name in fs]
                raise _FieldError(
                    name,
                    f"not allowed with method '{self.method}' "
                    f"(only with {', '.join(repr(m) for m in users)})",
                    value,
                )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            if hi < lo:  # type: ignore[operator]
                raise _FieldError(
                    "prompt_lookup_max",
                    f"must be >= prompt_lookup_min ({lo})",
                    hi,
                )
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
            if self.ngram_propose_tree is None:
                self.ngram_propose_tree = False
        elif self.method == "suffix":
            for name, default in SUFFIX_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)
        elif self.method in _HEAD_METHODS and self.model is None:
            raise _FieldError(
                "model",
                f"method '{self.method}' needs 'model': the folder of {_HEAD_METHODS[self.method]} "
                "(config.json + model.safetensors)",
            )
        if self.speculative_token_tree is not None:
            if self.eagle_dynamic_tree is not None:
                raise _FieldError("eagle_dynamic_tree", "set together with speculative_token_tree: a static or a "
                                  "dynamic tree, not both; drop one of them")
            self._check_token_tree()
        if self.eagle_dynamic_tree is not None and self.eagle_dynamic_tree.num_candidates < self.num_speculative_tokens:
            t = self.eagle_dynamic_tree
            raise _FieldError(
                "num_speculative_tokens",
                f"the dynamic tree (depth {t.depth}, topk {t.topk}) proposes {t.num_candidates} candidates, fewer "
                f"than the {self.num_speculative_tokens} tree nodes asked for; lower num_speculative_tokens or "
                "raise depth / topk", self.num_speculative_tokens)
        if self.method == "draft_model":
            if (self.model is None) == (self.num_draft_layers is None):
                both = self.model is not None
                raise _FieldError(
                    None,
                    "method 'draft_model' needs exactly one of 'model' (a separate "
                    "drafter) or 'num_draft_layers' (early-exit self-draft); "
                    + ("both were given" if both else "neither was given"),
                )
        return self

    def _check_token_tree(self) -> None:
        """Parse ``speculative_token_tree`` (vLLM's format) into its breadth-first list of
        paths, and make ``num_speculative_tokens`` its node count (as vLLM: taken from the
        tree when omitted, else they must agree). Raises :class:`_FieldError`."""
        from specc.runtime.token_tree import TokenTreeError, parse_choices

        try:
            paths = parse_choices(self.speculative_token_tree)  # type: ignore[arg-type]
        except TokenTreeError as e:
            raise _FieldError("speculative_token_tree", str(e), self.speculative_token_tree) from None
        self.speculative_token_tree = [list(p) for p in paths]
        n = len(paths)
        if n > MAX_SPECULATIVE_TOKENS:
            raise _FieldError("speculative_token_tree",
                              f"has {n} nodes; at most {MAX_SPECULATIVE_TOKENS} (num_speculative_tokens' limit)")
        if "num_speculative_tokens" not in self.model_fields_set:
            self.num_speculative_tokens = n
        elif self.num_speculative_tokens != n:
            raise _FieldError(
                "num_speculative_tokens",
                f"must equal the number of nodes of speculative_token_tree ({n}); set it to {n} or omit it",
                self.num_speculative_tokens)

    @property
    def token_tree(self):
        """The static :class:`~specc.runtime.token_tree.TokenTree` of
        ``speculative_token_tree``, or None (chain drafting)."""
        if self.speculative_token_tree is None:
            return None
        from specc.runtime.token_tree import TokenTree

        return TokenTree.from_choices([tuple(p) for p in self.speculative_token_tree])

    @property
    def tree_field(self) -> str | None:
        """The name of the set switch that makes this method propose token trees
        (``ngram_propose_tree``, ``suffix_decoding_propose_tree``,
        ``speculative_token_tree``, ``eagle_dynamic_tree``), else None."""
        for name in _TREE_SWITCHES:
            if getattr(self, name):
                return name
        for name in ("speculative_token_tree", "eagle_dynamic_tree"):
            if getattr(self, name) is not None:
                return name
        return None

    @property
    def is_early_exit(self) -> bool:
        """True for the early-exit self-draft (draft_model with ``num_draft_layers``)."""
        return self.method == "draft_model" and self.num_draft_layers is not None

    def check_against_target(self, num_target_layers: int) -> None:
        """Checks what needs the target model: an early-exit drafter must use fewer
        layers than the target has. Raises :class:`ConfigError`."""
        if self.is_early_exit:
            n = self.num_draft_layers
            assert n is not None
            if not 1 <= n < num_target_layers:
                raise ConfigError(
                    f"speculative_config.num_draft_layers = {n}: must be between 1 and "
                    f"{num_target_layers - 1} (the target has {num_target_layers} layers)"
                )


# ---------------------------------------------------------------------------------------
# Sampling defaults and the top-level config
# ---------------------------------------------------------------------------------------


class SamplingDefaults(BaseModel):
    """Default sampling parameters (used by the CLI and as the base of
    ``SamplingParams.from_defaults``). ``temperature: 0`` is greedy."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=-1)
    max_tokens: Int = Field(default=128, ge=1)
    seed: Int | None = None

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


DType = Literal["float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda", "npu"]


class SpeccConfig(BaseModel):
    """Top-level ``model.yaml``."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(validation_alias=AliasChoices("target", "model"))
    dtype: DType = "float32"
    device: Device = "cpu"
    max_model_len: Int = Field(default=2048, ge=16)
    max_num_seqs: Int = Field(default=8, ge=1)
    batch_buckets: list[Int] = Field(default_factory=lambda: [1, 2, 4, 8])
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    seed: Int = 0

    @model_validator(mode="before")
    @classmethod
    def _target_or_model(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "target" in data and "model" in data:
            raise _FieldError(
                "model",
                "give the target model either as 'target' or as its alias 'model', "
                "not both",
                data["model"],
            )
        return data

    @field_validator("target")
    @classmethod
    def _target_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty path or model name")
        return v

    @field_validator("batch_buckets")
    @classmethod
    def _check_buckets(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("must list at least one batch size")
        bad = [b for b in v if b < 1]
        if bad:
            raise ValueError(f"every bucket must be >= 1 (got {bad[0]})")
        for a, b in zip(v, v[1:]):
            if b <= a:
                raise ValueError(f"must be strictly increasing ({a} then {b})")
        return v

    @property
    def torch_dtype(self):
        """The ``torch.dtype`` for :attr:`dtype` (imports torch lazily)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def max_batch_bucket(self) -> int:
        """The largest bucket; a larger batch is split into several steps."""
        return self.batch_buckets[-1]

    def bucket_for(self, batch_size: int) -> int:
        """The smallest bucket that holds ``batch_size`` sequences; a batch larger than
        the largest bucket gets the largest bucket (the caller splits it)."""
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size}: must be >= 1")
        for b in self.batch_buckets:
            if b >= batch_size:
                return b
        return self.batch_buckets[-1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable dict (field names, not aliases), for manifests. Loading it
        back with :func:`load_config` gives an equal config."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | SpeccConfig,
    *,
    overrides: Mapping[str, Any] | None = None,
    base_dir: str | os.PathLike | None = None,
) -> SpeccConfig:
    """Load and validate a config.

    ``source`` is a path to a YAML file, a dict, or a :class:`SpeccConfig` (returned as
    is unless ``overrides`` are given). ``overrides`` maps dotted field paths to values
    (``{"speculative_config.num_speculative_tokens": 3}``) applied before validation.

    Relative ``target`` / ``speculative_config.model`` paths that exist relative to the
    YAML file's folder (or ``base_dir`` for a dict) are made absolute; anything else
    (embedded model names, paths relative to the working directory) is left unchanged.

    Raises :class:`ConfigError`.
    """
    label: str | None = None
    if isinstance(source, SpeccConfig):
        if not overrides:
            return source
        data: Any = source.to_dict()
    elif isinstance(source, Mapping):
        data = copy.deepcopy(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        label = str(source)
        data = _read_yaml(path, label)
        if base_dir is None:
            base_dir = path.resolve().parent
    else:
        raise ConfigError(
            f"cannot load a config from {type(source).__name__}: expected a YAML path, "
            "a dict or a SpeccConfig"
        )

    if not isinstance(data, dict):
        raise ConfigError(
            f"expected a mapping of fields at the top level, got {_type_name(data)}", label
        )
    if overrides:
        for key, value in overrides.items():
            _set_dotted(data, key, value, label)
    if base_dir is not None:
        _resolve_paths(data, Path(base_dir))

    try:
        return SpeccConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, data), label) from None


def _read_yaml(path: Path, label: str) -> Any:
    if not path.exists():
        raise ConfigError(f"config file not found ({path.resolve()})", label)
    if path.is_dir():
        raise ConfigError("is a directory, expected a YAML config file", label)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file: {exc}", label) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise ConfigError(f"{where}YAML syntax error: {detail}", label) from None
    if data is None:
        raise ConfigError("config file is empty", label)
    return data


def _set_dotted(data: dict, key: str, value: Any, label: str | None) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"override '{key}': '{'.'.join(parts[: i + 1])}' is not a mapping", label
            )
        node = child
    if parts[-1] == "target" and node is data:
        node.pop("model", None)
    elif parts[-1] == "model" and node is data:
        node.pop("target", None)
    node[parts[-1]] = value


def _resolve_path(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value.strip():
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p) if value.startswith("~") else value
    candidate = base / p
    if candidate.exists():
        return str(candidate.resolve())
    return value


def _resolve_paths(data: dict, base: Path) -> None:
    for key in ("target", "model"):
        if key in data:
            data[key] = _resolve_path(data[key], base)
    spec = data.get("speculative_config")
    if isinstance(spec, dict) and "model" in spec:
        spec["model"] = _resolve_path(spec["model"], base)


# ---------------------------------------------------------------------------------------
# ValidationError -> one line per error
# ---------------------------------------------------------------------------------------


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string"}.get(type(v), type(v).__name__)


def _fmt_value(v: Any) -> str:
    if isinstance(v, str):
        return repr(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _fmt_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _unwrap(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside ``X | None`` / ``Annotated[X, ...]``, else None."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _unwrap(get_args(annotation)[0])
    if origin is Union or isinstance(annotation, types.UnionType):
        for arg in get_args(annotation):
            found = _unwrap(arg)
            if found is not None:
                return found
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = SpeccConfig
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model


def _allowed_names(model: type[BaseModel]) -> list[str]:
    names: list[str] = []
    for name, info in model.model_fields.items():
        names.append(name)
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names.extend(a for a in alias.choices if isinstance(a, str) and a != name)
    return names


_MESSAGES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "model_type": "must be a mapping of fields",
    "model_attributes_type": "must be a mapping of fields",
    "dict_type": "must be a mapping",
}


def _format_errors(exc: ValidationError, data: Any) -> list[str]:
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        etype = err["type"]
        value = err.get("input")
        has_value = True
        ctx = err.get("ctx") or {}

        if etype == "extra_forbidden":
            parent, name = loc[:-1], loc[-1]
            model = _model_at(parent)
            allowed = _allowed_names(model) if model is not None else []
            msg = f"unknown field '{name}'"
            if allowed:
                msg += f" (allowed: {', '.join(allowed)})"
                close = difflib.get_close_matches(str(name), allowed, n=1)
                if close:
                    msg += f"; did you mean '{close[0]}'?"
            lines.append(f"{_fmt_loc(parent)}: {msg}" if parent else msg)
            continue

        if etype == "missing":
            model, name = _model_at(loc[:-1]), str(loc[-1])
            info = model.model_fields.get(name) if model is not None else None
            alias = info.validation_alias if info is not None else None
            others = []
            if isinstance(alias, AliasChoices):
                others = [a for a in alias.choices if isinstance(a, str) and a != name]
            msg = "required field missing"
            if others:
                msg += f" (or its alias {', '.join(repr(a) for a in others)})"
            lines.append(f"{_fmt_loc(loc)}: {msg}")
            continue

        if etype == "literal_error":
            expected = ctx.get("expected", "")
            what = "methods" if loc and loc[-1] == "method" else "values"
            msg = f"allowed {what}: {expected.replace(' or ', ', ')}"
        elif etype in ("value_error", "assertion_error"):
            inner = ctx.get("error")
            if isinstance(inner, _FieldError):
                if inner.field is not None:
                    loc = loc + (inner.field,)
                if inner.value is not _FieldError._NO_VALUE:
                    value = inner.value
                else:
                    has_value = False
                msg = str(inner)
            else:
                msg = str(inner) if inner is not None else err["msg"]
                if msg.startswith("Value error, "):
                    msg = msg[len("Value error, ") :]
        elif etype in _MESSAGES:
            msg = _MESSAGES[etype].format(**ctx)
        else:
            msg = err["msg"]

        # Model-level errors carry the whole mapping as input: don't print it.
        if isinstance(value, dict):
            has_value = False
        where = _fmt_loc(loc)
        if has_value:
            lines.append(f"{where} = {_fmt_value(value)}: {msg}" if where else msg)
        else:
            lines.append(f"{where}: {msg}" if where else msg)
    return lines
