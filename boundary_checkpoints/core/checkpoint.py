"""A retained bundle (:class:`Checkpoint`) and the store's counters (:class:`StoreCounters`).

Contract: a :class:`Checkpoint` lists, for every KV cache group, the blocks vLLM's KV cache manager
expects for a prefix hit of ``N`` tokens, plus the grid blocks it keeps alive beside them; it is
atomic (the store holds or drops it whole). :class:`StoreCounters` and :class:`ReportedGauges`
name every counter and gauge the plugin exports, with its help text: ``metrics.py`` builds its
tables from their fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from boundary_checkpoints.core.keys import CheckpointKey
from boundary_checkpoints.core.kinds import CheckpointKind, MissReason

INSTRUCTION = CheckpointKind.INSTRUCTION  # kind of a bundle at a request's instruction boundary
LASTING_KINDS = frozenset({INSTRUCTION})  # evicted after every other kind, never retired by lineage


class BlockLike(Protocol):
    block_id: int
    is_null: bool


@dataclass(eq=False)
class Checkpoint:
    key: CheckpointKey
    kind: CheckpointKind
    group_blocks: tuple[tuple[BlockLike, ...], ...]
    page_bytes: tuple[int, ...] = ()  # bytes of one block of each group, for accounting
    producer: str = ""  # id of the request that produced it
    owners: set[str] = field(default_factory=set)  # turns that keep it alive (lineage)
    published_at: int = 0  # publication count when retained (core/reuse.py); 0: not published yet
    next_token: int | None = None  # token N its draft rows depend on (None: no such dependence)
    # Evicted first and never protected (:meth:`CheckpointStore.demote`): a prompt bundle whose
    # request's response bundle is retained.
    demoted: bool = False
    # Per KV group, the blocks of vLLM's own block-grid hit below the boundary that the bundle does
    # not hold already (the recurrent states on the block grid): kept alive with the bundle and
    # released with it, so a request that loses the bundle still finds the hit stock would give.
    # Never restored from.
    grid_blocks: tuple[tuple[BlockLike, ...], ...] = ()
    # Retention ``borrow``: the blocks vLLM's prefix cache names (full pages, grid states), with the
    # hash each had at publication. The bundle holds no reference to them; it serves while every
    # one still carries that hash (:meth:`intact`).
    borrowed: tuple[tuple[BlockLike, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.producer:
            self.owners.add(self.producer)

    @property
    def num_tokens(self) -> int:
        return self.key.num_tokens

    @property
    def lasting(self) -> bool:
        return self.kind in LASTING_KINDS

    def serves(self, tokens: Sequence[int]) -> bool:
        """True unless the bundle's draft rows depend on a token ``N`` that ``tokens`` lack."""
        end = self.num_tokens
        return self.next_token is None or (end < len(tokens) and tokens[end] == self.next_token)

    def budget_blocks(self) -> list[BlockLike]:
        """The blocks the retained budget counts: every non-null block of the groups once (the grid
        blocks are vLLM's own cache, held with the bundle but not counted; borrowed blocks are
        not held)."""
        borrowed = {block.block_id for block, _ in self.borrowed}
        seen: dict[int, BlockLike] = {}
        for blocks in self.group_blocks:
            for block in blocks:
                if not block.is_null and block.block_id not in borrowed:
                    seen.setdefault(block.block_id, block)
        return list(seen.values())

    def held_sized_blocks(self) -> dict[int, tuple[BlockLike, int]]:
        """:meth:`sized_blocks` without the borrowed ones: the blocks the store holds."""
        borrowed = {block.block_id for block, _ in self.borrowed}
        return {block_id: sized for block_id, sized in self.sized_blocks().items() if block_id not in borrowed}

    def held_blocks(self) -> list[BlockLike]:
        return [block for block, _ in self.held_sized_blocks().values()]

    def intact(self) -> bool:
        """Every borrowed block still carries the hash it had at publication: vLLM has not given
        it out since (a block it hands out loses its hash before the new owner writes)."""
        return all(getattr(block, "block_hash", None) == block_hash for block, block_hash in self.borrowed)

    def distinct_blocks(self) -> list[BlockLike]:
        """Every non-null block of the bundle once, in group order."""
        return [block for block, _ in self.sized_blocks().values()]

    def block_bytes(self) -> dict[int, int]:
        """Bytes of each distinct block, by block id."""
        return {block_id: size for block_id, (_, size) in self.sized_blocks().items()}

    def sized_blocks(self) -> dict[int, tuple[BlockLike, int]]:
        """Every non-null block of the bundle once, with its bytes, by block id (group order)."""
        seen: dict[int, tuple[BlockLike, int]] = {}
        for group_blocks in (self.group_blocks, self.grid_blocks):
            for group, blocks in enumerate(group_blocks):
                size = self.page_bytes[group] if group < len(self.page_bytes) else 0
                for block in blocks:
                    if not block.is_null:
                        seen.setdefault(block.block_id, (block, size))
        return seen


