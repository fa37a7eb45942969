"""Real-traffic paths on vLLM's real scheduler (CPU, shadow runner): resets while captures are
pending, pressure relief that evicts only what frees blocks, the retention budget, branches of a
conversation (n > 1, edits), checkpoints no prompt can use, and miss reasons.

Every step runs against ``shadow_engine``'s runner, which raises if a restored request reads a
state or attention row that differs from the recomputed one.
"""

from __future__ import annotations

import random

import pytest
from shadow_scheduler import Driver, build_scheduler, free_blocks, make_request, tokens
from vllm.v1.request import RequestStatus

BLOCK = 16


def run_until(driver: Driver, condition, limit: int = 200) -> None:
    for _ in range(limit):
        if condition():
            return
        driver.step()
    raise AssertionError("condition never held")


# ---- reset while bundles are pending ----------------------------------------------------------


def _capture_planned(scheduler) -> bool:
    return any(p.ready_seq is None for p in scheduler._pending)


def _capture_emitted(scheduler) -> bool:
    return any(p.ready_seq is not None and p.kind == "prompt" for p in scheduler._pending)


def _response_adopted(scheduler) -> bool:
    return any(p.kind == "response" for p in scheduler._pending)


@pytest.mark.parametrize(
    "lag, moment",
    [(0, "planned"), (0, "published"), (1, "planned"), (1, "emitted"), (1, "adopted"), (1, "published")],
)
def test_reset_with_running_requests_at_every_point_of_a_capture(model_dir, lag, moment):
    """``reset_prefix_cache(reset_running_requests=True)`` (POST /reset_prefix_cache, pause and
    sleep) succeeds wherever a capture is in its life -- planned (copies not emitted), emitted
    (copy step, or the in-step capture's step, in flight), adopted response (finishing step in
    flight), published -- leaks nothing, and the preempted requests then finish with an
    undisturbed run's output. (Sync scheduling processes each step before the engine can reset,
    so the two in-flight moments exist only with async scheduling.)"""
    # Planned copies not yet emitted exist only where the prompt stops at P - 1 (in step, a capture
    # is planned and emitted by one schedule()); "emitted" and "published" run the in-step capture.
    prompt_capture = "stop" if moment == "planned" else "in_step"
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag), prompt_capture=prompt_capture)
    driver = Driver(scheduler, worker, lag=lag)
    rng = random.Random(100)
    total = free_blocks(scheduler)
    prompts = [tokens(rng, 40), tokens(rng, 23)]
    references = [Driver(*build_scheduler(model_dir)).run([make_request(p, max_tokens=m)])[0]
                  for p, m in zip(prompts, (8, 30))]  # fmt: skip
    a = make_request(prompts[0], salt="s")
    b = make_request(prompts[1], salt="s", max_tokens=30)
    for request in (a, b):
        scheduler.add_request(request)
    condition = {
        "planned": lambda: _capture_planned(scheduler),
        "emitted": lambda: _capture_emitted(scheduler),
        "adopted": lambda: _response_adopted(scheduler),
        "published": lambda: len(scheduler.checkpoint_store) > 0,
    }[moment]
    run_until(driver, condition)
    assert scheduler._pending or moment == "published"
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert len(scheduler.checkpoint_store) == 0 and not scheduler._pending
    assert driver.finish([a, b]) == references
    # After the reset, boundaries work again (a finished before the reset when its response was
    # adopted, so its prompt checkpoint went with the reset; its resend captures a new one).
    for _ in range(2):
        again = make_request(prompts[0], salt="s")
        driver.run([again])
    assert driver.cached_tokens[again.request_id] == len(prompts[0]) - 1
    scheduler.checkpoint_store.clear()
    assert free_blocks(scheduler) == total


def test_pause_abort_then_reset_succeeds(model_dir):
    """pause(mode="abort", clear_cache=True): abort every request, then reset with running
    requests, while a prompt capture's copy step is in flight (async)."""
    scheduler, worker = build_scheduler(model_dir, async_scheduling=True)
    driver = Driver(scheduler, worker, lag=1)
    rng = random.Random(101)
    total = free_blocks(scheduler)
    requests = [make_request(tokens(rng, n), salt="s", max_tokens=20) for n in (40, 17, 33)]
    for request in requests:
        scheduler.add_request(request)
    run_until(driver, lambda: _capture_emitted(scheduler))
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    driver.drain()
    assert len(scheduler.checkpoint_store) == 0
    assert free_blocks(scheduler) == total


