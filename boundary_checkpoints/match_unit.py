"""The prefix match unit the plugin gives vLLM: the indexer's pool, where that makes prompts free.

Contract
--------
A pooled sparse-attention indexer (GLM-5.3-Flash, ``index_kpool``) under speculative decoding keeps
every checkpoint on its pool grid (``docs/design.md`` contract 13), so the plugin would stop every
prompt at a pool boundary below ``P - 1``: one more engine step per prompt. Where every recurrent
layer saves a state inside the prefill chunk (``prefill_checkpoint_alignment``: 16 for FlashKDA)
and vLLM's prefix match unit is a multiple of the pool finer than the block, vLLM's own cache keeps
each prompt's state at its last unit boundary below the end, and the plugin takes no prompt
checkpoint (``prompt_capture.on_pool_grid``). vLLM saves it inside the prompt's last step where
that step crosses a block boundary (``is_mamba_prefill_checkpoint_valid``): such prompts run no
extra step. Elsewhere (a prompt within one block, a next turn that ends in the block it resumes
in) vLLM splits the step there itself, the step the plugin's stop would add: never more steps.

:func:`choose` is a pure function of :class:`UnitFacts` (the worker reads them from the engine's
config and, through ``compat.kv_spec_unit_facts``, its layers' KV cache specs). :func:`apply` sets the chosen unit on
``cache_config.prefix_match_unit`` when the plugin's ``prefix_match_unit`` setting is ``auto`` and
the user gave none, and returns the startup line's phrase. Under ``policy: auto`` it chooses one
only for the pairs ``support.MATCH_UNIT_SPECULATIVE`` lists; an explicit ``request_boundaries``
chooses it wherever the kernels allow. The worker calls it once the specs exist and before vLLM
resolves its hash block (``worker/unit_choice.py``). A unit the user gave
(``--prefix-match-unit``), or ``prefix_match_unit: vllm``, is never changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

AUTO = "auto"
VLLM = "vllm"
MATCH_UNITS = (AUTO, VLLM)
CHOSEN = (
    "prefix match unit {unit} tokens (the indexer's pool of {pool}, recurrent states saved inside the "
    "prefill chunk every {alignment}): vLLM keeps each prompt's state on the pool grid, in the prompt's "
    "last step where that step crosses a block boundary, else by a split of its own where the plugin "
    "would stop (prefix_match_unit: vllm keeps vLLM's own)"
)


@dataclass(frozen=True)
class UnitFacts:
    """What the choice depends on: the indexer's ``pool`` (0: none), whether a drafter runs and
    prefix caching is on, each recurrent spec's in-chunk alignment (None: it saves no state inside
    the chunk), each prefix-cacheable spec's block size and tokens per state, and the blocks of
    those vLLM finds hits in by whole blocks only (a drafter's sliding window)."""

    pool: int
    speculative: bool
    prefix_caching: bool
    recurrent_alignments: tuple[int | None, ...]
    block_sizes: tuple[int, ...]
    tokens_per_state: tuple[int, ...] = ()
    whole_block_lookups: tuple[int, ...] = ()  # blocks of specs vLLM finds hits in by whole blocks only
    shortest_prefill_row: int = 1  # a prefill row of fewer tokens counts as a decode (1 + k + 1: contract 13)
    engine_reads_config: bool = True  # the engine core resolves its hash block from this config
    validated: bool = True  # the policy may choose it (``support.MATCH_UNIT_SPECULATIVE``, or named)


@dataclass(frozen=True)
class MatchUnitChoice:
    """``unit``: the prefix match unit to give vLLM (0: leave its own); ``why``: the startup line's
    phrase when one is chosen, else why none is."""

    unit: int
    why: str


def choose(facts: UnitFacts) -> MatchUnitChoice:
    """The least common multiple of the pool and the recurrent layers' in-chunk alignments, where
    it is finer than every prefix-cacheable block and divides it, every spec's tokens per state
    divides it, it is longer than a verify row (so no row vLLM runs from a hit or to a state on it
    is as short as one), and every group finds hits between blocks; else 0 and why not."""
    if not facts.pool:
        return MatchUnitChoice(0, "no pooled indexer")
    if not facts.speculative:
        return MatchUnitChoice(0, "no speculative decoding (the prompt checkpoint at P costs no step)")
    if not facts.prefix_caching:
        return MatchUnitChoice(0, "prefix caching is off")
    if not facts.validated:
        return MatchUnitChoice(0, "not validated on a GPU under policy auto (request_boundaries chooses it)")
    if not facts.engine_reads_config:
        return MatchUnitChoice(0, "the engine core does not read the worker's config (not the uni executor)")
    alignments = facts.recurrent_alignments
    if not alignments or None in alignments:
        return MatchUnitChoice(0, "a recurrent kernel saves no state inside the prefill chunk (FlashKDA does)")
    alignment = math.lcm(*(int(a) for a in alignments))
    unit = math.lcm(facts.pool, alignment)
    if not facts.block_sizes or any(block <= unit or block % unit for block in facts.block_sizes):
        return MatchUnitChoice(0, f"a unit of {unit} tokens does not divide every block ({facts.block_sizes}) finer")
    if unit < facts.shortest_prefill_row:
        return MatchUnitChoice(0, f"a unit of {unit} tokens is no longer than a verify row")
    if any(unit % tokens for tokens in facts.tokens_per_state):
        return MatchUnitChoice(0, f"a unit of {unit} tokens is off a compressed state's grid")
    if any(block != unit for block in facts.whole_block_lookups):
        return MatchUnitChoice(
            0, f"a layer group ({facts.whole_block_lookups}-token blocks, such as a drafter's sliding window) "
            "finds hits only by whole blocks, so vLLM would keep no state between blocks",
        )  # fmt: skip
    return MatchUnitChoice(unit, CHOSEN.format(unit=unit, pool=facts.pool, alignment=alignment))


def apply(cache_config: Any, setting: str, facts: UnitFacts) -> str:
    """Set ``cache_config.prefix_match_unit`` per :func:`choose` where the plugin may (``setting``
    ``auto`` and no unit given); returns the startup line's phrase ("" when vLLM's unit stays)."""
    if setting != AUTO or cache_config.prefix_match_unit is not None:
        return ""
    choice = choose(facts)
    if not choice.unit:
        return ""
    cache_config.prefix_match_unit = choice.unit
    return choice.why
