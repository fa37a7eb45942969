"""Under the default retention ``borrow``, retained bundles yield before vLLM's prefix cache does (``core/kv_manager.py:
YieldingBlockPool``, the scheduler's ``_yield_to_cache``).

Scheduler-level (vLLM's real scheduler and KV cache manager, the shadow runner): a conversation's
first turn leaves bundles holding private blocks, and a second conversation's cached blocks wait
in vLLM's free queue. New blocks that would take one of those cached blocks evict a bundle first
(``evictions_cached``): the bundle's private blocks are handed out instead, and every cached
block stays. The negative control turns the hook off: the same allocation takes a cached block.
"""

from __future__ import annotations

import random

import pytest
from shadow_engine import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.compat import free_queue_order


def cached_blocks(pool) -> int:
    """Blocks of the pool that vLLM's prefix cache names (held or free)."""
    return sum(1 for block in pool.blocks if block.block_hash is not None)


def allocation_past_the_uncached_blocks(model_dir, yielding: bool) -> tuple[int, int, int]:
    """(cached blocks before, cached blocks after, bundles evicted to spare the cache) around an
    allocation of one block more than vLLM's free queue holds uncached, with conversation A's
    bundles retained and conversation B's blocks cached in the free queue (its bundles retired)."""
    scheduler, worker = build_scheduler(model_dir, num_blocks=96, max_retained_fraction=0.5)
    driver = Driver(scheduler, worker)
    rng = random.Random(11)
    driver.run([make_request(tokens(rng, 200), salt="a", max_tokens=8)])  # A: bundles with private blocks
    b = make_request(tokens(rng, 100), salt="b", max_tokens=8)
    driver.run([b])
    scheduler.checkpoint_store.retire(b.request_id)  # B's pages wait in the free queue, cached
    pool = scheduler.kv_cache_manager.block_pool
    assert len(scheduler.checkpoint_store) > 0
    uncached = sum(1 for block in free_queue_order(pool) if block.block_hash is None)
    assert uncached < pool.get_num_free_blocks()
    if not yielding:
        pool.yield_to_cache = None
    before = cached_blocks(pool)
    pool.free_blocks(pool.get_new_blocks(uncached + 1))
    return before, cached_blocks(pool), scheduler.checkpoint_store.counters.evictions_cached


def test_a_bundle_yields_before_a_cached_block_is_taken(model_dir):
    before, after, yielded = allocation_past_the_uncached_blocks(model_dir, yielding=True)
    assert yielded >= 1
    assert after == before > 0


def test_negative_control_without_yielding_a_cached_block_goes(model_dir):
    before, after, yielded = allocation_past_the_uncached_blocks(model_dir, yielding=False)
    assert yielded == 0
    assert after == before - 1


@pytest.mark.parametrize("free", [True, False])
def test_nothing_yields_while_only_uncached_blocks_are_taken(model_dir, free):
    scheduler, worker = build_scheduler(model_dir, num_blocks=96)
    driver = Driver(scheduler, worker)
    driver.run([make_request(tokens(random.Random(5), 200), salt="a", max_tokens=8)])
    pool = scheduler.kv_cache_manager.block_pool
    retained = len(scheduler.checkpoint_store)
    uncached = sum(1 for block in free_queue_order(pool) if block.block_hash is None)
    taken = pool.get_new_blocks(uncached if free else 1)
    pool.free_blocks(taken)
    assert len(scheduler.checkpoint_store) == retained
    assert scheduler.checkpoint_store.counters.evictions_cached == 0