# ---- pressure --------------------------------------------------------------------------------


def _fill_store(model_dir, conversations: int):
    scheduler, worker = build_scheduler(model_dir, num_blocks=64, max_retained_fraction=1.0, retention="hold")
    driver = Driver(scheduler, worker)
    rng = random.Random(102)
    for i in range(conversations):
        driver.run([make_request(tokens(rng, 40), salt=f"c{i}", max_tokens=4)])
    return scheduler, rng


def test_pressure_relief_evicts_only_bundles_that_free_blocks(model_dir):
    """A bundle whose every block a running request also holds frees nothing: it stays, and
    the bundles that do free blocks go, oldest first, one at a time until the allocation fits."""
    scheduler, rng = _fill_store(model_dir, 4)
    store, pool = scheduler.checkpoint_store, scheduler.kv_cache_manager.block_pool
    retained = len(store)
    oldest = next(store.policy.in_order())
    pool.touch(oldest.distinct_blocks())  # as if running requests shared all of its blocks
    hog = pool.get_new_blocks(pool.get_num_free_blocks())
    request = make_request(tokens(rng, 20), salt="new")
    assert scheduler.kv_cache_manager.allocate_slots(request, 20) is not None
    assert oldest in store.checkpoints()
    assert 0 < store.counters.evictions_pressure < retained - 1
    scheduler.kv_cache_manager.free(request)
    pool.free_blocks(hog)
    pool.free_blocks(oldest.distinct_blocks())


def test_pressure_relief_evicts_nothing_when_even_everything_would_not_fit(model_dir):
    """One unfittable allocation used to drop every bundle and still fail."""
    scheduler, rng = _fill_store(model_dir, 4)
    store, pool = scheduler.checkpoint_store, scheduler.kv_cache_manager.block_pool
    retained = len(store)
    hog = pool.get_new_blocks(pool.get_num_free_blocks())
    request = make_request(tokens(rng, 600), salt="huge")
    assert scheduler.kv_cache_manager.allocate_slots(request, 600) is None
    assert len(store) == retained and store.counters.evictions == 0
    pool.free_blocks(hog)


def test_pressure_relief_stops_once_the_allocation_fits(model_dir):
    scheduler, rng = _fill_store(model_dir, 6)
    store, pool = scheduler.checkpoint_store, scheduler.kv_cache_manager.block_pool
    retained = len(store)
    hog = pool.get_new_blocks(pool.get_num_free_blocks())
    request = make_request(tokens(rng, 20), salt="new")
    assert scheduler.kv_cache_manager.allocate_slots(request, 20) is not None
    assert 0 < store.counters.evictions_pressure < retained  # not everything
    assert len(store) == retained - store.counters.evictions_pressure
    scheduler.kv_cache_manager.free(request)
    pool.free_blocks(hog)


def test_a_deferred_recurrent_hit_is_no_shortage(model_dir):
    """vLLM answers "more blocks than the pool" to defer a recurrent hit on a block cached in
    the same step: that is no shortage, so nothing is evicted for it."""
    scheduler, rng = _fill_store(model_dir, 2)
    manager = scheduler.kv_cache_manager
    request = make_request(tokens(rng, 20), salt="new")
    assert manager.shortfall(request, manager.block_pool.num_gpu_blocks + 1, {}) is None
    free = manager.block_pool.get_num_free_blocks()
    assert manager.shortfall(request, free + 3, {"has_scheduled_reqs": False}) == 3


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_no_evictions_without_pressure(model_dir, lag):
    """A roomy pool, many concurrent conversations over several turns: nothing is evicted."""
    scheduler, worker = build_scheduler(model_dir, num_blocks=1024, async_scheduling=bool(lag), max_num_seqs=16)
    driver = Driver(scheduler, worker, lag=lag)
    rng = random.Random(104)
    prompts = [tokens(rng, rng.randrange(10, 60)) for _ in range(12)]
    for _turn in range(3):
        requests = [make_request(p, salt="s", max_tokens=5) for p in prompts]
        answers = driver.run(requests)
        prompts = [p + a + tokens(rng, 6) for p, a in zip(prompts, answers)]
    stats = scheduler.boundary_stats()
    assert stats["evictions"] == 0, stats
    assert stats["hits"] >= 24


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_same_step_duplicates_evict_nothing(model_dir, lag):
    """Two requests with one fresh prompt arrive together: vLLM defers the second one's
    recurrent hit on blocks the first caches in the same step by answering "no room". That is
    no pressure; the retained bundles of other conversations must stay."""
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    driver = Driver(scheduler, worker, lag=lag)
    rng = random.Random(111)
    for i in range(3):
        driver.run([make_request(tokens(rng, 40), salt=f"c{i}", max_tokens=4)])
    retained = len(scheduler.checkpoint_store)
    prompt = tokens(rng, 100)
    driver.run([make_request(prompt, salt="dup", max_tokens=4) for _ in range(2)])
    stats = scheduler.boundary_stats()
    assert stats["evictions"] == 0, stats
    assert len(scheduler.checkpoint_store) >= retained


