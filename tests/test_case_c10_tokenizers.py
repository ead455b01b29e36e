"""C10: different tokenizers (../shared/cases/correctness.md).

Drafter and target with different tokenizers (e.g. byte-level vs word-level over the
same text), so the drafter's sequence is longer or shorter than the target's. Prompts of
1, 7 and 50 words, k=4, greedy. To check: no crash; output equals target-only greedy;
every drafter-side tensor is sized from the drafter's own sequence.

Not implemented yet: ``method: draft_model`` requires the target's tokenizer
(``runtime/drafters/factory.py`` raises ConfigError otherwise). Drafting with a different
tokenizer (text re-tokenization, ``use_heterogeneous_vocab`` in ../shared/DESIGN.md) is
future work; this case gets its tests with it.
"""

from __future__ import annotations

import pytest


@pytest.mark.skip(reason="different-tokenizer drafting is not implemented yet "
                         "(future work: use_heterogeneous_vocab, see ../shared/DESIGN.md)")
def test_different_tokenizers_match_target_greedy():
    """Drafter with another tokenizer, prompts of 1/7/50 words, k=4, greedy: no crash, output
    == target-only greedy, drafter tensors sized from the drafter's own sequence."""
