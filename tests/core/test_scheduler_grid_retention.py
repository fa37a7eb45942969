"""Retention ``hold``: a retained bundle keeps vLLM's own block-grid hit below its boundary alive
(contract 7). (Under the default ``borrow`` a bundle holds no block of vLLM's cache.)

Scheduler-level (vLLM's real scheduler and KV cache manager, the shadow runner): a finished turn's
response bundle holds its pages and, with them, the recurrent states vLLM cached on the block
grid. Pressure that empties vLLM's free queue cannot take those states while the bundle lives, so
once the bundle itself is gone the next turn still gets the block-grid hit stock gives. The
negative control drops the grid blocks from the bundle: the same pressure then leaves the next
turn nothing below its boundary.
"""

from __future__ import annotations

import random

import pytest
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.core.scheduler import BoundaryCheckpointMixin

BLOCK = 16


def evict_free_queue(scheduler) -> None:
    """Every cached block waiting in vLLM's free queue is evicted (an allocation of all of them)."""
    pool = scheduler.kv_cache_manager.block_pool
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))


def next_turn_after_pressure(model_dir, lag: int) -> tuple[int, int, int]:
    """(cached tokens of the next turn, its block-grid position, its exact boundary) after the
    first turn's bundles are retired under a pressure that emptied vLLM's free queue."""
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag), num_blocks=96, retention="hold")
    driver = Driver(scheduler, worker, lag=lag)
    rng = random.Random(7)
    prompt = tokens(rng, 200)
    first = make_request(prompt, salt="s", max_tokens=8)
    [answer] = driver.run([first])
    evict_free_queue(scheduler)
    scheduler.checkpoint_store.retire(first.request_id)  # the turn's bundles are gone
    assert len(scheduler.checkpoint_store) == 0
    boundary = len(prompt) + len(answer) - 1
    following = make_request(prompt + answer + tokens(rng, 20), salt="s")
    driver.run([following])
    return driver.cached_tokens[following.request_id], boundary // BLOCK * BLOCK, boundary


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async-one-step-in-flight"])
def test_the_block_grid_hit_outlives_the_bundle_that_kept_it(model_dir, lag):
    cached, grid, boundary = next_turn_after_pressure(model_dir, lag)
    assert grid < boundary
    assert cached == grid


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async-one-step-in-flight"])
def test_negative_control_a_bundle_without_its_grid_blocks_loses_the_stock_hit(model_dir, lag, monkeypatch):
    monkeypatch.setattr(BoundaryCheckpointMixin, "_grid_blocks", lambda self, request, num_tokens, plan: ())
    cached, grid, _ = next_turn_after_pressure(model_dir, lag)
    assert cached < grid


def test_grid_blocks_are_held_outside_the_budget_and_leave_with_the_bundle(model_dir):
    scheduler, worker = build_scheduler(model_dir, num_blocks=96, retention="hold")
    driver = Driver(scheduler, worker)
    pool = scheduler.kv_cache_manager.block_pool
    first = make_request(tokens(random.Random(3), 200), salt="s", max_tokens=8)
    driver.run([first])
    store = scheduler.checkpoint_store
    grid = [block for checkpoint in store.checkpoints() for group in checkpoint.grid_blocks for block in group]
    assert grid and all(block.ref_cnt >= 1 for block in grid)
    assert store.budgeted_blocks == len({b.block_id for c in store.checkpoints() for b in c.budget_blocks()})
    assert store.retained_blocks == len({b.block_id for c in store.checkpoints() for b in c.distinct_blocks()})
    assert not {b.block_id for b in grid} & {b.block_id for c in store.checkpoints() for b in c.budget_blocks()}
    assert {b.block_id for b in grid} <= {b.block_id for c in store.checkpoints() for b in c.distinct_blocks()}
    store.retire(first.request_id)
    assert all(block.ref_cnt == 0 for block in grid)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # everything back but the null block
