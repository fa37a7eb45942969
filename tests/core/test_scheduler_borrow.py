"""Retention ``borrow`` (the default): a bundle holds only its private blocks and borrows the
pages vLLM's prefix cache names (``Checkpoint.borrowed``), serving while each still carries the
hash it had at publication (``Checkpoint.intact``).

Scheduler-level (vLLM's real scheduler and KV cache manager, the shadow runner, which checks every
attention row and recurrent state a step reads): pressure that makes vLLM hand out every free
block reuses the borrowed pages; the next turn must then compute cold (the bundle is dropped,
``evictions_borrowed``), never restore from pages that now hold other rows. The negative control
trusts every bundle: the same next turn restores from the reused pages and the shadow catches it.
"""

from __future__ import annotations

import random

import pytest
from shadow_engine import ZERO, ShadowMismatch
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.core.checkpoint import Checkpoint


def next_turn_after_the_cache_is_reused(model_dir):
    """(cached tokens of the next turn, bundles dropped for a lost page) after every free block was
    handed out once (the bundles' yield hook off: pressure beyond what they could give back)."""
    scheduler, worker = build_scheduler(model_dir, num_blocks=96)
    driver = Driver(scheduler, worker)
    rng = random.Random(21)
    prompt = tokens(rng, 200)
    first = make_request(prompt, salt="s", max_tokens=8)
    [answer] = driver.run([first])
    store = scheduler.checkpoint_store
    assert store.checkpoints() and all(c.borrowed for c in store.checkpoints())
    pool = scheduler.kv_cache_manager.block_pool
    pool.yield_to_cache = None
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    for block in taken:  # their new owner writes them: rows zeroed, no state (the shadow's model)
        worker.rows[block.block_id] = [ZERO] * max(worker.block_sizes)
        worker.states.pop(block.block_id, None)
    pool.free_blocks(taken)
    following = make_request(prompt + answer + tokens(rng, 20), salt="s", max_tokens=4)
    driver.run([following])
    return driver.cached_tokens[following.request_id], store.counters.evictions_borrowed


def test_a_bundle_whose_borrowed_page_was_reused_is_dropped_and_the_turn_runs_cold(model_dir):
    cached, dropped = next_turn_after_the_cache_is_reused(model_dir)
    assert dropped >= 1
    assert cached == 0


def test_negative_control_a_bundle_trusted_after_its_pages_were_reused_is_caught(model_dir, monkeypatch):
    monkeypatch.setattr(Checkpoint, "intact", lambda self: True)
    with pytest.raises(ShadowMismatch):
        next_turn_after_the_cache_is_reused(model_dir)
