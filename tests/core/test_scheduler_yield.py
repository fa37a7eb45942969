"""Under the default retention ``borrow``, retained bundles yield before vLLM's prefix cache does (``core/kv_manager.py:
YieldingBlockPool``, the scheduler's ``_yield_to_cache``).

Scheduler-level (vLLM's real scheduler and KV cache manager, the shadow runner): a conversation's
first turn leaves bundles holding private blocks, and a second conversation's cached blocks wait
in vLLM's free queue. New blocks that would take one of those cached blocks evict a bundle first
(``evictions_cached``): the bundle's private blocks are handed out instead, and every cached
block stays. The negative control turns the hook off: the same allocation takes a cached block.

Once reuse was seen, a bundle yields to cached blocks freed within its reuse horizon (twice the
median reuse distance: as likely to be read again as a protected bundle); past it, only to cached
blocks freed no earlier than its last use: a conversation newer than the cached blocks about to go
keeps its bundle (the same allocation with the conversations in the other order, or with no
publication since, is its control). With 8 requests in flight and every turn k before any turn
k + 1, this keeps stock's cached tokens where the horizon at one median distance did not.
Where bundles give way, a prompt capture whose copies have not run yet gives way first
(``captures_yielded``): with 8 prompts ending in one step, their captures' private blocks would
otherwise stay taken through the next step's allocations. Past the horizon it stays, so a
resend on a warm server still finds its prompt's checkpoint. The turn that gave it up keeps its
lineage: its response still follows the bundle it restored from.

While bundles cost more cached tokens than they served (``core/hit_balance.py``), a bundle
yields to every cached block, however recently it was used; so it does to a cached block two of
the last ``SHARED_WINDOW`` first lookups read (a shared prefix), and to every cached block before
that many lookups were seen. The pool tells the balance which
cached blocks it evicted, by the hashes requests name them with and their KV group.

A capture whose private blocks would evict cached blocks within the reuse horizon is not taken,
nor before any reuse was seen
(``refused_thrashing``); with a short reuse distance the same capture is taken. A refused key is
remembered: the request it would have served records its reuse distance (a regret), so a server
whose pool filled before its first reuse still learns one.
"""

from __future__ import annotations

import random

import pytest
from script_modules import load_script
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.compat import free_queue_order, get_block_hash
from boundary_checkpoints.core.boundaries import PROMPT, RESPONSE
from boundary_checkpoints.core.hit_balance import SHARED_WINDOW
from boundary_checkpoints.core.reuse import PROTECTION_FACTOR

HORIZON_AT_DISTANCE_0 = PROTECTION_FACTOR  # publications: a median reuse distance of 0 counts as 1


def cached_blocks(pool) -> int:
    """Blocks of the pool that vLLM's prefix cache names (held or free)."""
    return sum(1 for block in pool.blocks if block.block_hash is not None)


def two_conversations(model_dir, a_first: bool = True, requests: list | None = None):
    """(scheduler, store, pool) after conversations A and B ran (in that order, or B first), with
    A's bundles retained and B's blocks cached in the free queue (its bundles retired). Response
    bundles only: a demoted prompt bundle counts as used before anything. ``requests`` receives
    A and B."""
    scheduler, worker = build_scheduler(model_dir, num_blocks=96, max_retained_fraction=0.5, prompt_checkpoints=False)
    driver = Driver(scheduler, worker)
    rng = random.Random(11)
    a = make_request(tokens(rng, 200), salt="a", max_tokens=8)
    b = make_request(tokens(rng, 100), salt="b", max_tokens=8)
    if requests is not None:
        requests.extend((a, b))
    for request in (a, b) if a_first else (b, a):
        driver.run([request])
        if request is b:
            scheduler.checkpoint_store.retire(b.request_id)
    store = scheduler.checkpoint_store
    assert len(store) > 0
    return scheduler, store, scheduler.kv_cache_manager.block_pool


