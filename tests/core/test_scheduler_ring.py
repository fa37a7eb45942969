"""The GLM indexer tail ring on vLLM's real scheduler (CPU, shadow runner): a KV cache layout with
an attention group, two recurrent groups and a ``CircularBufferSpec`` ring group of ``kpool``
slots (``docs/design.md`` contracts 11 and 12).

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
against the token prefix, so a snapshot of the wrong step is a mismatch.

Under speculative decoding every checkpoint sits on the pool grid (contract 13), under MTP and, with
the same prompt checkpoints, under DFlash.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from dflash_shadow import write_drafter_config
from shadow_engine import Driver, ShadowMismatch, build_scheduler, make_request, tokens
from spec_shadow import SpecDriver, SpecShadowWorker

from boundary_checkpoints.core import layout
from boundary_checkpoints.core.boundaries import restore_tail
from boundary_checkpoints.core.group_kinds import GroupKind
from boundary_checkpoints.core.hit_balance import SHARED_WINDOW
from boundary_checkpoints.core.kinds import MissReason
from boundary_checkpoints.core.layout import describe_layout
from boundary_checkpoints.core.step_copies import POST_FORWARD_COPIES_ATTR
from boundary_checkpoints.settings import BoundaryConfigError

KPOOL = 4
RING = 3  # the ring group's index: attention, two recurrent groups, ring


def ring_scheduler(model_dir, **kwargs):
    kwargs = dict(dict(ring_kpool=KPOOL, max_num_batched_tokens=64, max_model_len=1024), **kwargs)
    return build_scheduler(model_dir, **kwargs)


def recorded_steps(scheduler) -> list:
    """Every ``SchedulerOutput`` the scheduler returns, in order."""
    outputs = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        outputs.append(schedule(*args, **kwargs))
        return outputs[-1]

    scheduler.schedule = recording_schedule
    return outputs


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
    """Prompt of 18: capture at P - 1 = 17 (off the grid) copies the producer's ring block in the
    step that copies its recurrent state; the resend's admitting step copies that bundle block into
    the resend's own new ring block (a fresh block vLLM never restores; the plugin's worker drops a
    copy destination from the blocks it zeroes); the resend then computes 1 token (17 -> 18). The next turn
    restores at the committed length 25 (18 + 8 - 1; no pool-grid snapshots), prefills 2 tokens and
    runs the open pool's last token alone to the pool boundary 28; from there vLLM's block-aligned
    split (block 16) runs to 32, the plugin stops at P - 1 = 37 and the last prompt token runs alone."""
    scheduler, worker = ring_scheduler(model_dir, pool_grid_snapshots=False)
    outputs = recorded_steps(scheduler)
    driver = Driver(scheduler, worker)
    rng = random.Random(3)
    prompt = tokens(rng, 18)
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
    assert driver.cached_tokens[nxt.request_id] == n == 25
    assert len(follow_up) == 38 and steps[:5] == [2, 1, 4, 5, 1]


def test_without_the_ring_copy_a_restore_off_the_grid_reads_a_fresh_ring(model_dir, monkeypatch):
    scheduler, worker = ring_scheduler(model_dir)
    monkeypatch.setattr(scheduler, "_copy_restored_rings", lambda output: setattr(scheduler, "_ring_restores", {}))
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(5), 18)
    driver.run([make_request(prompt, salt="s")])
    with pytest.raises(ShadowMismatch, match="ring group 3 at 17 is wrong"):
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


def next_turn_steps(scheduler, driver, rng) -> tuple[int, list[int]]:
    """(cached tokens, step sizes) of the next turn of a conversation: prompt 18, answer 8
    (committed 25), 12 more tokens (38)."""
    outputs = recorded_steps(scheduler)
    prompt = tokens(rng, 18)
    [answer] = driver.run([make_request(prompt, salt="s")])
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


# ---- under MTP: the lookahead ring (docs/notes/model-families.md §10) ---------------------------
SLOTS = 8  # vLLM's ring for a pool of 4 at k = 1..3: 4 * next_pow2(cdiv(4 + k, 4))
# A fresh prompt's checkpoint under contract 13, by k, worked out by hand. vLLM (block 16, MTP's block
# drop) prefills a prompt of up to 31 tokens in one chunk, and a chunk that starts inside a block it
# ends at the next boundary. So a stop at g leaves the rows [0, g) and [g, min(16 * ceil(g / 16), P))
# and, where that ends below P, [16, P): each must be longer than a verify row (k + 2 tokens or more)
# or one vLLM runs anyway. E.g. k = 3, P = 20: a stop at 16 leaves 4 tokens, one at 8 or 12 adds the
# row [16, 20), which vLLM would not run: no checkpoint.
GRID_RESENDS = {
    1: {5: 0, 8: 4, 13: 8, 15: 12, 16: 12, 17: 0, 20: 16, 22: 16, 24: 20, 30: 24},
    2: {5: 0, 8: 4, 13: 8, 15: 8, 16: 12, 17: 0, 20: 16, 22: 16, 24: 20, 30: 24},
    3: {5: 0, 8: 0, 13: 8, 15: 8, 16: 8, 17: 0, 20: 0, 22: 16, 24: 16, 30: 24},
}


def grid_resend_at(length: int, k: int) -> int:
    return GRID_RESENDS[k][length]


def spec_ring_engine(
    model_dir, k: int, accept, async_scheduling: bool = False, slots: int = SLOTS, grid_only: bool = True,
    uniform_decode_rows: bool | None = None, **engine_args,
):  # fmt: skip
    """The ring layout under MTP, on the shadow of an indexer that needs uniform decode rows
    (Hopper). ``grid_only=False`` takes the plugin's pool-grid rule away (contract 13) and, unless
    ``uniform_decode_rows`` says otherwise, models an indexer that takes short rows of any length as
    decodes (Blackwell): the off-grid restore path."""
    scheduler, worker = ring_scheduler(
        model_dir, ring_slots=slots, num_speculative_tokens=k, worker_cls=SpecShadowWorker,
        async_scheduling=async_scheduling, **engine_args,
    )  # fmt: skip
    worker.num_spec, worker.accept, worker.async_scheduling, worker.kpool = k, accept, async_scheduling, KPOOL
    scheduler._grid_only = grid_only
    scheduler._restore_tail = restore_tail(k) if grid_only else 1
    worker.uniform_decode_rows = grid_only if uniform_decode_rows is None else uniform_decode_rows
    worker.no_short_prefill_rows = grid_only
    return scheduler, worker, SpecDriver(scheduler, worker, lag=int(async_scheduling))


ACCEPT = {  # accepted drafts per step, by pattern, for k drafts
    "none": lambda k: lambda r, s: 0, "all": lambda k: lambda r, s: k, "cycle": lambda k: lambda r, s: s % (k + 1),
}  # fmt: skip


def restore_rounds(
    driver, rng, lengths=(5, 8, 15, 17, 22, 30), new_tokens: int = 13, response_at=None, resend_at=None
) -> None:
    """Per prompt length: a producer, its exact resend (restored at ``P - 1``, or ``resend_at(P)``)
    and a next turn of ``new_tokens`` more (restored at the response boundary when one was kept,
    or every time at ``response_at(committed length)``), each answering as a cold run."""
    resend_at = resend_at or (lambda length: length - 1)
    for length in lengths:
        prompt = tokens(rng, length)
        [answer] = driver.run([make_request(prompt, salt="s")])
        resend = make_request(prompt, salt="s")
        assert driver.run([resend]) == [answer]
        assert driver.cached_tokens[resend.request_id] == resend_at(length)
        follow_up = prompt + answer + tokens(rng, new_tokens)
        nxt, cold = make_request(follow_up, salt="s"), make_request(follow_up, salt=f"cold-{length}")
        assert driver.run([nxt]) == driver.run([cold])
        if response_at is not None:
            assert driver.cached_tokens[nxt.request_id] == response_at(length + len(answer) - 1)
        else:
            assert driver.cached_tokens[nxt.request_id] >= resend_at(length)
        assert driver.cached_tokens[cold.request_id] == 0


def test_lookahead_ring_is_accepted_with_the_model_pool(model_dir):
    """Under MTP the ring group has the lookahead slots and the pool grid is the model's kpool."""
    scheduler, _, _ = spec_ring_engine(model_dir, 3, ACCEPT["all"](3))
    assert scheduler.boundaries_active
    ring = scheduler._geometries[RING]
    assert (ring.kind, ring.block_size, ring.pool, ring.label) == (GroupKind.RING, SLOTS, KPOOL, "ring/8 p4")
    assert scheduler._kpool == KPOOL


