"""The names the store, the scheduler, the metrics and the docs share: checkpoint kinds and the
reasons a lookup restores nothing.

Contract: both are ``StrEnum``s, so a member is its value wherever a string is expected (dict keys,
``%s`` and f-strings, comparisons). The values are the counters' names (``hit_<kind>``,
``miss_<reason>``), the Prometheus label values (``kind``, ``reason``) and the words of the docs:
never rename one. Imports nothing.
"""

from __future__ import annotations

from enum import StrEnum


class CheckpointKind(StrEnum):
    """What boundary a bundle holds the state at."""

    PROMPT = "prompt"  # after ``P - 1`` prompt tokens: an exact resend computes one token
    RESPONSE = "response"  # after a finished response: the next turn of the conversation
    INSTRUCTION = "instruction"  # at a request's instruction boundary (core/instruction.py): lasting


class MissReason(StrEnum):
    """Why an eligible lookup restored no checkpoint (or why a lookup was not eligible)."""

    NO_CHECKPOINT = "no_checkpoint"  # nothing retained shares the prompt's prefix
    DIVERGED = "diverged"  # a retained bundle shares a prefix but parts before its own end
    EVICTED = "evicted"  # a bundle evicted earlier would have served it (a regret, core/reuse.py)
    BLOCK_GRID_AS_LONG = "block_grid_as_long"  # vLLM's own block-grid hit is as long as any bundle
    INELIGIBLE = "ineligible"  # the request cannot restore (core/chunk_stops.py: request_is_eligible)
    CACHE_BYPASSED = "cache_bypassed"  # the request skips the prefix cache
    DRAFT_NEXT_TOKEN = "draft_next_token"  # a bundle's MTP draft row was computed from another next token
    SHORT_ROW = "short_row"  # a bundle would leave a prefill row as short as a verify row (contract 13)
    WITHIN_A_POOL = "within_a_pool"  # off the indexer's pool grid, less than a pool past vLLM's hit (contract 11)
    UNKNOWN = "unknown"  # a miss recorded without a reason
