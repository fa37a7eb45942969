"""The hit balance (``core/hit_balance.py``): tokens restores served beyond stock's estimate
against tokens lost to cached blocks the pool evicted within the bundles' private blocks of
evictions; a recurrent state that aged out alone is a loss too. Scheduler-level use:
``tests/core/test_scheduler_yield.py``."""

from __future__ import annotations

import pytest

from boundary_checkpoints.core.hit_balance import DECAY, SHARED_WINDOW, HitBalance

B = 16


def evicted(*hashes: str, capacity: int = 100) -> HitBalance:
    balance = HitBalance(capacity)
    for block_hash in hashes:
        balance.evicted(block_hash)
    return balance


def test_a_chain_evicted_within_the_horizon_counts_as_lost():
    balance = evicted("a", "b", "c", "d")
    # x and y still cached (stock hit 32), c and d among the last 2 evictions
    balance.observe(["x", "y", "c", "d", "e"], B, stock_hit=32, served=32, max_tokens=79, horizon=2)
    assert (balance.lost, balance.gained) == (32, 0) and balance.losing()


@pytest.mark.parametrize("horizon", [0, 2])
def test_evictions_before_the_horizon_cost_nothing(horizon):
    balance = evicted("a", "b", "c", "d")
    balance.observe(["x", "y", "a", "b"], B, stock_hit=32, served=32, max_tokens=79, horizon=horizon)
    assert balance.lost == 0 and not balance.losing()


def hybrid(cached: set[tuple[str, int]], evictions: list[tuple[str, int]]) -> HitBalance:
    """Three KV groups as in Qwen3-Next: pages in group 0, recurrent states in groups 1 and 2; a
    fourth group (as GLM's indexer ring) that the cache never holds."""
    balance = HitBalance(100, page_groups=(0,), state_groups=(1, 2),
                         is_cached=lambda block_hash, group: (block_hash, group) in cached)  # fmt: skip
    for block_hash, group in evictions:
        balance.evicted(block_hash, group)
    return balance


def test_a_recurrent_state_evicted_alone_costs_stock_its_hit():
    """The prefix's pages are all cached; only its states at block 2 aged out."""
    pages = {(h, 0) for h in "abc"}
    balance = hybrid(pages, [("b", 1), ("b", 2)])
    balance.observe(["a", "b", "c"], B, stock_hit=0, served=0, max_tokens=47, horizon=2)
    assert balance.lost == 2 * B


def test_negative_control_pages_cached_without_a_state_give_stock_no_hit():
    """The same prefix with no state ever written at block 2 (nothing evicted there): stock's
    hit stays vLLM's, as does one whose states are evicted in one group only."""
    pages = {(h, 0) for h in "abc"}
    hybrid(pages, []).observe(["a", "b", "c"], B, stock_hit=0, served=0, max_tokens=47, horizon=2)
    balance = hybrid(pages, [("b", 1)])
    balance.observe(["a", "b", "c"], B, stock_hit=0, served=0, max_tokens=47, horizon=2)
    assert balance.lost == 0


def test_an_evicted_page_before_a_cached_state_costs_stock_up_to_that_state():
    """Block 1's page aged out; the states at block 3 are still cached: stock would have hit 3
    blocks, the request got none."""
    cached = {("a", 0), ("c", 0), ("c", 1), ("c", 2)}
    balance = hybrid(cached, [("b", 0)])
    balance.observe(["a", "b", "c", "d"], B, stock_hit=0, served=0, max_tokens=63, horizon=1)
    assert balance.lost == 3 * B


def test_the_chain_ends_at_the_first_block_not_evicted():
    balance = evicted("c", "d")
    balance.observe(["c", "z", "d"], B, stock_hit=0, served=0, max_tokens=79, horizon=2)
    assert balance.lost == B


def test_blocks_past_what_the_request_could_be_served_are_not_counted():
    balance = evicted("c", "d")
    balance.observe(["c", "d"], B, stock_hit=0, served=0, max_tokens=B + 5, horizon=2)
    assert balance.lost == B