# ---- counters and what metrics.py exports of them ----------------------------------------------
# ``metrics.py`` builds its Prometheus tables from these fields' metadata, so a counter or gauge is
# added (or documented) in one place: its field here.


def exported(help: str, *, metric: str = "", label: str = "") -> Any:
    """A counter exported as the Prometheus counter ``metric`` (default
    ``vllm:boundary_checkpoint_<field name>``) with ``help``. With ``label``, the series are broken
    down by that label, their values counted in the fields :func:`label_value` / :func:`label_values`
    tie to it; the field itself is then the total of all values (not a series)."""
    return field(default=0, metadata={"help": help, "metric": metric, "label": label})


def label_value(total: str, value: str) -> Any:
    """A counter exported as the ``value`` series of the labelled counter ``total``."""
    return field(default=0, metadata={"of": total, "value": value})


def label_values(total: str, prefix: str) -> Any:
    """Counts by label value of the labelled counter ``total``; flat (``as_dict``, the step payload)
    as ``<prefix><value>``."""
    return field(default_factory=dict, metadata={"of": total, "prefix": prefix})


def gauge(help: str, *, metric: str = "") -> Any:
    """A value reported as it is each step and exported as the Prometheus gauge ``metric`` (default
    ``vllm:boundary_checkpoint_<field name>``) with ``help``."""
    return field(default=0, metadata={"help": help, "metric": metric})


