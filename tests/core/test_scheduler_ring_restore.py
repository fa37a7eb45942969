"""The GLM indexer tail ring on vLLM's real scheduler without speculative decoding (CPU, shadow
runner; ``docs/design.md`` contracts 11 and 12): exact restores on and off the pool grid, the ring
copies of capture and restore, the step cuts around the open pool, and pool-grid snapshots (where
they are kept, their room, giving them back under pressure). The layout (``ring_engine.py``): an
attention group, two recurrent groups and a ``CircularBufferSpec`` ring group of ``kpool`` slots.

The shadow worker keeps, per ring block, the tokens of the pool in progress, and refuses a step that
starts off the pool grid unless its ring holds exactly those tokens and, if the step completes the
open pool, it is one (decode) token (``tests/helpers/shadow_engine.py``). So every boundary restore
below, at ``N`` on or off the grid, passes only if the capture copied the producer's ring at ``N``,
the restore copied it into the consumer's own fresh ring block, and the consumer's first prefill
step stopped before the open pool's last token, which then ran alone. The negative controls take
each of the two away and see the shadow worker object.

By default a response checkpoint sits on the pool grid below the committed length, its recurrent
state from the producer's pool-grid snapshot (contract 12); the tests of the off-grid path turn the
snapshots off (``pool_grid_snapshots=False``). The shadow worker checks every restored state
against the token prefix, so a snapshot of the wrong step is a mismatch. Under speculative decoding
(``test_scheduler_ring_spec.py``) no snapshot is taken.
"""

from __future__ import annotations

import random

import pytest
from ring_engine import ACCEPT, KPOOL, RING, recorded_steps, restore_rounds, ring_scheduler, spec_ring_engine
from shadow_engine import ShadowMismatch
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.core.group_kinds import GroupKind
from boundary_checkpoints.core.hit_balance import SHARED_WINDOW
from boundary_checkpoints.core.layout import describe_layout
from boundary_checkpoints.core.step_copies import POST_FORWARD_COPIES_ATTR


def test_layout_is_accepted_with_the_pool_size(model_dir):
    scheduler, _ = ring_scheduler(model_dir)
    assert scheduler.boundaries_active
    kinds = [GroupKind.ATTENTION, GroupKind.RECURRENT, GroupKind.RECURRENT, GroupKind.RING]
    assert [g.kind for g in scheduler._geometries] == kinds
    assert scheduler._kpool == KPOOL


def on_pool_grid(committed: int) -> int:
    return committed // KPOOL * KPOOL


@pytest.mark.parametrize("snapshots", [True, False], ids=["pool-grid", "committed"])
@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_boundaries_restore_exactly_on_and_off_the_pool_grid(model_dir, lag, snapshots):
    scheduler, worker = ring_scheduler(model_dir, async_scheduling=bool(lag), pool_grid_snapshots=snapshots)
    driver = Driver(scheduler, worker, lag=lag)
    # P - 1 and P + answer on and off the grid of 4; without drafts every next turn restores its
    # response boundary: the pool boundary below the committed length from a snapshot, else that length
    restore_rounds(
        driver, random.Random(lag), (5, 8, 15, 16, 17, 30, 45), new_tokens=23,
        response_at=on_pool_grid if snapshots else (lambda committed: committed),
    )  # fmt: skip
    assert worker.restored_reads > 0
    counters = scheduler.checkpoint_store.counters
    assert (counters.responses_on_pool_grid > 0) == snapshots
    assert scheduler.boundary_stats()["snapshot_blocks"] == 0  # none outlives its request