@pytest.mark.parametrize("accept", sorted(ACCEPT))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_lookahead_ring_restores_exactly_under_mtp(model_dir, k, accept):
    """Prompt and response bundles restore both rings (the target's and the MTP layer's) exactly:
    every decode step that completes a pool open at a restore reads the committed keys.
    Synchronous scheduling only: the async shadow (``spec_shadow.py``) does not model a request
    whose first step is scheduled with draft placeholders, which these resends are."""
    _, worker, driver = spec_ring_engine(model_dir, k, ACCEPT[accept](k))
    restore_rounds(driver, random.Random(10 * k), resend_at=lambda length: grid_resend_at(length, k))
    assert worker.ring_reads > 0


def rounds_beside_a_decoding_request(scheduler, driver, seed: int) -> None:
    """``restore_rounds`` with prompts on and off the pool grid (P - 1 and P multiples of 4
    among them) while a long request decodes beside them: its verify rows share their steps."""
    rng = random.Random(seed)
    scheduler.add_request(make_request(tokens(rng, 9), max_tokens=900, salt="neighbour"))
    k = scheduler.num_spec_tokens
    resend_at = (lambda length: grid_resend_at(length, k)) if scheduler._grid_only else None  # else P - 1
    restore_rounds(driver, rng, lengths=(5, 8, 13, 16, 17, 20, 24, 30), resend_at=resend_at)