def allocation_past_the_uncached_blocks(model_dir, yielding: bool) -> tuple[int, int, int]:
    """(cached blocks before, cached blocks after, bundles evicted to spare the cache) around an
    allocation of one block more than vLLM's free queue holds uncached (no reuse seen yet)."""
    _, store, pool = two_conversations(model_dir)
    uncached = sum(1 for block in free_queue_order(pool) if block.block_hash is None)
    assert uncached < pool.get_num_free_blocks()
    if not yielding:
        pool.yield_to_cache = None
    before = cached_blocks(pool)
    pool.free_blocks(pool.get_new_blocks(uncached + 1))
    return before, cached_blocks(pool), store.counters.evictions_cached


def allocation_by_age(
    model_dir, a_first: bool, reuse_distance: int, past_the_bundle: bool, losing: bool = False,
    lookups_seen: int = SHARED_WINDOW, shared_reads: int = 0, elapsed: int = HORIZON_AT_DISTANCE_0,
) -> tuple[bool, int, int]:  # fmt: skip
    """(A's bundle still retained, bundles evicted to spare the cache, cached blocks lost) after an
    allocation of the free queue's blocks freed before A's bundle was last used, or
    (``past_the_bundle``) through the first one freed after it, once the store has seen bundles
    reused after ``reuse_distance`` publications and the balance ``lookups_seen`` first lookups
    that read nothing; ``losing``: after one lookup whose hit a recently evicted block would have
    extended; ``shared_reads``: then that many lookups read the first cached block about to go.
    ``elapsed`` publications pass before the allocation (by default the cached blocks are then
    past the reuse horizon of ``reuse_distance`` 0)."""
    scheduler, store, pool = two_conversations(model_dir, a_first)
    [bundle] = store.checkpoints()
    used = store.policy.used_at(bundle)
    store.reuse.record_hit(store.reuse.clock - reuse_distance)
    for _ in range(elapsed):
        store.reuse.stamp()
    balance = scheduler._hit_balance
    for _ in range(lookups_seen):
        balance.observe([], 16, stock_hit=0, served=0, max_tokens=0, horizon=0)
    if losing:
        lose_a_cached_block(scheduler)
        assert balance.losing()
    queue = list(free_queue_order(pool))
    first_cached = next(block for block in queue if block.block_hash is not None)
    for _ in range(shared_reads):
        balance.observe(
            [get_block_hash(first_cached.block_hash)], 16, stock_hit=16, served=16, max_tokens=16, horizon=0
        )
    newer = [i for i, block in enumerate(queue) if block.block_hash is not None and pool.freed_at(block) > used]
    older = [i for i, block in enumerate(queue) if block.block_hash is not None and pool.freed_at(block) < used]
    if past_the_bundle:
        num_blocks = newer[0] + 1
    else:
        num_blocks = next(i for i in range(older[-1], len(queue)) if i not in older)  # every older one, no newer
        assert not newer or newer[0] >= num_blocks
    before = cached_blocks(pool)
    pool.free_blocks(pool.get_new_blocks(num_blocks))
    return bundle in store.checkpoints(), store.counters.evictions_cached, before - cached_blocks(pool)


def lose_a_cached_block(scheduler) -> None:
    """A lookup whose one block (its page and both states) the pool evicted while bundles held a
    private block."""
    balance = scheduler._hit_balance
    for group in range(3):
        balance.evicted(b"gone", group)
    balance.observe([b"gone"], 16, stock_hit=0, served=0, max_tokens=16, horizon=3)


def test_a_bundle_yields_before_a_cached_block_is_taken(model_dir):
    before, after, yielded = allocation_past_the_uncached_blocks(model_dir, yielding=True)
    assert yielded >= 1
    assert after == before > 0


def test_negative_control_without_yielding_a_cached_block_goes(model_dir):
    before, after, yielded = allocation_past_the_uncached_blocks(model_dir, yielding=False)
    assert yielded == 0
    assert after == before - 1


