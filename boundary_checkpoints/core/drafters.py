"""What a speculative drafter's K/V rows below a boundary depend on (docs/notes/spec-decode.md §1.5, §11).

Contract
--------
``reads_next_token(speculative_config)`` is True when the drafter's K/V row ``N - 1`` is computed
from token ``N`` as well as from the prefix: single-module MTP feeds the target's hidden state at a
row together with the *next* token (its input is shifted by one), so a bundle at ``N`` serves only
prefixes whose token ``N`` is the one it was computed with (the next-token guard,
``core/store.py``: ``Checkpoint.next_token``). DFlash and DFlash2 project each context row from the
target's hidden states at that row alone, so their rows below ``N`` depend on the first ``N``
tokens only: no guard, and a next turn whose token ``N`` differs restores the whole boundary.
Without speculative decoding there are no draft rows: False. A method not listed here is refused by
the gate (``gate.speculative_reasons``) before any scheduler asks.
"""

from __future__ import annotations

from typing import Any

NEXT_TOKEN_METHODS = frozenset({"mtp"})  # draft row r is f(hidden state at r, token r + 1)


def reads_next_token(speculative_config: Any) -> bool:
    """True if the drafter's row ``N - 1`` depends on token ``N`` (module docstring)."""
    return getattr(speculative_config, "method", None) in NEXT_TOKEN_METHODS
