"""The KV cache manager and coordinator subclasses the boundary scheduler installs on vLLM's.

Contract: :class:`PressureRelievingKVCacheManager` evicts retained checkpoints (through the
scheduler's ``relieve_pressure``) before it refuses an allocation, and refuses a new prompt's first
allocation when its ``prefix_in_flight`` (``core/prefix_in_flight.py``) or its ``graph_fit``
(``core/graph_fit.py``) says it waits a step, and takes back the same-step marks ``shared_hits``
(``core/shared_hits.py``) names after an allocation;
:class:`YieldingBlockPool` lets them yield (the scheduler's ``yield_to_cache``) before it hands out
a block of vLLM's prefix cache; :func:`counting_coordinator_class` is a coordinator that
remembers its last block count, counts a chunk the plugin cut short as if the prefill ended
there, and leaves a restored request's copied state slot uncached. vLLM's instances are
re-classed (see ``compat``): the manager for the engine's life, the coordinator only while it
matters (:func:`counting_blocks`, a cut chunk, a restore run past its block), so an allocation
that fits and was neither cut nor run past runs vLLM's code alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from boundary_checkpoints.compat import (
    BlockPool,
    KVCacheManager,
    RequestStatus,
    get_block_hash,
    get_group_id,
    leave_state_slot_uncached,
    read_restored_slot_in_place,
    reclass_instance,
    recurrent_copies_on_write,
    restore_class,
    watermark_blocks,
)

_COUNTING_COORDINATORS: dict[type, type] = {}


def counting_coordinator_class(cls: Any) -> type:
    """``cls`` (a KV cache coordinator class) with a ``get_num_blocks_to_allocate`` that keeps its
    last answer in ``last_num_blocks_to_allocate`` and, for a request whose chunk the plugin cut
    short of the prefill's end (``cut_prefill_ends``: request id -> the cut chunk's end, set by the
    scheduler for the ``schedule()`` in progress), counts that step's blocks as if the prefill
    ended there; one class per (vLLM) coordinator type.

    Why the cut end: under vLLM's default sparse retention a recurrent group whose kernels export
    a block-boundary state from inside a chunk (KDA, Mamba2: ``num_prefill_checkpoint_blocks``)
    reserves the block for that state only on the chunk that reaches the prefill's end, while the
    worker exports it from any chunk (``compute_mamba_prefill_checkpoints`` knows no prefill end).
    A prefill cut at ``P - 1`` would leave the state of the last block boundary, which stock
    caches for the next prompt sharing the prefix, unreserved (written into the null block): the
    cut chunk is the last one that can hold it, so it is the prefill's end for that count.

    For a restored request whose first chunk runs past its restore point's block
    (``uncached_state_slots``: request id -> the slot of that block, set by the scheduler) the
    recurrent slot keeps the restored block, read in place with no copy-on-write block (nor its
    count), and ``cache_blocks`` leaves it uncached: it holds no block-end state."""
    if cls not in _COUNTING_COORDINATORS:
        count_blocks = cls.get_num_blocks_to_allocate
        cache = cls.cache_blocks
        allocate = cls.allocate_new_blocks

        def get_num_blocks_to_allocate(self, *args, **kwargs):
            request_id = kwargs.get("request_id")
            cut_end = self.cut_prefill_ends.get(request_id)
            if cut_end is not None and not kwargs.get("apply_admission_cap") and kwargs.get("prefill_end", 0) > cut_end:
                kwargs["prefill_end"] = cut_end
            count = count_blocks(self, *args, **kwargs)
            if request_id in self.uncached_state_slots and count <= self.block_pool.num_gpu_blocks:
                count -= recurrent_copies_on_write(self.single_type_managers)  # read in place instead
            self.last_num_blocks_to_allocate = count
            return count

        def allocate_new_blocks(self, request_id, *args, **kwargs):
            if request_id in self.uncached_state_slots:
                read_restored_slot_in_place(self.single_type_managers, request_id)
            return allocate(self, request_id, *args, **kwargs)

        def cache_blocks(self, request, num_computed_tokens):
            slot = self.uncached_state_slots.get(request.request_id)
            if slot is not None:
                leave_state_slot_uncached(self.single_type_managers, request.request_id, slot)
            return cache(self, request, num_computed_tokens)

        # Single inheritance with no new slots keeps the instance layout, so __class__ can change.
        _COUNTING_COORDINATORS[cls] = type(
            f"Counting{cls.__name__}",
            (cls,),
            {
                "get_num_blocks_to_allocate": get_num_blocks_to_allocate,
                "cache_blocks": cache_blocks,
                "allocate_new_blocks": allocate_new_blocks,
                "last_num_blocks_to_allocate": None,
                "cut_prefill_ends": MappingProxyType({}),
                "uncached_state_slots": MappingProxyType({}),
            },  # the scheduler sets its own dicts
        )
    return _COUNTING_COORDINATORS[cls]


def count_cut_chunks(coordinator: Any) -> None:
    """Re-class ``coordinator`` to its counting class (the scheduler's first cut chunk of a
    ``schedule()``); :func:`stop_counting` undoes it."""
    if type(coordinator) not in _COUNTING_COORDINATORS.values():
        reclass_instance(coordinator, counting_coordinator_class(type(coordinator)))


def stop_counting(coordinator: Any) -> None:
    """``coordinator`` back to vLLM's class (a no-op if it is there)."""
    if type(coordinator) in _COUNTING_COORDINATORS.values():
        restore_class(coordinator, type(coordinator).__base__)


@contextmanager
def counting_blocks(coordinator: Any) -> Iterator[None]:
    """``coordinator`` counts (and remembers) its blocks inside the block; afterwards it is in the
    class it had before."""
    counting = type(coordinator) in _COUNTING_COORDINATORS.values()
    count_cut_chunks(coordinator)
    coordinator.last_num_blocks_to_allocate = None
    try:
        yield
    finally:
        if not counting:
            stop_counting(coordinator)