def test_a_bundle_used_after_every_cached_block_about_to_go_stays(model_dir):
    kept, yielded, lost = allocation_by_age(model_dir, a_first=False, reuse_distance=0, past_the_bundle=False)
    assert kept and yielded == 0 and lost > 0


def test_a_bundle_yields_to_cached_blocks_within_its_reuse_horizon(model_dir):
    """The allocation of the test above (its control), with no publication since: the cached
    blocks about to go were freed 1-2 publications ago, within twice the median reuse distance
    (0, counted as 1). Half of all reuses come later than the median, so such a block is as
    likely to be read again as a protected bundle, and it serves stock's hit."""
    kept, yielded, _ = allocation_by_age(model_dir, a_first=False, reuse_distance=0, past_the_bundle=False,
                                         elapsed=0)  # fmt: skip
    assert not kept and yielded >= 1


def test_a_bundle_yields_to_a_cached_block_two_recent_lookups_read(model_dir):
    """The allocation of the test above (its control), after two lookups read the first cached
    block about to go: a shared prefix outranks the bundle, however recently it was used."""
    kept, yielded, _ = allocation_by_age(model_dir, a_first=False, reuse_distance=0, past_the_bundle=False,
                                         shared_reads=2)  # fmt: skip
    assert not kept and yielded >= 1


def test_one_read_does_not_make_a_shared_prefix(model_dir):
    kept, yielded, _ = allocation_by_age(model_dir, a_first=False, reuse_distance=0, past_the_bundle=False,
                                         shared_reads=1)  # fmt: skip
    assert kept and yielded == 0


def test_before_a_window_of_lookups_a_bundle_yields_to_every_cached_block(model_dir):
    """Before ``SHARED_WINDOW`` first lookups no block can be told shared: the same allocation."""
    kept, yielded, _ = allocation_by_age(model_dir, a_first=False, reuse_distance=0, past_the_bundle=False,
                                         lookups_seen=SHARED_WINDOW - 3)  # fmt: skip
    assert not kept and yielded >= 1


def test_a_bundle_yields_to_every_cached_block_while_bundles_cost_more_hits_than_they_serve(model_dir):
    """The allocation of the test above (its control), after a lookup that lost cached tokens."""
    kept, yielded, lost = allocation_by_age(model_dir, a_first=False, reuse_distance=0, past_the_bundle=False,
                                            losing=True)  # fmt: skip
    assert not kept and yielded >= 1


def test_the_pool_reports_each_cached_block_it_evicts_by_the_requests_hashes(model_dir):
    """Evicting B's cached blocks shows in the balance: a lookup of B's prompt with nothing cached
    counts every full block of it as lost while the bundles hold private blocks, and nothing with
    none held (horizon 0) or before the eviction."""
    requests: list = []
    scheduler, store, pool = two_conversations(model_dir, requests=requests)
    _, b = requests
    full = (b.num_prompt_tokens - 1) // 16
    balance = scheduler._hit_balance

    def lookup_of_b(horizon: int) -> None:
        balance.observe(b.block_hashes, 16, stock_hit=0, served=0, max_tokens=b.num_prompt_tokens - 1, horizon=horizon)

    lookup_of_b(pool.num_gpu_blocks)
    assert balance.lost == 0  # not evicted yet
    pool.yield_to_cache = None  # every cached block goes, bundles stay
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    lookup_of_b(0)
    assert balance.lost == 0
    lookup_of_b(pool.num_gpu_blocks)
    assert balance.lost == full * 16 > 0