def test_capture_and_restore_copy_the_ring_and_steps_stay_on_the_grid(model_dir):
    """Prompt of 22: capture at P - 1 = 21 (off the grid, a pool or more past the block boundary
    16) copies the producer's ring block in the step that copies its recurrent state; the resend's
    admitting step copies that bundle block into the resend's own new ring block (a fresh block
    vLLM never restores; the plugin's worker drops a copy destination from the blocks it zeroes);
    the resend then computes 1 token (21 -> 22). The next turn restores at the committed length 29
    (22 + 8 - 1; no pool-grid snapshots), prefills 2 tokens and runs the open pool's last token
    alone to the pool boundary 32; from there the plugin stops at P - 1 = 41 and the last prompt
    token runs alone."""
    scheduler, worker = ring_scheduler(model_dir, pool_grid_snapshots=False)
    outputs = recorded_steps(scheduler)
    driver = Driver(scheduler, worker)
    rng = random.Random(3)
    prompt = tokens(rng, 22)
    producer = make_request(prompt, salt="s")
    [answer] = driver.run([producer])
    captures = [getattr(o, "boundary_capture_copies", None) for o in outputs]
    [capture] = [c for c in captures if c]
    assert len(capture) == 4  # in group order: the attention tail page, two recurrent states, the ring
    ring_capture = capture[RING]
    resend = make_request(prompt, salt="s")
    scheduler.add_request(resend)
    driver.step()
    admitted = outputs[-1]
    ring_block = scheduler.kv_cache_manager.coordinator.single_type_managers[RING].req_to_blocks[resend.request_id][0]
    ring_copies = [c for c in admitted.kv_cache_block_copies or () if c.dst_block_id == ring_block.block_id]
    assert [(c.src_block_id, c.dst_block_id) for c in ring_copies] == [(ring_capture[1], ring_block.block_id)]
    driver.finish([resend])

    follow_up = prompt + answer + tokens(rng, 12)
    nxt = make_request(follow_up, salt="s")
    first = len(outputs)
    driver.run([nxt])
    steps = [o.num_scheduled_tokens.get(nxt.request_id) for o in outputs[first:]]
    steps = [step for step in steps if step]
    n = len(prompt) + len(answer) - 1
    assert driver.cached_tokens[nxt.request_id] == n == 29
    assert len(follow_up) == 42 and steps[:4] == [2, 1, 9, 1]


def test_without_the_ring_copy_a_restore_off_the_grid_reads_a_fresh_ring(model_dir, monkeypatch):
    scheduler, worker = ring_scheduler(model_dir)
    monkeypatch.setattr(scheduler, "_copy_restored_rings", lambda output: setattr(scheduler, "_ring_restores", {}))
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(5), 22)
    driver.run([make_request(prompt, salt="s")])
    with pytest.raises(ShadowMismatch, match="ring group 3 at 21 is wrong"):
        driver.run([make_request(prompt, salt="s")])


def test_without_the_grid_rule_a_next_turn_prefills_across_the_open_pool(model_dir, monkeypatch):
    scheduler, worker = ring_scheduler(model_dir, pool_grid_snapshots=False)
    monkeypatch.setattr(scheduler, "_kpool", None)
    driver = Driver(scheduler, worker)
    rng = random.Random(6)
    prompt = tokens(rng, 18)
    [answer] = driver.run([make_request(prompt, salt="s")])
    with pytest.raises(ShadowMismatch, match="a 7-token step from 25 completes the open pool"):
        driver.run([make_request(prompt + answer + tokens(rng, 12), salt="s")])


def test_a_prefill_that_takes_the_open_pools_last_token_is_caught(model_dir, monkeypatch):
    """The first step after a restore off the grid stops one token short of the pool boundary: one
    token more would run the pool's completion on the indexer's prefill path."""
    scheduler, worker = ring_scheduler(model_dir, pool_grid_snapshots=False)
    step = scheduler._open_pool_step
    monkeypatch.setattr(scheduler, "_open_pool_step", lambda start: step(start) + 1)
    driver = Driver(scheduler, worker)
    rng = random.Random(6)
    prompt = tokens(rng, 18)
    [answer] = driver.run([make_request(prompt, salt="s")])
    with pytest.raises(ShadowMismatch, match="a 3-token step from 25 completes the open pool"):
        driver.run([make_request(prompt + answer + tokens(rng, 12), salt="s")])