@dataclass
class StoreCounters:
    """What the store and the scheduler count. A plain ``int`` field is counted and logged (the
    stats line) only; :func:`exported`, :func:`label_value` and :func:`label_values` fields are also
    Prometheus counters."""

    hits: int = exported("Lookups that restored a boundary checkpoint, by the checkpoint's kind.", label="kind")
    misses: int = exported("Eligible lookups that restored no boundary checkpoint, by reason.", label="reason")
    tokens_restored: int = exported(
        "Prompt tokens restored from boundary checkpoints.", metric="vllm:boundary_checkpoint_restored_tokens"
    )
    # retention borrow: each request's first lookup against stock's estimate (core/hit_balance.py)
    tokens_beyond_stock: int = exported(
        "Prompt tokens restored beyond what stock vLLM's prefix cache would have served (retention borrow; "
        "stock's hit estimated as the cache plus the blocks it evicted while checkpoints held private blocks)."
    )
    stock_tokens_lost: int = exported(
        "Prompt tokens stock vLLM's prefix cache would have served that the plugin did not: blocks evicted "
        "while checkpoints held private blocks (retention borrow, estimated)."
    )
    published: int = exported(
        "Checkpoints published into the store.", metric="vllm:boundary_checkpoint_captures_published"
    )
    duplicates: int = 0
    evictions: int = exported(
        "Retained checkpoints evicted, by cause (budget: max_retained_fraction, pressure: an allocation did not "
        "fit, borrowed: vLLM evicted a page of its prefix cache the checkpoint borrowed, cached: a new block "
        "would otherwise evict a block of vLLM's prefix cache).",
        label="cause",
    )  # all causes: the four below
    evictions_budget: int = label_value("evictions", "budget")  # the retained share would exceed max_retained_fraction
    evictions_pressure: int = label_value("evictions", "pressure")  # an allocation did not fit in the free pool
    evictions_borrowed: int = label_value("evictions", "borrowed")  # vLLM evicted a page it borrowed (borrow)
    evictions_cached: int = label_value("evictions", "cached")  # vLLM would otherwise evict a cached block
    # a newcomer alone larger than the budget
    refused_oversize: int = exported("Checkpoints not retained: alone larger than the budget.")
    # a newcomer refused: the bundle it would evict is likely reused soon
    refused_protected: int = exported("Checkpoints not retained: the bundle they would evict is likely reused sooner.")
    # retention borrow: its private blocks would evict cached blocks likely read again
    refused_thrashing: int = exported(
        "Checkpoints not taken: their private blocks would evict blocks of vLLM's prefix cache freed within "
        "checkpoints' reuse horizon, or before any reuse was seen."
    )
    superseded: int = 0
    captures_dropped: int = exported("Planned captures dropped (no free blocks, no plan).")
    # retention borrow: a prompt capture whose copies had not run gave its private blocks back
    captures_yielded: int = exported(
        "Prompt captures given up before their copies ran: their private blocks went back to vLLM's allocation."
    )
    # finished aborted after generating: no response checkpoint
    responses_aborted: int = exported("Responses aborted after generating: no checkpoint.")
    responses_spec_in_flight: int = exported(
        "Responses finished with a speculative step in flight that left no exact state: no checkpoint."
    )
    # Hits on a shorter prefix than a (retained or pending) bundle holds: its MTP draft row was
    # computed from another next token (the guard refused it; a hit is still counted by kind).
    draft_next_token_fallbacks: int = exported(
        "Hits on a shorter prefix than a checkpoint whose MTP draft row was computed from another next token."
    )
    capture_steps: int = exported("Engine steps that carried capture copies.")
    capture_copies: int = exported("Block copies run for captures.")  # by those steps
    capture_copy_bytes: int = exported("Bytes copied for captures.")  # moved by those copies
    prompts_skipped: int = exported(
        "Prompts that kept no checkpoint at their end: prompt checkpoints were not seen reused (prompt_admission)."
    )
    prompts_waited: int = exported(
        "New prompts that waited (up to two engine steps) for a shared prefix another request was computing, "
        "rather than computing it cold beside it (speculative decoding)."
    )
    shared_hits_released: int = exported(
        "Allocations whose mark on the cached recurrent state their prefix hit ends on was taken back, so "
        "other prompts hitting that state start in the same engine step (vLLM would defer each a step)."
    )
    rows_fit_to_graph: int = exported(
        "New requests that started an engine step later so that a step of restored prompts fit the largest "
        "CUDA graph, the rest fitting the next step's (graph_fit_tokens)."
    )
    prompt_stops: int = exported(
        "Prefill chunks the plugin ended at P - 1: the last prompt token ran in an engine step of its own."
    )
    prompt_captures_in_step: int = exported(
        "Prompt checkpoints taken inside the step that computed the prompt (no P - 1 stop)."
    )
    # GLM's indexer pool grid (core/pool_snapshots.py)
    responses_on_pool_grid: int = exported(
        "Response checkpoints taken at the indexer's pool boundary below the committed length, from a snapshot: "
        "the next turn prefills from there in one step."
    )
    pool_snapshot_copies: int = exported("Block copies into pool-grid snapshots of decoding requests.")
    responses_off_pool_grid: int = exported(
        "Responses that kept no checkpoint under speculative decoding with a pooled indexer: their boundary "
        "was off the pool grid, so the next turn restores the prompt checkpoint."
    )
    responses_within_a_pool: int = exported(
        "Responses that kept no checkpoint with a pooled indexer: their boundary was less than a pool past the "
        "last block boundary of their prompt, where vLLM's own cache serves the next turn in fewer steps."
    )
    vllm_hits_lowered: int = exported(
        "Hits of vLLM's own cache lowered under speculative decoding with a pooled indexer: from a hit inside a "
        "block (a prefix match unit finer than the block) vLLM would run a prefill row as short as a verify row."
    )
    pool_snapshots_released: int = exported(
        "Pool-grid snapshots given back to make room: that response keeps its checkpoint at the committed length."
    )
    # by the restored checkpoint's kind, and by miss reason (core/kinds.py)
    hits_by_kind: dict[CheckpointKind, int] = label_values("hits", "hit_")
    misses_by_reason: dict[MissReason, int] = label_values("misses", "miss_")

    def __setattr__(self, name: str, value: Any) -> None:
        """Every assignment also bumps ``version`` (not a counter), which tells a step that counted
        nothing from one that did. The labelled dicts change only beside their totals."""
        object.__setattr__(self, name, value)
        object.__setattr__(self, "version", self.__dict__.get("version", 0) + 1)

    def as_dict(self) -> dict[str, int]:
        """Flat counters; the counts by label value under their prefix: hits by kind as
        ``hit_<kind>``, misses by reason as ``miss_<reason>``."""
        flat = {name: getattr(self, name) for name in _SCALAR_COUNTERS}
        for name, prefix in _LABELLED_COUNTERS:
            flat.update({f"{prefix}{value}": n for value, n in sorted(getattr(self, name).items())})
        return flat


_SCALAR_COUNTERS = tuple(f.name for f in fields(StoreCounters) if "prefix" not in f.metadata)
_LABELLED_COUNTERS = tuple((f.name, f.metadata["prefix"]) for f in fields(StoreCounters) if "prefix" in f.metadata)


@dataclass
class ReportedGauges:
    """The values the scheduler reports with its counters each step (``boundary_stats``), as they
    are rather than as deltas; each is a Prometheus gauge."""

    checkpoints_retained: int = gauge("Boundary checkpoints retained.", metric="vllm:boundary_checkpoints_retained")
    blocks_retained: int = gauge(
        "KV cache blocks held by retained boundary checkpoints.", metric="vllm:boundary_checkpoint_retained_blocks"
    )
    bytes_retained: int = gauge(
        "Bytes of KV cache held by retained boundary checkpoints.", metric="vllm:boundary_checkpoint_retained_bytes"
    )
    captures_pending: int = gauge("Captures planned and not yet published.")
    snapshot_blocks: int = gauge(
        "KV cache blocks held by pool-grid snapshots of decoding requests.",
        metric="vllm:boundary_checkpoint_snapshot_blocks",
    )