@pytest.mark.parametrize("retention", ["borrow", "hold"])
def test_each_first_lookup_adds_what_the_balance_saw_to_the_counters(model_dir, retention):
    """``tokens_beyond_stock`` and ``stock_tokens_lost`` (on ``/metrics``) sum what the balance
    returns for each request's first lookup, once per request; under ``hold`` (control) the
    balance is not consulted."""
    scheduler, worker = build_scheduler(model_dir, num_blocks=96, retention=retention)
    scheduler._hit_balance.observe = lambda *args, **kwargs: (5, 7)
    driver = Driver(scheduler, worker)
    rng = random.Random(5)
    driver.run([make_request(tokens(rng, 300), max_tokens=8), make_request(tokens(rng, 40), max_tokens=8)])
    counters = scheduler.checkpoint_store.counters
    expected = (10, 14) if retention == "borrow" else (0, 0)
    assert (counters.tokens_beyond_stock, counters.stock_tokens_lost) == expected


def test_a_prefix_cache_reset_starts_the_balance_again(model_dir):
    scheduler, _, _ = two_conversations(model_dir)
    balance = scheduler._hit_balance
    lose_a_cached_block(scheduler)
    assert balance.losing()
    assert scheduler.reset_prefix_cache()
    assert not balance.losing()


def test_negative_control_it_yields_while_bundles_wait_longer_than_the_cache_keeps_blocks(model_dir):
    kept, yielded, _ = allocation_by_age(model_dir, a_first=False, reuse_distance=1000, past_the_bundle=False)
    assert not kept and yielded >= 1


def test_a_bundle_yields_to_a_cached_block_freed_after_its_last_use(model_dir):
    kept, yielded, _ = allocation_by_age(model_dir, a_first=True, reuse_distance=0, past_the_bundle=True)
    assert not kept and yielded >= 1


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


def after_one_request(model_dir, prompt_capture: str, seed: int, num_tokens: int, salt: str):
    """(scheduler, driver, rng, request) on a 96-block pool once one request of ``num_tokens``
    random tokens (the ``seed``'s first draw) ran to its 8-token answer."""
    scheduler, worker = build_scheduler(model_dir, num_blocks=96, prompt_capture=prompt_capture)
    driver = Driver(scheduler, worker)
    rng = random.Random(seed)
    request = make_request(tokens(rng, num_tokens), salt=salt, max_tokens=8)
    driver.run([request])
    return scheduler, driver, rng, request


def capture_on_a_pool_of_cached_blocks(
    model_dir, reuse_distance: int | None, resend: str | None = None, elapsed: int = HORIZON_AT_DISTANCE_0
) -> tuple[int, int, int]:
    """(captures refused as thrashing, bundles published, ticks of the store's clock) after
    conversation C ran with every free block the pool hands out first a block of B's, cached (the
    uncached ones taken and held). C's prompt checkpoint (at P, the default) copies into new
    blocks; its response bundle adopts C's own blocks and takes none. ``resend``: C's prompt is
    then sent again, ``"longer"`` with other tokens after it (its prompt checkpoint would serve
    it) or ``"same"`` as it was, and the reuse distance must be known after it. ``elapsed``
    publications pass before C (by default B's blocks are then past the reuse horizon of
    ``reuse_distance`` 0)."""
    scheduler, driver, rng, b = after_one_request(model_dir, "end", seed=3, num_tokens=300, salt="b")
    store = scheduler.checkpoint_store
    store.retire(b.request_id)
    assert len(store) == 0
    if reuse_distance is not None:
        store.reuse.record_hit(store.reuse.clock - reuse_distance)
    for _ in range(elapsed):
        store.reuse.stamp()
    published, clock = store.counters.published, store.now()
    pool = scheduler.kv_cache_manager.block_pool
    pool.get_new_blocks(sum(1 for block in free_queue_order(pool) if block.block_hash is None))  # held
    assert all(block.block_hash is not None for block in free_queue_order(pool))
    prompt = tokens(rng, 40)
    driver.run([make_request(prompt, salt="c", max_tokens=8)])
    counts = store.counters.refused_thrashing, store.counters.published - published, store.now() - clock
    if resend:
        assert store.reuse.reuse_distance() == reuse_distance
        again = prompt + tokens(rng, 20) if resend == "longer" else prompt
        driver.run([make_request(again, salt="c", max_tokens=8)])
        assert store.reuse.reuse_distance() is not None
    return counts