def next_turn_steps(scheduler, driver, rng, prompt_tokens: int = 18, answer_tokens: int = 8) -> tuple[int, list[int]]:
    """(cached tokens, step sizes) of the next turn of a conversation: by default prompt 18,
    answer 8 (committed 25), 12 more tokens (38)."""
    outputs = recorded_steps(scheduler)
    prompt = tokens(rng, prompt_tokens)
    [answer] = driver.run([make_request(prompt, salt="s", max_tokens=answer_tokens)])
    follow_up = prompt + answer + tokens(rng, 12)
    nxt, cold = make_request(follow_up, salt="s"), make_request(follow_up, salt="cold")
    first = len(outputs)
    assert driver.run([nxt]) == driver.run([cold])
    steps = [o.num_scheduled_tokens.get(nxt.request_id) for o in outputs[first:]]
    return driver.cached_tokens[nxt.request_id], [step for step in steps if step]


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_a_next_turn_restores_on_the_pool_grid_and_prefills_in_one_step(model_dir, lag):
    """The producer's decode steps that end on the pool grid (20, 24) copy its recurrent states
    into its snapshot after their forward; it finishes at 25 and its response bundle sits at 24,
    with the snapshot's states. The next turn restores 24 and prefills from the grid: vLLM's
    block-aligned split to 32, the stop at P - 1 = 37, the last token (no one-token pool step)."""
    scheduler, worker = ring_scheduler(model_dir, async_scheduling=bool(lag))
    cached, steps = next_turn_steps(scheduler, Driver(scheduler, worker, lag=lag), random.Random(6))
    assert cached == 24 and steps[:3] == [8, 5, 1]
    counters = scheduler.checkpoint_store.counters
    assert counters.responses_on_pool_grid >= 1 and counters.pool_snapshot_copies >= 4  # 2 groups x 2 crossings
    assert scheduler.boundary_stats()["snapshot_blocks"] == 0


def test_a_snapshot_copied_one_step_late_is_caught(model_dir, monkeypatch):
    """Negative control: the snapshot copies ride the step after the crossing, so the bundle keyed
    24 holds the state after 25 (the same state block): the next turn reads a wrong state."""
    scheduler, worker = ring_scheduler(model_dir)
    attach, held = scheduler._attach_snapshot_copies, []

    def one_step_late(output):
        before = list(getattr(output, POST_FORWARD_COPIES_ATTR, None) or ())
        attach(output)
        now = list(getattr(output, POST_FORWARD_COPIES_ATTR, None) or ())[len(before) :]
        setattr(output, POST_FORWARD_COPIES_ATTR, before + held)
        held[:] = now

    monkeypatch.setattr(scheduler, "_attach_snapshot_copies", one_step_late)
    with pytest.raises(ShadowMismatch, match="recurrent group 1 state at 24 is wrong"):
        next_turn_steps(scheduler, Driver(scheduler, worker), random.Random(6))


def test_without_room_for_a_snapshot_the_response_stays_at_the_committed_length(model_dir, monkeypatch):
    """No room for a snapshot: the next turn restores the committed length 25 and takes the two
    pool steps."""
    scheduler, worker = ring_scheduler(model_dir)
    monkeypatch.setattr(scheduler._pool_snapshots, "_room", lambda num_blocks: False)
    cached, steps = next_turn_steps(scheduler, Driver(scheduler, worker), random.Random(6))
    assert cached == 25 and steps[:5] == [2, 1, 4, 5, 1]
    assert scheduler.checkpoint_store.counters.pool_snapshot_copies == 0


