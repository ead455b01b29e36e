"""Build the proposer that ``speculative_config`` asks for."""

from __future__ import annotations

from specc.config import ConfigError, SpeccConfig
from specc.models.kv_cache import KVCache
from specc.models.loader import LoadedModel, load_model
from specc.runtime.drafters.base import Proposer


def build_proposer(config: SpeccConfig, target: LoadedModel, target_cache: KVCache, *,
                   drafts_in_graph: bool = False, program_state=None) -> Proposer | None:
    """Return the drafter for ``config.speculative_config`` (None: no speculation).

    ``drafts_in_graph``: the session replays compiled programs whose ``spec_step`` drafts
    itself (early exit, EAGLE): the proposer is then the
    :class:`~specc.runtime.drafters.in_graph.InGraphDrafter` stand-in, which owns
    ``program_state`` (the EAGLE programs' head state,
    :meth:`specc.runtime.replay.ProgramSet.draft_state`).

    Raises:
        ConfigError: the drafter does not fit the target (too many early-exit layers, a
            draft model whose tokenizer differs from the target's).
        FileNotFoundError, ValueError: a drafter or EAGLE head that cannot load (the
            session reports them against ``speculative_config.model``).
    """
    spec = config.speculative_config
    if spec is None:
        return None
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        from specc.runtime.drafters.ngram import NgramDrafter

        return NgramDrafter(k, spec.prompt_lookup_min, spec.prompt_lookup_max, propose_tree=spec.ngram_propose_tree)
    if spec.method == "suffix":
        from specc.runtime.drafters.suffix import SuffixDrafter

        return SuffixDrafter(
            k, spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
            propose_tree=spec.suffix_decoding_propose_tree,
        )
    if spec.method == "draft_model":
        from specc.runtime.drafters.draft_model import DraftModelProposer

        if spec.num_draft_layers is not None:
            spec.check_against_target(target.config.num_hidden_layers)
            if drafts_in_graph:
                from specc.runtime.drafters.in_graph import InGraphDrafter

                return InGraphDrafter(k, spec.num_draft_layers)
            return DraftModelProposer(
                target.model, k, target_cache, target.config.vocab_size,
                num_layers=spec.num_draft_layers, shares_target_cache=True,
            )
        drafter = load_model(spec.model, dtype=config.torch_dtype, device=config.device)
        _check_same_tokenizer(target, drafter, spec.model)
        c = drafter.config
        cache = KVCache(
            c.num_hidden_layers, target_cache.num_slots, c.num_key_value_heads,
            target_cache.max_model_len, c.head_dim, config.torch_dtype, config.device,
        )
        return DraftModelProposer(drafter.model, k, cache, target.config.vocab_size)
    if spec.method in ("eagle", "eagle3"):
        if drafts_in_graph:
            if spec.tree_field is not None:
                raise ConfigError(f"speculative_config.{spec.tree_field}: EAGLE token trees run on the eager "
                                  "path only; set enforce_eager: true")
            from specc.runtime.drafters.in_graph import InGraphDrafter

            return InGraphDrafter(k, state=program_state)
        from specc.models.eagle_checkpoint import load_eagle_head
        from specc.runtime.drafters.eagle import EagleProposer

        head = load_eagle_head(spec.model, target.model, method=spec.method,
                               layer_ids=spec.eagle_aux_hidden_state_layer_ids)
        return EagleProposer(head, k, target_cache.num_slots, target_cache.max_model_len, tree=spec.token_tree,
                             dynamic_tree=spec.eagle_dynamic_tree)
    raise ConfigError(f"speculative_config.method = {spec.method!r} is not implemented yet")


def _check_same_tokenizer(target: LoadedModel, drafter: LoadedModel, name: str) -> None:
    a, b = target.tokenizer, drafter.tokenizer
    probe = "Hello, world! 123 héllo\n  def f(x):"
    if a.encode(probe) != b.encode(probe) or a.eos_token_id != b.eos_token_id:
        raise ConfigError(
            f"speculative_config.model = {name!r}: its tokenizer differs from the target's; "
            "method 'draft_model' needs the same tokenizer (pick a drafter of the same family)"
        )