def test_a_capture_that_would_evict_cached_blocks_is_refused_while_the_cache_thrashes(model_dir):
    refused, published, ticks = capture_on_a_pool_of_cached_blocks(model_dir, reuse_distance=1000)
    assert refused == 1 and published == 1  # the response bundle only
    assert ticks == 2  # the refusal counts on the store's clock, as a publication would


@pytest.mark.parametrize("resend", ["longer", "same"])
def test_before_any_reuse_the_capture_is_refused_and_its_resend_teaches_the_reuse_distance(model_dir, resend):
    refused, published, ticks = capture_on_a_pool_of_cached_blocks(model_dir, reuse_distance=None, resend=resend)
    assert refused == 1 and published == 1 and ticks == 2


def step_until_a_prompt_capture_waits(scheduler, driver, max_steps: int = 100) -> None:
    """Run steps until a prompt capture is planned whose copies wait for the next step."""
    for _ in range(max_steps):
        driver.step()
        if any(p.kind == PROMPT and p.ready_seq is None for p in scheduler._pending):
            return
    raise AssertionError("no prompt capture was planned")


def prompt_capture_pending_over_cached_blocks(model_dir, lookups_seen: int) -> tuple[int, int]:
    """(captures yielded, bundles published) after conversation C's prompt capture was planned on
    a pool whose free queue hands out B's cached blocks first, past the reuse horizon (reuse
    distance 0), and two blocks were allocated before the next step's copies ran (another
    request's allocation in that step), once the balance saw ``lookups_seen`` first lookups.
    Before ``SHARED_WINDOW`` lookups every cached block counts as a shared prefix: bundles, and
    so the pending capture, give way to it."""
    scheduler, driver, rng, b = after_one_request(model_dir, "end", seed=3, num_tokens=300, salt="b")
    store = scheduler.checkpoint_store
    store.retire(b.request_id)
    store.reuse.record_hit(store.reuse.clock)
    for _ in range(HORIZON_AT_DISTANCE_0):
        store.reuse.stamp()
    for _ in range(lookups_seen):
        scheduler._hit_balance.observe([], 16, stock_hit=0, served=0, max_tokens=0, horizon=0)
    pool = scheduler.kv_cache_manager.block_pool
    held = pool.get_new_blocks(sum(1 for block in free_queue_order(pool) if block.block_hash is None))
    c = make_request(tokens(rng, 40), salt="c", max_tokens=8)
    scheduler.add_request(c)
    published = store.counters.published
    step_until_a_prompt_capture_waits(scheduler, driver)
    pool.free_blocks(held[:1])  # one uncached block, then the cached ones
    pool.free_blocks(pool.get_new_blocks(2))
    driver.finish([c])
    return store.counters.captures_yielded, store.counters.published - published


def test_a_pending_prompt_capture_gives_way_where_bundles_do(model_dir):
    yielded, published = prompt_capture_pending_over_cached_blocks(model_dir, lookups_seen=0)
    assert yielded == 1 and published == 1  # the response bundle only


def test_past_the_horizon_a_pending_prompt_capture_stays_for_a_resend(model_dir):
    yielded, published = prompt_capture_pending_over_cached_blocks(model_dir, lookups_seen=SHARED_WINDOW)
    assert yielded == 0 and published == 2


def test_negative_control_a_capture_that_always_gives_way_is_lost_past_the_horizon(model_dir, monkeypatch):
    from boundary_checkpoints.core.yielding import YieldingMixin

    original = YieldingMixin._yield_to_cache

    def always_first(self, num_blocks):
        while self._cached_ahead(num_blocks) and self._yield_prompt_capture():
            pass
        original(self, num_blocks)

    monkeypatch.setattr(YieldingMixin, "_yield_to_cache", always_first)
    yielded, published = prompt_capture_pending_over_cached_blocks(model_dir, lookups_seen=SHARED_WINDOW)
    assert yielded == 1 and published == 1


