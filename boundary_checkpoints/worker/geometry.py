"""Page geometry under decode context parallelism (DCP): which rank holds a token, and where.

Pure integer arithmetic, no torch, no vLLM import; the worker and the tests build on it.

Terms (vLLM 0.32)
-----------------
``block_size`` (B) is the KV cache spec's ``block_size``: the rows of one physical page on one rank.
``dcp_world_size`` (W) is ``parallel_config.decode_context_parallel_size``; ``interleave`` (I) is
``parallel_config.cp_kv_cache_interleave_size``. A group is *sharded* when its spec has
``dcp_sharded=True`` (attention specs by default); Mamba/GDN/KDA state specs and a draft model's
attention run at DCP 1 under a DCP target (``dcp_sharded=False``) are *replicated*: every rank holds
the whole group, so S, the shard count, is W for sharded groups and 1 for replicated ones.

The scheduler's block of a group is a virtual page of ``B * S`` tokens (``single_type_kv_cache_manager``:
``block_size = kv_cache_spec.block_size * dcp_world_size`` when sharded). Block-table entry ``v`` of a
request (one block id, the same on every rank) names page ``v``, the positions
``[v*B*S, (v+1)*B*S)``; each rank keeps its own B-row physical page under that id. Within the page,
runs of I consecutive tokens go round-robin over the ranks, so one round is ``I*S`` tokens and a page
holds ``B/I`` rounds. For a position ``p`` with ``o = p % (B*S)``::

    block_index = p // (B*S)                  # entry of the request's block table (scheduler block)
    owner       = (o // I) % S                # the only rank that stores p
    row         = (o // (I*S)) * I + o % I    # row of that rank's physical page
    slot        = block_table[block_index] * B + row   # on the owner; every other rank writes nothing

This is the slot mapping of both model runners (V1 ``ComputeSlotMappingKernel`` in
``v1/worker/block_table.py``, V2 ``_compute_slot_mappings_kernel`` in ``v1/worker/gpu/block_table.py``),
and counting a rank's positions below N gives vLLM's ``get_dcp_local_seq_lens``
(``v1/attention/backends/utils.py``); tests/worker/test_geometry.py checks all three against this module.
Because I divides B, every page holds whole rounds, so a rank's rows are dense: its k-th position
(k = 0, 1, ...) sits at ``block_index * B + row == k``. With S == 1 everything reduces to
``(p // B, p % B)`` whatever I is (vLLM ignores I then).

Boundary at N (positions ``0 .. N-1`` computed): pages ``0 .. N // (B*S) - 1`` are full on every rank.
If ``N % (B*S) != 0`` page ``v = N // (B*S)`` is partial; rank r holds ``tail_page(N, r).valid_rows``
of its rows (its ``rows_on_rank(r, N) - v*B``, anywhere from 0 to B inclusive: with a large I some ranks
already have their whole share of the page and others none). A capture at N copies, on every rank,
rows ``[0, valid_rows)`` of the physical page under block-table entry v, which a whole-block copy of
that scheduler block on every rank covers; a restore copies the same block back into the new
request's entry v. Replicated groups: the same arithmetic with S = 1 on every rank (recurrent state
groups hold no per-token rows: their state block is copied whole, identically on each rank).

Inputs rejected (``ValueError``): non-int or bool fields and arguments; ``block_size``,
``dcp_world_size`` or ``interleave`` below 1; for a sharded group with W > 1, an interleave larger than
B or not dividing B (vLLM refuses the same in ``VllmConfig.validate_block_size``; its NIXL P/D path
instead forces I to the block size); a negative position or token count; a rank outside ``[0, W)``;
a row outside ``[0, B)``; ``owner_of`` on a replicated group with W > 1 (use ``holds``/``owners_of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class LocalSlot(NamedTuple):
    """Where a position lives on its owning rank: block-table entry and row of that physical page."""

    block_index: int
    row: int


class TailPage(NamedTuple):
    """A rank's share of the partial page at a boundary: block-table entry and valid rows (0..B)."""

    block_index: int
    valid_rows: int


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class PageLayout:
    """Geometry of one KV cache group on a DCP group of ``dcp_world_size`` ranks (see module doc)."""

    block_size: int
    dcp_world_size: int = 1
    interleave: int = 1
    sharded: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("dcp_world_size", self.dcp_world_size, 1)
        _check_int("interleave", self.interleave, 1)
        if not isinstance(self.sharded, bool):
            raise ValueError("sharded must be a bool")
        if self.shards > 1 and self.block_size % self.interleave != 0:
            raise ValueError(
                f"block_size ({self.block_size}) must be >= and divisible by "
                f"cp_kv_cache_interleave_size ({self.interleave}) under DCP {self.dcp_world_size}"
            )

    @classmethod
    def attention(cls, block_size: int, dcp_world_size: int = 1, interleave: int = 1) -> PageLayout:
        """A DCP-sharded attention group (``FullAttentionSpec``, ``dcp_sharded=True``)."""
        return cls(block_size, dcp_world_size, interleave, sharded=True)

    @classmethod
    def replicated(cls, block_size: int, dcp_world_size: int = 1) -> PageLayout:
        """A group every rank holds whole: Mamba/GDN/KDA state, a draft group at DCP 1."""
        return cls(block_size, dcp_world_size, 1, sharded=False)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def shards(self) -> int:
        """How many ranks split a page: W for a sharded group, 1 for a replicated one."""
        return self.dcp_world_size if self.sharded else 1

    @property
    def scheduler_block_size(self) -> int:
        """Tokens per scheduler block (the virtual page): ``B * S``."""
        return self.block_size * self.shards

    # -- argument checks ----------------------------------------------------------------------
    def _rank(self, rank: int) -> int:
        _check_int("rank", rank, 0)
        if rank >= self.dcp_world_size:
            raise ValueError(f"rank {rank} outside [0, {self.dcp_world_size})")
        return rank

    # -- one position -------------------------------------------------------------------------
    def owner_of(self, position: int) -> int:
        """The one rank that stores ``position`` (a sharded group, or W == 1)."""
        _check_int("position", position, 0)
        if self.shards == 1:
            if self.dcp_world_size > 1:
                raise ValueError("replicated group: every rank holds every position (use owners_of)")
            return 0
        offset = position % self.scheduler_block_size
        return (offset // self.interleave) % self.shards

    def owners_of(self, position: int) -> tuple[int, ...]:
        """Every rank that stores ``position``: one for a sharded group, all W for a replicated one."""
        if self.shards == 1:
            _check_int("position", position, 0)
            return tuple(range(self.dcp_world_size))
        return (self.owner_of(position),)

    def holds(self, rank: int, position: int) -> bool:
        """Whether ``rank`` stores ``position``."""
        self._rank(rank)
        return rank in self.owners_of(position)

    def local_slot(self, position: int) -> LocalSlot:
        """Block-table entry and physical-page row of ``position`` on the rank(s) that hold it."""
        _check_int("position", position, 0)
        page = self.scheduler_block_size
        block_index, offset = divmod(position, page)
        if self.shards == 1:
            return LocalSlot(block_index, offset)
        rounds, within = divmod(offset, self.interleave * self.shards)
        return LocalSlot(block_index, rounds * self.interleave + within % self.interleave)

    def local_position(self, position: int) -> int:
        """``block_index * B + row``: how many of the holder's positions come before ``position``."""
        slot = self.local_slot(position)
        return slot.block_index * self.block_size + slot.row

    def position_of(self, rank: int, block_index: int, row: int) -> int:
        """Inverse of ``local_slot``: the position stored at (block-table entry, row) on ``rank``."""
        self._rank(rank)
        _check_int("block_index", block_index, 0)
        _check_int("row", row, 0)
        if row >= self.block_size:
            raise ValueError(f"row {row} outside [0, {self.block_size})")
        base = block_index * self.scheduler_block_size
        if self.shards == 1:
            return base + row
        rounds, within = divmod(row, self.interleave)
        return base + rounds * self.interleave * self.shards + rank * self.interleave + within

    # -- the first N positions ----------------------------------------------------------------
    def rows_on_rank(self, rank: int, num_tokens: int) -> int:
        """How many of positions ``0 .. num_tokens-1`` ``rank`` stores (vLLM's DCP local seq len)."""
        self._rank(rank)
        _check_int("num_tokens", num_tokens, 0)
        if self.shards == 1:
            return num_tokens
        round_size = self.interleave * self.shards
        full_rounds, rest = divmod(num_tokens, round_size)
        return full_rounds * self.interleave + min(max(rest - rank * self.interleave, 0), self.interleave)

    def partial_page_index(self, num_tokens: int) -> int | None:
        """Block-table entry of the page a boundary at ``num_tokens`` leaves partial; None if none."""
        _check_int("num_tokens", num_tokens, 0)
        block_index, rest = divmod(num_tokens, self.scheduler_block_size)
        return block_index if rest else None

    def tail_page(self, num_tokens: int, rank: int) -> TailPage | None:
        """``rank``'s share of the partial page at boundary ``num_tokens``: what a capture copies there.

        None when the boundary ends on a page edge (nothing partial on any rank). Otherwise rows
        ``[0, valid_rows)`` of the rank's physical page under entry ``block_index`` hold positions below
        ``num_tokens``; ``valid_rows`` may be 0 (the rank's share not begun) or B (already full).
        """
        self._rank(rank)
        block_index = self.partial_page_index(num_tokens)
        if block_index is None:
            return None
        return TailPage(block_index, self.rows_on_rank(rank, num_tokens) - block_index * self.block_size)

    def tail_pages(self, num_tokens: int) -> tuple[TailPage, ...] | None:
        """``tail_page`` for every rank 0 .. W-1 (None when the boundary ends on a page edge)."""
        if self.partial_page_index(num_tokens) is None:
            return None
        return tuple(self.tail_page(num_tokens, rank) for rank in range(self.dcp_world_size))  # type: ignore[misc]


def layout_for_spec(spec: Any, dcp_world_size: int = 1, interleave: int = 1) -> PageLayout:
    """The layout of a vLLM ``KVCacheSpec`` (duck-typed: ``block_size`` and ``dcp_sharded``).

    ``UniformTypeKVCacheSpecs`` carries both too. A spec without ``dcp_sharded`` counts as replicated,
    as vLLM's ``KVCacheSpec`` default is False.
    """
    sharded = bool(getattr(spec, "dcp_sharded", False))
    if sharded:
        return PageLayout.attention(spec.block_size, dcp_world_size, interleave)
    return PageLayout.replicated(spec.block_size, dcp_world_size)