@pytest.mark.parametrize("k", [1, 3])
def test_under_mtp_checkpoints_sit_on_the_pool_grid_beside_verify_rows(model_dir, k):
    """Contract 13, on the shadow of an indexer that needs uniform decode rows (Hopper): prompt
    checkpoints sit at a pool boundary below P - 1 (``GRID_RESENDS``) and responses are kept only
    on the grid, so no restore needs a one-token step that completes a pool beside verify rows, and
    no prefill row of the plugin's is as short as a verify row. Every restore is exact; some
    responses ended off the grid and kept nothing."""
    scheduler, worker, driver = spec_ring_engine(model_dir, k, ACCEPT["cycle"](k))
    rounds_beside_a_decoding_request(scheduler, driver, seed=k)
    counters = scheduler.checkpoint_store.counters
    assert counters.responses_off_pool_grid > 0 and counters.hits > 0
    assert "checkpoints only on the indexer's 4-token pool grid" in scheduler._pool_grid_line()


def fresh_request(length: int) -> SimpleNamespace:
    """What ``_grid_prompt_target`` reads of a fresh request of ``length`` prompt tokens."""
    return SimpleNamespace(request_id=f"fresh-{length}", num_prompt_tokens=length, num_tokens=length,
                           num_computed_tokens=0, shared_prefix_boundary=0)  # fmt: skip


def test_under_dflash_the_pooled_indexer_gets_the_pool_grid_rule(model_dir, tmp_path):
    """Contract 13 is not MTP's alone: with a DFlash config of k = 3 (a config-only drafter of
    ``fixtures/dflash.py``; vLLM's lookahead of k + 1) over the lookahead ring, the scheduler keeps
    checkpoints on the pool grid (``_grid_only``, restore tail ``k + 2``) and puts each fresh
    prompt's checkpoint where it does under MTP (``GRID_RESENDS``). Negative control: the same
    DFlash config without a ring (no pooled indexer) cuts nothing to a grid."""
    drafter = write_drafter_config(tmp_path / "drafter", model_dir)
    k = 3
    scheduler, _ = ring_scheduler(model_dir, ring_slots=SLOTS, num_speculative_tokens=k, drafter=drafter)
    assert scheduler.boundaries_active and scheduler.num_lookahead_tokens == k + 1  # DFlash, not MTP
    assert scheduler._grid_only and scheduler._restore_tail == restore_tail(k) == k + 2
    assert scheduler._geometries[RING].label == f"ring/{SLOTS} p{KPOOL}"
    targets = {length: scheduler._grid_prompt_target(fresh_request(length), 0) for length in GRID_RESENDS[k]}
    assert targets == GRID_RESENDS[k]
    assert "checkpoints only on the indexer's 4-token pool grid" in scheduler._pool_grid_line()
    no_ring, _ = build_scheduler(model_dir, num_speculative_tokens=k, drafter=drafter)
    assert no_ring.boundaries_active and not no_ring._grid_only and no_ring._restore_tail == 1