def test_negative_control_the_same_capture_is_taken_without_thrashing(model_dir):
    refused, published, ticks = capture_on_a_pool_of_cached_blocks(model_dir, reuse_distance=0)
    assert refused == 0 and published == 2 and ticks == 2  # the prompt bundle too


def superset_check():
    """``benchmarks/superset_check.py``: stock and the plugin on one seeded workload."""
    return load_script("benchmarks/superset_check.py", "superset_check_under_test")


def stock_and_plugin(model_dir, argv: list[str], seed: int, blocks: int) -> tuple[list[int], list[int]]:
    """Cached tokens per request, stock and plugin, on ``superset_check``'s workload ``argv`` with
    ``seed`` on a pool of ``blocks``."""
    check = superset_check()
    args = check.parse_args(argv)
    stock, _ = check.cached_per_request(model_dir, "aligned", seed, blocks, args)
    plugin, _ = check.cached_per_request(model_dir, "request_boundaries", seed, blocks, args)
    return stock, plugin


def shared_prompt_workload(model_dir) -> tuple[list[int], list[int]]:
    """Cached tokens per request, stock and plugin: 16 conversations of 3 turns after a 200-token
    system prompt on a 60-block pool (``cpu-hit-balance.md``'s W4, seed 5). Its 20th request found
    the system prompt's state gone on the plugin's pool: one bundle's private blocks had pushed it
    out, being used more recently."""
    return stock_and_plugin(model_dir, ["--conversations", "16", "--system", "200"], seed=5, blocks=60)


def concurrent_rounds_workload(model_dir) -> tuple[list[int], list[int]]:
    """Cached tokens per request, stock and plugin: 16 conversations of 3 turns after a 30-token
    system prompt, 8 requests in flight, every turn k before any turn k + 1, 3 recurrent groups,
    a 220-block pool (``cpu-pressure-in-flight.md``'s workload, seed 1): the pressure stage's
    traffic at 24 layers of Qwen3-Next-80B dims on the GPU, scaled to 16-token blocks. Its third
    turns read chains freed more than one median reuse distance earlier."""
    argv = ["--conversations", "16", "--system", "30", "--user-tokens", "23,35", "--in-flight", "8",
            "--recurrent-groups", "3"]  # fmt: skip
    return stock_and_plugin(model_dir, argv, seed=1, blocks=220)


def test_with_requests_in_flight_bundles_cost_no_cached_tokens(model_dir):
    stock, plugin = concurrent_rounds_workload(model_dir)
    assert sum(plugin) >= sum(stock)


def test_negative_control_with_the_reuse_horizon_at_one_median_distance_cached_tokens_fall_below_stock(
    model_dir, monkeypatch
):
    from boundary_checkpoints.core.reuse import ReuseTracker

    monkeypatch.setattr(ReuseTracker, "reuse_horizon", ReuseTracker.reuse_distance)
    stock, plugin = concurrent_rounds_workload(model_dir)
    assert sum(plugin) < sum(stock)


def arriving_together_workload(model_dir) -> tuple[list[int], list[int]]:
    """Cached tokens per request, stock and plugin: the pressure stage's traffic as a GPU server
    runs it (async scheduling, prompts on a cached prefix started together, 1-token answers, equal
    user turns, so each turn's requests arrive 8 at once), 160 blocks, seed 5. Eight prompts ending
    in one step plan 8 prompt captures, whose private blocks stay taken until the next step's
    copies: that step's allocations evicted the chains of third turns stock still served."""
    argv = ["--conversations", "16", "--system", "30", "--user-tokens", "23,23", "--answer-tokens", "1",
            "--in-flight", "8", "--recurrent-groups", "3", "--together", "true", "--async-scheduling"]  # fmt: skip
    return stock_and_plugin(model_dir, argv, seed=5, blocks=160)


def test_prompt_captures_whose_copies_have_not_run_give_way_to_cached_blocks(model_dir):
    stock, plugin = arriving_together_workload(model_dir)
    assert sum(plugin) >= sum(stock)