def test_snapshots_take_no_cached_block_and_stay_within_the_budget_size(model_dir):
    """Room for snapshot blocks: the pool's next free blocks hold none of vLLM's cached blocks,
    vLLM's admission watermark stays free, and all snapshots together stay within
    ``max_retained_fraction`` of the pool (not what bundles leave of it: a store full to its
    budget does not crowd snapshots out)."""
    from boundary_checkpoints.compat import free_queue_order

    scheduler, worker = ring_scheduler(model_dir)
    store = scheduler.checkpoint_store
    assert scheduler._snapshot_room(store.max_blocks) and not scheduler._snapshot_room(store.max_blocks + 1)
    store.max_blocks = 10**6  # vLLM's admission watermark decides
    scheduler.kv_cache_manager.watermark_blocks = 5  # vLLM's 1% of this 256-block pool rounds to 0
    spare = scheduler._block_pool.get_num_free_blocks() - 5
    assert scheduler._snapshot_room(spare) and not scheduler._snapshot_room(spare + 1)
    store.max_blocks, scheduler.kv_cache_manager.watermark_blocks = 128, 0
    Driver(scheduler, worker).run([make_request(tokens(random.Random(9), 40), salt="s")])
    store.max_blocks = 10**6  # the cached blocks decide below
    free = list(free_queue_order(scheduler._block_pool))
    uncached = next(i for i, block in enumerate(free) if block.block_hash is not None)
    assert scheduler._snapshot_room(uncached) and not scheduler._snapshot_room(uncached + 1)


def decode_until_a_snapshot(scheduler, driver, rng):
    """A request of 18 prompt tokens and 30 answer tokens, stepped until it holds a snapshot."""
    decoding = make_request(tokens(rng, 18), max_tokens=30, salt="s")
    scheduler.add_request(decoding)
    while scheduler.boundary_stats()["snapshot_blocks"] == 0:
        driver.step()
    return decoding


def test_pressure_gives_snapshots_back_before_any_bundle(model_dir):
    """While a request decodes with a snapshot, an allocation short of blocks takes the snapshot's
    blocks first; the retained bundles stay."""
    scheduler, worker = ring_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    rng = random.Random(7)
    driver.run([make_request(tokens(rng, 18), salt="s")])
    decoding = decode_until_a_snapshot(scheduler, driver, rng)
    retained = len(scheduler.checkpoint_store)
    assert scheduler._relieve_pressure(1)
    assert scheduler.boundary_stats()["snapshot_blocks"] == 0 and len(scheduler.checkpoint_store) == retained
    assert scheduler.checkpoint_store.counters.pool_snapshots_released == 1
    driver.finish([decoding])
    assert scheduler.boundary_stats()["snapshot_blocks"] == 0


def test_new_blocks_that_would_evict_cached_blocks_take_a_snapshots_blocks_first(model_dir):
    """Under retention ``borrow``: before vLLM hands out a block of its prefix cache, a snapshot
    gives its (uncached) blocks back, and they are handed out instead."""
    from boundary_checkpoints.compat import free_queue_order

    scheduler, worker = ring_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    rng = random.Random(8)
    driver.run([make_request(tokens(rng, 40), salt="s")])  # its pages stay in vLLM's cache, freed
    decoding = decode_until_a_snapshot(scheduler, driver, rng)
    pool = scheduler._block_pool
    free = list(free_queue_order(pool))
    cached = {block.block_id for block in free if block.block_hash is not None}
    uncached = next(i for i, block in enumerate(free) if block.block_hash is not None)
    taken = pool.get_new_blocks(uncached + 1)  # one more than the uncached head holds
    assert scheduler.boundary_stats()["snapshot_blocks"] == 0
    assert scheduler.checkpoint_store.counters.pool_snapshots_released == 1
    assert not cached & {block.block_id for block in taken}  # no cached block was taken
    pool.free_blocks(taken)
    driver.finish([decoding])


def test_no_snapshots_under_mtp_or_when_turned_off(model_dir):
    scheduler, _, _ = spec_ring_engine(model_dir, 1, ACCEPT["all"](1))
    assert scheduler._pool_snapshots is None
    assert "checkpoints only on the indexer's 4-token pool grid under speculative decoding" in (
        scheduler._pool_grid_line()
    )
    scheduler, _ = ring_scheduler(model_dir, pool_grid_snapshots=False)
    assert scheduler._pool_snapshots is None
    assert "(pool_grid_snapshots off" in scheduler._pool_grid_line()