def test_under_mtp_without_the_row_rule_a_stop_leaves_a_short_prefill_row(model_dir, monkeypatch):
    """Negative control: with every pool boundary below ``P - 1`` taken as it comes, a stop leaves
    prefill rows of 1 to 4 tokens, no longer than a verify row at k = 3: the row shape in which
    the H200 test's first batch at k = 3 hit a device-side index assert (docs/results/gpu-glm-mtp-h200.md)."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3))
    monkeypatch.setattr(scheduler, "_adds_prefill_rows_only", lambda *args, **kwargs: True)
    with pytest.raises(ShadowMismatch, match="no longer than a verify row"):
        rounds_beside_a_decoding_request(scheduler, driver, seed=3)


@pytest.mark.parametrize("budget", [20, 24])
def test_under_mtp_a_budget_cut_before_a_stop_leaves_no_short_prefill_row(model_dir, budget):
    """vLLM's token budget ends a chunk on a block boundary just below the prompt checkpoint (e.g.
    at 48 for a stop at 52): the plugin then does not stop there, so no prefill row of its own is
    as short as a verify row (the shadow raises on one)."""
    _, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), max_num_batched_tokens=budget)
    rng = random.Random(budget)
    for length in range(40, 90, 3):
        driver.run([make_request(tokens(rng, length), salt=f"budget-{length}", max_tokens=2)])


def test_under_mtp_a_restore_leaves_a_prefill_row_even_on_the_block_grid(model_dir):
    """A 22-token producer keeps its checkpoint at 16, on vLLM's block grid: prompts that share its
    first 16 tokens and leave 2 to 4 more restore nothing (vLLM would not run those rows: under
    MTP its own hit leaves a block and more), one that leaves 5 restores 16. The three misses are
    counted as the rule's (``short_row``)."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3))
    rng = random.Random(3)
    prompt = tokens(rng, 22)
    driver.run([make_request(prompt, salt="s")])
    misses = scheduler.checkpoint_store.counters.misses_by_reason
    before = misses.get(MissReason.SHORT_ROW, 0)
    for length, cached in ((18, 0), (19, 0), (20, 0), (21, 16)):
        request = make_request(prompt[: length - 1] + tokens(rng, 1), salt="s")
        driver.run([request])
        assert driver.cached_tokens[request.request_id] == cached, length
    assert misses[MissReason.SHORT_ROW] - before == 3


def test_under_mtp_without_the_grid_rule_a_one_token_step_completes_a_pool_on_the_prefill_path(model_dir):
    """Negative control: without contract 13 the P - 1 stop leaves a one-token step that completes
    the pool beside the neighbour's verify rows, which the indexer runs on its prefill path."""
    scheduler, _, driver = spec_ring_engine(model_dir, 1, ACCEPT["cycle"](1), grid_only=False, uniform_decode_rows=True)
    with pytest.raises(ShadowMismatch, match="a 1-token step starts off the pool grid"):
        rounds_beside_a_decoding_request(scheduler, driver, seed=1)