def test_a_restore_beyond_stock_gains_and_outweighs_a_smaller_loss():
    balance = evicted("c")
    balance.observe(["x", "y", "z", "w"], B, stock_hit=32, served=60, max_tokens=63, horizon=1)
    assert balance.gained == 28 and balance.lost == 0
    balance.observe(["c", "q"], B, stock_hit=0, served=0, max_tokens=31, horizon=1)
    assert balance.lost == B and balance.gained == pytest.approx(28 * DECAY)
    assert not balance.losing()
    balance.observe(["c", "q"], B, stock_hit=0, served=0, max_tokens=31, horizon=1)
    assert balance.losing()  # 26.9 gained against 31.7 lost


def test_a_restore_that_only_recovers_what_the_bundles_evicted_gains_nothing():
    balance = evicted("c", "d")
    assert balance.observe(["c", "d", "e"], B, stock_hit=0, served=20, max_tokens=47, horizon=2) == (0, 12)
    assert balance.gained == 0 and balance.lost == 12 and balance.losing()


def test_only_capacity_evictions_are_remembered():
    balance = evicted("a", "b", "c", capacity=2)
    balance.observe(["a"], B, stock_hit=0, served=0, max_tokens=B, horizon=10)
    assert balance.lost == 0
    balance.observe(["b"], B, stock_hit=0, served=0, max_tokens=B, horizon=10)
    assert balance.lost == B


def test_a_prefix_cache_reset_forgets_the_evictions_and_the_sums():
    balance = evicted("c")
    balance.observe(["c"], B, stock_hit=0, served=0, max_tokens=B, horizon=1)
    assert balance.losing()
    balance.forget()
    assert not balance.losing()
    balance.observe(["c"], B, stock_hit=0, served=0, max_tokens=B, horizon=1)
    assert balance.lost == 0


def test_a_group_the_cache_never_holds_does_not_hide_a_loss():
    """GLM's indexer ring (group 3 here) is neither pages nor states: left out, the state-only loss
    shows; counted as pages (control) it would end every walk at once."""
    pages = {(h, 0) for h in "abc"}
    balance = hybrid(pages, [("b", 1), ("b", 2)])
    balance.observe(["a", "b", "c"], B, stock_hit=0, served=0, max_tokens=47, horizon=2)
    control = HitBalance(100, page_groups=(0, 3), state_groups=(1, 2),
                         is_cached=lambda block_hash, group: (block_hash, group) in pages)  # fmt: skip
    control.evicted("b", 1)
    control.evicted("b", 2)
    control.observe(["a", "b", "c"], B, stock_hit=0, served=0, max_tokens=47, horizon=2)
    assert balance.lost == 2 * B and control.lost == 0


def test_a_block_two_recent_lookups_read_is_a_shared_prefix():
    """After ``SHARED_WINDOW`` lookups: a block two lookups within the window read is shared, one
    read is not, and two reads fall out of the window as lookups go on; vLLM's hit counts, not
    what the plugin served beyond it."""
    balance = HitBalance(100)
    assert balance.shared_prefix("anything")  # before the window: none can be told apart
    for _ in range(SHARED_WINDOW):
        balance.observe([], B, stock_hit=0, served=0, max_tokens=0, horizon=0)
    assert not balance.shared_prefix("anything")
    balance.observe(["s", "t", "u"], B, stock_hit=32, served=48, max_tokens=48, horizon=0)
    assert not balance.shared_prefix("s")
    balance.observe(["s", "t", "v"], B, stock_hit=16, served=16, max_tokens=48, horizon=0)
    assert balance.shared_prefix("s") and not balance.shared_prefix("t") and not balance.shared_prefix("u")
    for _ in range(SHARED_WINDOW - 2):
        balance.observe([], B, stock_hit=0, served=0, max_tokens=0, horizon=0)
    assert balance.shared_prefix("s")
    balance.observe([], B, stock_hit=0, served=0, max_tokens=0, horizon=0)
    assert not balance.shared_prefix("s")


def test_a_prefix_cache_reset_forgets_the_shared_prefixes():
    balance = HitBalance(100)
    for _ in range(SHARED_WINDOW):
        balance.observe(["s"], B, stock_hit=16, served=16, max_tokens=16, horizon=0)
    assert balance.shared_prefix("s")
    balance.forget()
    assert not balance.shared_prefix("s")