class PressureRelievingKVCacheManager(KVCacheManager):
    """KVCacheManager that evicts retained checkpoints before refusing an allocation.

    After a refused allocation it asks vLLM's allocation again with the coordinator counting, to
    learn the blocks vLLM asked for (a refused allocation changes nothing that a second one would
    see); the shortfall is those blocks, plus the watermark and reservation it applied, minus the
    free blocks, and ``relieve_pressure`` frees that many. It retries after every eviction, so it
    stops as soon as the allocation fits. vLLM's deliberate "not in this step" answer (more
    blocks than the whole pool, used to defer a recurrent hit on a block cached in the same step)
    is no shortage and evicts nothing.
    """

    relieve_pressure: Any = None  # (shortfall) -> bool (True: a bundle was evicted), set by the scheduler
    prefix_in_flight: Any = None  # core/prefix_in_flight.PrefixInFlight, set by the scheduler (or None)
    shared_hits: Any = None  # core/shared_hits.SharedHits, set by the scheduler (or None)
    graph_fit: Any = None  # core/graph_fit.GraphFit, set by the scheduler (or None)

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):  # type: ignore[override]
        in_flight, graph_fit = self.prefix_in_flight, self.graph_fit
        new = request.status == RequestStatus.WAITING and not request.num_computed_tokens
        start = request.num_computed_tokens  # where this step's tokens start: past the hit
        start += kwargs.get("num_new_computed_tokens", 0) + kwargs.get("num_external_computed_tokens", 0)
        if new and in_flight is not None and in_flight.waits(request, start):
            return None  # vLLM's answer for "not in this step": it tries again next step
        if new and graph_fit is not None and graph_fit.waits(request, start, num_new_tokens):
            return None
        releases = self.shared_hits.marks_to_release(request, kwargs) if self.shared_hits is not None else None
        blocks = self._allocate_relieving_pressure(request, num_new_tokens, *args, **kwargs)
        if blocks is None:
            return None
        if releases:
            self.shared_hits.allocated(request, releases)
        if graph_fit is not None:
            graph_fit.allocated(request, start, num_new_tokens)
        if in_flight is not None:
            if new:
                in_flight.admitted(request, start)
            in_flight.computed(request, start, start + num_new_tokens)
        return blocks

    def free(self, request) -> None:  # type: ignore[override]
        if self.shared_hits is not None:
            self.shared_hits.forget(request.request_id)
        super().free(request)

    def new_step_starts(self) -> None:  # type: ignore[override]
        super().new_step_starts()
        if self.prefix_in_flight is not None:
            self.prefix_in_flight.step_starts()
        if self.graph_fit is not None:
            self.graph_fit.step_starts()

    def _allocate_relieving_pressure(self, request, num_new_tokens, *args, **kwargs):
        blocks = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        if blocks is not None or self.relieve_pressure is None:
            return blocks
        while True:
            with counting_blocks(self.coordinator):
                blocks = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
                needed = self.coordinator.last_num_blocks_to_allocate
            if blocks is not None:
                return blocks
            shortfall = self.shortfall(request, needed, kwargs)
            if shortfall is None or not self.relieve_pressure(shortfall):
                return None

    def shortfall(self, request, needed: int | None, kwargs) -> int | None:
        """Blocks missing for the allocation just refused, which asked for ``needed`` blocks; None
        if freeing blocks cannot help."""
        if needed is None or needed > self.block_pool.num_gpu_blocks:
            return None
        waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if waiting and kwargs.get("has_scheduled_reqs", True):
            needed += watermark_blocks(self)
        needed += kwargs.get("reserved_blocks", 0)
        return max(needed - self.block_pool.get_num_free_blocks(), 1)


class YieldingBlockPool(BlockPool):
    """vLLM's block pool that calls ``yield_to_cache(num_blocks)`` before it hands out new blocks,
    stamps each block of vLLM's prefix cache it frees with ``clock()`` (:meth:`freed_at`), and
    tells ``on_evicted(block_hash, group)`` (the hash-block hash and the KV group) of each cached
    block it evicts.
    The scheduler evicts retained checkpoints there, each only if it was last used no later than
    the newest cached block those new blocks would take: checkpoints and vLLM's cached blocks
    leave in one least-recently-used order."""

    yield_to_cache: Any = None  # (num_blocks) -> None, set by the scheduler
    clock: Any = None  # () -> int, set by the scheduler
    freed_stamps: Any = None  # block id -> clock() at its last free as a cached block
    on_evicted: Any = None  # (block hash, group) -> None, set by the scheduler

    def _maybe_evict_cached_block(self, block) -> bool:  # type: ignore[override]
        block_hash = block.block_hash
        evicted = super()._maybe_evict_cached_block(block)
        if evicted and block_hash is not None and self.on_evicted is not None:
            self.on_evicted(get_block_hash(block_hash), get_group_id(block_hash))
        return evicted

    def get_new_blocks(self, num_blocks: int):  # type: ignore[override]
        if self.yield_to_cache is not None:
            self.yield_to_cache(num_blocks)
        return super().get_new_blocks(num_blocks)

    def free_blocks(self, ordered_blocks) -> None:  # type: ignore[override]
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        if self.clock is None:
            return
        now = self.clock()
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None and getattr(block, "pool", None) in (None, self):
                self.freed_stamps[block.block_id] = now

    def freed_at(self, block) -> int:
        """``clock()`` when ``block`` (a free cached block) was last freed; 0 if before stamping."""
        return self.freed_stamps.get(block.block_id, 0)