def test_a_ring_of_another_size_is_not_restorable(model_dir):
    """A ring of more slots than vLLM sizes without speculation falls back, naming why."""
    scheduler, _ = build_scheduler(model_dir, ring_kpool=KPOOL, ring_slots=2 * KPOOL, policy="auto")
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    _, reasons = describe_layout(scheduler.kv_cache_config, managers, kpool=KPOOL)
    assert not scheduler.boundaries_active
    assert reasons == [
        "GLM indexer tail ring (1 layers, 8 slots, CircularBufferManager) is not the ring of 4 slots vLLM sizes for "
        "a pool of 4 tokens and 0 draft tokens: vLLM gives a restored request a fresh ring, so a restore off the "
        "kpool grid would compress its open pool from keys it never wrote (docs/notes/model-families.md 6.1-6.2)"
    ]


def test_plan_bundle_takes_the_ring_block_whole():
    """A ring group's bundle is its one block whatever N is; a request without one plans nothing."""
    from dataclasses import dataclass

    from boundary_checkpoints.core.boundaries import plan_bundle
    from boundary_checkpoints.core.group_kinds import RecurrentGroup, RingGroup

    @dataclass(frozen=True)
    class Block:
        block_id: int
        is_null: bool = False

    null = Block(0, is_null=True)
    geometries = [RecurrentGroup(16, 1), RingGroup(KPOOL, 1)]
    for n in (1, 4, 17, 32):
        plan = plan_bundle(geometries, [[Block(1), Block(2), Block(3)], [Block(9)]], n, null)
        assert plan.sources == (Block(1 + (n - 1) // 16), Block(9)) and plan.shared[1] == ()
        assert plan.group_blocks([Block(20), Block(21)])[1] == (Block(21),)
    assert plan_bundle(geometries, [[Block(1)], []], 3, null) is None
    assert plan_bundle(geometries, [[Block(1)], [null]], 3, null) is None


def pressure_run(model_dir, snapshots: bool, num_blocks: int = 96) -> tuple[int, int, list, dict]:
    """(preemptions, cached tokens, answers, counters) of 8 conversations of 3 turns (40-120
    token prompts, 10-40 more tokens a turn, 10-30 token answers), each turn's requests at once,
    on a pool of ``num_blocks`` blocks that chunked prefills run dry. The hit balance has seen
    ``SHARED_WINDOW`` lookups already (bundles past the first lookups' yielding to every cached
    block, as on a server that ran a while): 24 requests would otherwise all fall in it."""
    scheduler, worker = ring_scheduler(
        model_dir, num_blocks=num_blocks, pool_grid_snapshots=snapshots, scheduler_reserve_full_isl=False
    )
    for _ in range(SHARED_WINDOW):
        scheduler._hit_balance.observe([], 16, stock_hit=0, served=0, max_tokens=0, horizon=0)
    preempted = []
    preempt = scheduler._preempt_request

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting
    driver = Driver(scheduler, worker)
    rng = random.Random(1)
    conversations = [tokens(rng, rng.randrange(40, 120)) for _ in range(8)]
    cached, answers = 0, []
    for _ in range(3):
        requests = [
            make_request(c, salt=f"c{i}", max_tokens=rng.randrange(10, 30)) for i, c in enumerate(conversations)
        ]
        outputs = driver.run(requests)
        answers.append(outputs)
        cached += sum(driver.cached_tokens[r.request_id] for r in requests)
        conversations = [c + o + tokens(rng, rng.randrange(10, 40)) for c, o in zip(conversations, outputs)]
    return len(preempted), cached, answers, scheduler.checkpoint_store.counters.as_dict()


def test_under_pressure_snapshots_go_back_first_and_cost_no_preemption(model_dir):
    """A pool that preempts: snapshots are given back (``pool_snapshots_released``) and the run
    preempts exactly as often as without snapshots, with the same answers (the shadow checks every
    restored state), caching at most the pool offsets (< 4 tokens per pool-grid response) less."""
    with_snapshots = pressure_run(model_dir, snapshots=True)
    without = pressure_run(model_dir, snapshots=False)
    preemptions, cached, answers, counters = with_snapshots
    assert preemptions > 0 and counters["pool_snapshots_released"] > 0 and counters["responses_on_pool_grid"] > 0
    assert preemptions == without[0] and answers == without[2]
    assert without[1] - (KPOOL - 1) * counters["responses_on_pool_grid"] <= cached <= without[1]


def test_a_prefix_cache_reset_gives_every_snapshot_back(model_dir):
    scheduler, worker = ring_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    decoding = decode_until_a_snapshot(scheduler, driver, random.Random(13))
    scheduler.reset_prefix_cache()  # vLLM refuses while a request runs; the snapshots go anyway
    assert scheduler.boundary_stats()["snapshot_blocks"] == 0
    driver.finish([decoding])


def within_a_pool_next_turn(scheduler, driver) -> tuple[int, list[int]]:
    """The next turn of a conversation whose response ends 2 tokens past its prompt's block
    boundary 32: prompt 33, answer 2 (committed 34), 12 more tokens (47)."""
    return next_turn_steps(scheduler, driver, random.Random(7), prompt_tokens=33, answer_tokens=2)


def test_a_boundary_less_than_a_pool_past_vllms_state_keeps_no_bundle(model_dir, monkeypatch):
    """Contract 11: a response ending at 34, two tokens past the block boundary 32 where vLLM's
    cache keeps its prompt's state, keeps no bundle (``responses_within_a_pool``; nor does its
    prompt's P - 1 = 32, vLLM's own): the next turn takes vLLM's hit at 32 and prefills from the
    grid (the stop at P - 1 = 46, the last token), where a restore at 34 runs the open pool in two
    steps of its own first. Negative control: with the rule taken away the bundle is kept and
    restored, two tokens further and two steps longer."""
    scheduler, worker = ring_scheduler(model_dir, pool_grid_snapshots=False)
    cached, steps = within_a_pool_next_turn(scheduler, Driver(scheduler, worker))
    assert (cached, steps[:2]) == (32, [14, 1])
    assert scheduler.checkpoint_store.counters.responses_within_a_pool == 1

    scheduler, worker = ring_scheduler(model_dir, pool_grid_snapshots=False)
    monkeypatch.setattr(scheduler, "_reaches_a_pool_past", lambda num_tokens, vllm_hit: True)
    cached, steps = within_a_pool_next_turn(scheduler, Driver(scheduler, worker))
    assert (cached, steps[:4]) == (34, [1, 1, 10, 1])


def test_a_lookup_less_than_a_pool_past_vllms_hit_takes_vllms(model_dir, monkeypatch):
    """A bundle at 34 kept while the rule was away (as a policy change could leave one) is not
    restored over vLLM's hit at 32: the lookup counts ``within_a_pool``."""
    from boundary_checkpoints.core.kinds import MissReason

    scheduler, worker = ring_scheduler(model_dir, pool_grid_snapshots=False)
    keep_all = {"on": True}
    rule = scheduler._reaches_a_pool_past
    monkeypatch.setattr(
        scheduler, "_reaches_a_pool_past", lambda num_tokens, vllm_hit: keep_all["on"] or rule(num_tokens, vllm_hit)
    )
    driver = Driver(scheduler, worker)
    rng = random.Random(7)
    prompt = tokens(rng, 33)
    [answer] = driver.run([make_request(prompt, salt="s", max_tokens=2)])
    keep_all["on"] = False
    follow_up = prompt + answer + tokens(rng, 12)
    nxt, cold = make_request(follow_up, salt="s"), make_request(follow_up, salt="cold")
    assert driver.run([nxt]) == driver.run([cold])
    assert driver.cached_tokens[nxt.request_id] == 32
    assert scheduler.checkpoint_store.counters.misses_by_reason[MissReason.WITHIN_A_POOL] == 1