def test_under_mtp_without_the_ring_copy_a_restore_reads_a_fresh_ring(model_dir, monkeypatch):
    """The off-grid restore path (no pool-grid rule): the resend restores at 17."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), grid_only=False)
    monkeypatch.setattr(scheduler, "_copy_restored_rings", lambda output: setattr(scheduler, "_ring_restores", {}))
    with pytest.raises(ShadowMismatch, match=r"ring group 3 at 18 is wrong \(position 16\)"):
        restore_rounds(driver, random.Random(5), lengths=(18,))  # the resend's first verify step reads 16, 17


def first_steps_after_prompt_restore(scheduler, driver, rng) -> list[int]:
    """Step sizes of a longer prompt that restores at its producer's ``P - 1`` = 17."""
    outputs = recorded_steps(scheduler)
    prompt = tokens(rng, 18)
    driver.run([make_request(prompt, salt="s")])
    longer = make_request(prompt + tokens(rng, 30), salt="s")
    first = len(outputs)
    driver.run([longer])
    assert driver.cached_tokens[longer.request_id] == 17
    return [s for s in (o.num_scheduled_tokens.get(longer.request_id) for o in outputs[first:]) if s][:8]


def test_under_mtp_the_pool_grid_is_the_model_pool_not_the_ring(model_dir, monkeypatch):
    """The off-grid path (no pool-grid rule): from 17 the consumer steps one token at a time to the
    pool boundary 20 and then prefills; a scheduler that took the pool from the ring's 8 slots
    would step one token at a time to 24."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), grid_only=False)
    steps = first_steps_after_prompt_restore(scheduler, driver, random.Random(8))
    assert steps[:3] == [1, 1, 1] and steps[3] > 1
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), grid_only=False)
    monkeypatch.setattr(scheduler, "_kpool", SLOTS)
    assert first_steps_after_prompt_restore(scheduler, driver, random.Random(8))[:7] == [1] * 7


def test_under_mtp_a_pool_sized_ring_is_refused(model_dir):
    """A ring of one pool under MTP is not the ring vLLM sizes: ``request_boundaries`` refuses."""
    with pytest.raises(BoundaryConfigError, match="is not the ring of 8 slots vLLM sizes for a pool of 4 tokens and 3"):
        spec_ring_engine(model_dir, 3, ACCEPT["all"](3), slots=KPOOL)


def test_the_drafter_passes_overrun_the_lookahead_ring_at_k4(model_dir, monkeypatch):
    """At k = 4 vLLM's ring of 8 slots holds the pool and the verify step's drafts, but the MTP
    drafter's 3 later passes wrap onto the open pool: the plugin refuses, and with the span rule
    taken away (counting the verify step's drafts only) the shadow sees a clobbered key."""
    with pytest.raises(BoundaryConfigError, match="of 8 slots cannot hold the 10 positions"):
        spec_ring_engine(model_dir, 4, ACCEPT["all"](4))
    monkeypatch.setattr(layout, "ring_span_at_boundary", lambda kpool, k: kpool - 1 + k)
    _, _, driver = spec_ring_engine(model_dir, 4, ACCEPT["all"](4), grid_only=False)
    with pytest.raises(ShadowMismatch, match="ring group 3 at .* is wrong"):
        restore_rounds(driver, random.Random(4), lengths=(5, 8, 15, 17, 22, 30, 31, 33))


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


def test_under_mtp_an_instruction_checkpoint_sits_on_the_pool_grid(model_dir):
    """Contract 13 for instruction boundaries: a shared instruction of 10 tokens keeps its
    checkpoint at 8, where a second conversation sharing it restores."""
    from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY

    scheduler, _, driver = spec_ring_engine(model_dir, 1, ACCEPT["cycle"](1))
    rng = random.Random(12)
    instruction = tokens(rng, 10)
    first, second = (make_request(instruction + tokens(rng, 9), salt="s") for _ in range(2))
    for request in (first, second):
        request.sampling_params.extra_args = {INSTRUCTION_TOKENS_KEY: 10}
        driver.run([request])
    assert driver.cached_tokens[second.request_id] == 8


def test_a_prefix_cache_reset_gives_every_snapshot_back(model_dir):
    scheduler, worker = ring_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    decoding = decode_until_a_snapshot(scheduler, driver, random.Random(13))
    scheduler.reset_prefix_cache()  # vLLM refuses while a request runs; the snapshots go anyway
    assert scheduler.boundary_stats()["snapshot_blocks"] == 0
    driver.finish([decoding])