def test_an_oversize_newcomer_is_refused_without_evicting_older_bundles(model_dir):
    # budget 0.04 * 256 = 10 blocks: a 40-token prompt bundle (3 pages + 2 states) fits, a
    # 150-token one (10 pages + 2 states) alone does not.
    scheduler, worker = build_scheduler(model_dir, max_retained_fraction=0.04)
    driver = Driver(scheduler, worker)
    rng = random.Random(105)
    small = tokens(rng, 40)
    driver.run([make_request(small, salt="s", max_tokens=1)])
    kept = {c.num_tokens for c in scheduler.checkpoint_store.checkpoints()}
    assert 39 in kept
    driver.run([make_request(tokens(rng, 150), salt="s", max_tokens=1)])
    stats = scheduler.boundary_stats()
    assert stats["refused_oversize"] >= 1
    assert kept <= {c.num_tokens for c in scheduler.checkpoint_store.checkpoints()}
    assert stats["evictions_budget"] == 0


# ---- branches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_capture", ["in_step", "stop"])
@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("lengths", [(3, 6), (6, 3)], ids=["owner-first", "owner-last"])
def test_every_live_branch_keeps_its_latest_turn(model_dir, lag, lengths, prompt_capture):
    """Two branches of one conversation (n > 1 siblings) share a prompt: the prompt checkpoint
    is deduplicated, so the second sibling keeps none of its own. Whichever finishes first, each
    branch's next turn must still restore its own fresh response. (Before: when the sibling
    without a prompt checkpoint finished first, it took over turn 1's response under its own
    name, and the other sibling's retirement of turn 1 then dropped its fresh response.)"""
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag), prompt_capture=prompt_capture)
    driver = Driver(scheduler, worker, lag=lag)
    rng = random.Random(106)
    prompt = tokens(rng, 30)
    [answer] = driver.run([make_request(prompt, salt="s", max_tokens=4)])
    turn2 = prompt + answer + tokens(rng, 5)
    # Two siblings of turn 2 with different lengths (like n=2 with different stops).
    siblings = [make_request(turn2, salt="s", max_tokens=n) for n in lengths]
    sibling_answers = driver.run(siblings)
    for sibling in siblings:
        assert driver.cached_tokens[sibling.request_id] == len(prompt) + len(answer) - 1
    # Each branch continues; both restore their own response boundary.
    for sibling_answer in sibling_answers:
        turn3 = make_request(turn2 + sibling_answer + tokens(rng, 4), salt="s")
        driver.run([turn3])
        assert driver.cached_tokens[turn3.request_id] == len(turn2) + len(sibling_answer) - 1
    # Memory stays bounded: nothing of turn 1 is left.
    assert all(c.num_tokens > len(prompt) + len(answer) - 1 for c in scheduler.checkpoint_store.checkpoints())