def test_negative_control_prompt_captures_that_keep_their_blocks_cost_cached_tokens(model_dir, monkeypatch):
    from boundary_checkpoints.core.yielding import YieldingMixin

    monkeypatch.setattr(YieldingMixin, "_yield_prompt_capture", lambda self: False)
    stock, plugin = arriving_together_workload(model_dir)
    assert sum(plugin) < sum(stock)


def response_owners_after_a_yielded_prompt_capture(model_dir) -> tuple[set, tuple[str, str], int]:
    """(owners of turn 1's response bundle, turn ids, captures yielded) once turn 2, which restored
    from it, gave up its prompt capture before the copies ran and then finished (the default
    prompt capture: at the prompt's end, copied with the next step)."""
    scheduler, driver, rng, first = after_one_request(model_dir, "auto", seed=7, num_tokens=100, salt="a")
    store = scheduler.checkpoint_store
    [response] = [c for c in store.checkpoints() if c.kind == RESPONSE]
    history = list(first.prompt_token_ids) + list(first.output_token_ids)
    second = make_request(history + tokens(rng, 40), salt="a", max_tokens=8)
    scheduler.add_request(second)
    step_until_a_prompt_capture_waits(scheduler, driver)
    assert store.counters.hits == 1
    assert scheduler._yield_prompt_capture()
    driver.finish([second])
    return set(response.owners), (first.request_id, second.request_id), store.counters.captures_yielded


def test_a_yielded_prompt_capture_keeps_its_turn_s_lineage(model_dir):
    """Turn 2 kept no prompt checkpoint, so it owns the response it resumed from (a resend of its
    prompt restores there) and turn 1 no longer does."""
    owners, (first, second), yielded = response_owners_after_a_yielded_prompt_capture(model_dir)
    assert yielded == 1
    assert owners == {second}


def test_negative_control_a_yield_that_forgets_the_lineage_leaves_turn_1_the_owner(model_dir, monkeypatch):
    from boundary_checkpoints.core.capture import CaptureMixin

    discard = CaptureMixin._discard

    def forgetting(self, pending, dropped=True, keep_lineage=False):
        discard(self, pending, dropped)

    monkeypatch.setattr(CaptureMixin, "_discard", forgetting)
    owners, (first, second), _ = response_owners_after_a_yielded_prompt_capture(model_dir)
    assert owners == {first}


def test_bundles_leave_a_shared_system_prompt_cached(model_dir):
    stock, plugin = shared_prompt_workload(model_dir)
    assert all(mine >= theirs for mine, theirs in zip(plugin, stock, strict=True))


def test_the_reuse_horizon_alone_also_leaves_the_system_prompt_cached(model_dir, monkeypatch):
    from boundary_checkpoints.core.hit_balance import HitBalance

    monkeypatch.setattr(HitBalance, "shared_prefix", lambda self, block_hash: False)
    stock, plugin = shared_prompt_workload(model_dir)
    assert all(mine >= theirs for mine, theirs in zip(plugin, stock, strict=True))


def test_negative_control_without_the_shared_prefix_rule_a_request_loses_the_system_prompt(model_dir, monkeypatch):
    """Without the shared-prefix rule, and with the reuse horizon at one median reuse distance
    (the system prompt's state was freed longer ago than that, so that rule alone no longer
    spares it)."""
    from boundary_checkpoints.core.hit_balance import HitBalance
    from boundary_checkpoints.core.reuse import ReuseTracker

    monkeypatch.setattr(HitBalance, "shared_prefix", lambda self, block_hash: False)
    monkeypatch.setattr(ReuseTracker, "reuse_horizon", ReuseTracker.reuse_distance)
    stock, plugin = shared_prompt_workload(model_dir)
    assert [(i, theirs) for i, (mine, theirs) in enumerate(zip(plugin, stock, strict=True)) if mine < theirs] == [
        (19, 192)
    ]