def test_sequential_edits_of_a_turn_each_restore(model_dir):
    """A user edits turn 2 twice: both edits restore turn 1's response while it is the live
    branch point; the first edit's continuation keeps hitting afterwards."""
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    rng = random.Random(107)
    prompt = tokens(rng, 30)
    [answer] = driver.run([make_request(prompt, salt="s", max_tokens=4)])
    boundary = len(prompt) + len(answer) - 1
    edit_a, edit_b = (prompt + answer + tokens(rng, 5) for _ in range(2))
    ra, rb = make_request(edit_a, salt="s", max_tokens=4), make_request(edit_b, salt="s", max_tokens=4)
    [answer_a, answer_b] = driver.run([ra, rb])  # concurrent edits
    assert driver.cached_tokens[ra.request_id] == boundary == driver.cached_tokens[rb.request_id]
    for edit, edit_answer in ((edit_a, answer_a), (edit_b, answer_b)):
        nxt = make_request(edit + edit_answer + tokens(rng, 3), salt="s")
        driver.run([nxt])
        assert driver.cached_tokens[nxt.request_id] == len(edit) + len(edit_answer) - 1


# ---- unusable boundaries, misses --------------------------------------------------------------


def test_no_checkpoint_at_max_model_len_minus_one(model_dir):
    scheduler, worker = build_scheduler(model_dir, max_model_len=64)
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(108), 40)
    request = make_request(prompt, max_tokens=100)  # capped by max_model_len: 64 tokens in all
    driver.run([request])
    assert request.num_tokens == 64
    assert {c.num_tokens for c in scheduler.checkpoint_store.checkpoints()} == {39}


def test_misses_are_counted_with_their_reason(model_dir):
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    rng = random.Random(109)
    prompt = tokens(rng, 40)
    driver.run([make_request(prompt, salt="s")])  # nothing retained yet
    edited = prompt[:35] + tokens(rng, 10)  # parts from the prompt checkpoint inside its last block
    driver.run([make_request(edited, salt="s")])
    unrelated = tokens(rng, 40)
    driver.run([make_request(unrelated, salt="other")])
    stats = scheduler.boundary_stats()
    assert stats["miss_no_checkpoint"] == 2
    assert stats["miss_diverged"] == 1
    assert stats["misses"] == 3


def test_an_aborted_response_is_counted(model_dir):
    """Stop strings end a request by an abort from the frontend: no response checkpoint, counted."""
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    request = make_request(tokens(random.Random(110), 20), salt="s", max_tokens=50)
    scheduler.add_request(request)
    run_until(driver, lambda: request.num_output_tokens >= 3)
    scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
    driver.step()
    driver.drain()
    stats = scheduler.boundary_stats()
    assert stats["responses_aborted"] == 1
    assert {c.kind for c in scheduler.checkpoint_store.checkpoints()} == {"prompt"}


# ---- a cyclic workload larger than the budget ----------------------------------------------------


def cyclic_exact_hits(model_dir, protect: bool, conversations: int = 12, turns: int = 5) -> tuple[int, int]:
    """Round-robin turns of ``conversations`` (each comes back after all the others), a retention
    budget that holds the bundles of only a few of them: (exact boundary hits, later turns)."""
    scheduler, worker = build_scheduler(model_dir, num_blocks=256, max_retained_fraction=0.2, retention="hold")
    if not protect:  # the negative control: plain least-recently-used eviction
        scheduler.checkpoint_store.reuse.protects = lambda published_at, publications_ahead=0: False
    driver = Driver(scheduler, worker)
    rng = random.Random(112)
    prompts = [tokens(rng, 40) for _ in range(conversations)]
    boundaries = [0] * conversations
    exact = 0
    for turn in range(turns):
        for i in range(conversations):
            request = make_request(prompts[i], salt=f"c{i}", max_tokens=4)
            [answer] = driver.run([request])
            exact += turn > 0 and driver.cached_tokens[request.request_id] == boundaries[i]
            boundaries[i] = len(prompts[i]) + len(answer) - 1
            prompts[i] = prompts[i] + answer + tokens(rng, 6)
    return exact, conversations * (turns - 1)


def test_a_cyclic_workload_larger_than_the_budget_keeps_a_stable_subset(model_dir):
    """LRU evicts every bundle just before its next turn (0 exact hits, as on a GPU under
    pressure); once misses show that evicted bundles were wanted (regrets), young bundles are
    protected and a stable subset of conversations hits every turn."""
    lru_hits, later_turns = cyclic_exact_hits(model_dir, protect=False)
    protected_hits, _ = cyclic_exact_hits(model_dir, protect=True)
    assert lru_hits == 0, lru_hits
    assert protected_hits >= later_turns // 6, (protected_hits, later_turns)  # 13 of 48 measured
