"""The instruction boundary on vLLM's real scheduler (CPU, shadow runner): a prefill chunk ends at
``N_i``, a bundle of kind ``instruction`` is captured there, later conversations that share the
first ``N_i`` tokens restore exactly there (a longer checkpoint still wins), lineage never retires
it, eviction takes it last, and invalid values are ignored and counted. Sync and async (lag=1).

Every step runs against ``shadow_engine``'s runner, which raises if a restored request reads a
state or attention row that differs from the recomputed one.
"""

from __future__ import annotations

import random

import pytest
from chunk_recorder import record_chunk_ends
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.core.checkpoint import INSTRUCTION
from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY

SYSTEM = 37  # not a multiple of the 16-token block: stock retention keeps 32 of it


def with_instruction(prompt: list[int], n: object, **kwargs):
    request = make_request(prompt, **kwargs)
    request.sampling_params.extra_args = {INSTRUCTION_TOKENS_KEY: n}
    return request


def instruction_bundles(scheduler) -> list:
    return [c for c in scheduler.checkpoint_store.checkpoints() if c.kind == INSTRUCTION]


class ChunkRecorder:
    """Wraps a Driver's scheduler output: records (request id, chunk end) of every step."""

    def __init__(self, driver: Driver) -> None:
        self.ends = record_chunk_ends(driver.scheduler)  # instance attribute on the test's own scheduler


@pytest.mark.parametrize("lag", [0, 1])
def test_conversations_sharing_a_system_prompt_restore_at_the_instruction_boundary(model_dir, lag):
    rng = random.Random(7)
    system = tokens(rng, SYSTEM)
    users = [tokens(rng, 20 + 3 * i) for i in range(6)]
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    driver = Driver(scheduler, worker, lag=lag)
    chunks = ChunkRecorder(driver)
    requests = [with_instruction(system + user, SYSTEM, salt="s") for user in users]
    outputs = [driver.run([request])[0] for request in requests]

    first = requests[0].request_id
    assert SYSTEM in chunks.ends[first], chunks.ends[first]  # a chunk ended exactly at N_i
    assert [driver.cached_tokens[r.request_id] for r in requests] == [0] + [SYSTEM] * 5
    [bundle] = instruction_bundles(scheduler)
    assert bundle.num_tokens == SYSTEM
    stats = scheduler.boundary_stats()
    assert stats["instruction_requests"] == 6
    assert stats["instruction_hits"] == 5
    assert stats["instruction_stops"] == 1  # the others started at N_i

    # Stock retention on the same traffic: the 16-token grid at best (where a chunk ended on it).
    stock = Driver(*build_scheduler(model_dir, policy="aligned", async_scheduling=bool(lag)), lag=lag)
    stock_requests = [with_instruction(system + user, SYSTEM, salt="s") for user in users]
    stock_outputs = [stock.run([request])[0] for request in stock_requests]
    stock_cached = [stock.cached_tokens[r.request_id] for r in stock_requests]
    assert all(cached in (0, 16, 32) for cached in stock_cached), stock_cached
    assert outputs == stock_outputs

    # A different salt never hits; a longer checkpoint (the exact resend's P - 1) still wins.
    other_salt = with_instruction(system + users[1], SYSTEM, salt="t")
    resend = with_instruction(system + users[1], SYSTEM, salt="s")
    driver.run([other_salt])
    driver.run([resend])
    assert driver.cached_tokens[other_salt.request_id] == 0
    assert driver.cached_tokens[resend.request_id] == SYSTEM + len(users[1]) - 1


@pytest.mark.parametrize("lag", [0, 1])
def test_instruction_bundle_is_never_retired_by_lineage(model_dir, lag):
    rng = random.Random(11)
    system = tokens(rng, SYSTEM)
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    driver = Driver(scheduler, worker, lag=lag)
    for conversation in range(3):
        prompt = system + tokens(rng, 25)
        for _turn in range(3):
            request = with_instruction(prompt, SYSTEM, salt="s")
            output = driver.run([request])[0]
            if _turn == 0:
                assert driver.cached_tokens[request.request_id] == (0 if conversation == 0 else SYSTEM)
            else:
                assert driver.cached_tokens[request.request_id] > SYSTEM  # the previous response
            prompt = prompt + output + tokens(rng, 9)
    assert scheduler.boundary_stats()["superseded"] > 0  # lineage did retire turns
    [bundle] = instruction_bundles(scheduler)
    assert bundle.num_tokens == SYSTEM
    late = with_instruction(system + tokens(rng, 30), SYSTEM, salt="s")
    driver.run([late])
    assert driver.cached_tokens[late.request_id] == SYSTEM


@pytest.mark.parametrize("lag", [0, 1])
def test_instruction_bundle_is_evicted_last(model_dir, lag):
    """A retention budget of a few bundles: prompt and response bundles of many conversations
    come and go; the instruction bundle, published first, stays."""
    rng = random.Random(5)
    system = tokens(rng, SYSTEM)
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag), max_retained_fraction=0.06)
    driver = Driver(scheduler, worker, lag=lag)
    for i in range(8):
        request = with_instruction(system + tokens(rng, 40), SYSTEM, salt="s")
        driver.run([request])
        assert driver.cached_tokens[request.request_id] == (0 if i == 0 else SYSTEM)
        assert len(instruction_bundles(scheduler)) == 1
    assert scheduler.boundary_stats()["evictions_budget"] > 0


@pytest.mark.parametrize("lag", [0, 1])
def test_instruction_at_prompt_boundary_is_kept_as_instruction(model_dir, lag):
    rng = random.Random(3)
    prompt = tokens(rng, 41)
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    driver = Driver(scheduler, worker, lag=lag)
    driver.run([with_instruction(prompt, 40, salt="s")])
    assert [c.num_tokens for c in instruction_bundles(scheduler)] == [40]
    assert not any(c.kind == "prompt" for c in scheduler.checkpoint_store.checkpoints())


@pytest.mark.parametrize("lag", [0, 1])
def test_invalid_instruction_boundaries_are_ignored_and_counted(model_dir, lag):
    rng = random.Random(9)
    prompt = tokens(rng, 45)
    reference = Driver(*build_scheduler(model_dir)).run([make_request(prompt)])[0]
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    driver = Driver(scheduler, worker, lag=lag)
    chunks = ChunkRecorder(driver)
    bad = [0, -3, 45, 100, "20", 20.0, True, None, [20]]
    requests = [with_instruction(prompt, value, salt=f"bad{i}") for i, value in enumerate(bad)]
    assert driver.run(requests) == [reference] * len(bad)
    assert not instruction_bundles(scheduler)
    for request in requests:
        assert SYSTEM not in chunks.ends[request.request_id]
        assert 20 not in chunks.ends[request.request_id]
    stats = scheduler.boundary_stats()
    assert stats["instruction_ignored_out_of_range"] == 4
    assert stats["instruction_ignored_not_an_integer"] == 5
    assert "instruction_requests" not in stats


# ---- store order (pure) -------------------------------------------------------------------------


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.is_null = False
        self.ref_cnt = 1


def test_store_evicts_other_kinds_before_instruction_bundles_and_lineage_skips_them():
    from boundary_checkpoints.core.checkpoint import Checkpoint
    from boundary_checkpoints.core.keys import CheckpointKey
    from boundary_checkpoints.core.store import CheckpointStore

    released: list[int] = []
    store = CheckpointStore(release=lambda blocks: released.extend(b.block_id for b in blocks), max_blocks=3)

    def bundle(n: int, kind: str, producer: str) -> Checkpoint:
        return Checkpoint(CheckpointKey(("root", None, None), 0, (n,)), kind, ((Block(n),),), producer=producer)

    instruction = bundle(1, INSTRUCTION, "a")
    assert store.publish(instruction)
    assert store.publish(bundle(2, "prompt", "a"))
    assert store.publish(bundle(3, "response", "a"))
    assert store.retire("a") == 2  # the prompt and response of turn a; not the instruction
    assert released == [2, 3]
    for n in (4, 5, 6, 7):  # budget 3: the oldest non-instruction bundle goes first
        assert store.publish(bundle(n, "prompt", f"p{n}"))
    assert released == [2, 3, 4, 5]  # retained: the instruction bundle, 6 and 7
    assert store.evict_to_free(lambda block: True)  # pressure: also other kinds first
    assert store.evict_to_free(lambda block: True)
    assert released == [2, 3, 4, 5, 6, 7] and len(store) == 1
    assert store.evict_to_free(lambda block: True)  # the instruction bundle only when alone
    assert released[-1] == 1 and len(store) == 0


@pytest.mark.parametrize("seed", range(20))
def test_refusal_predicts_what_publication_refuses(seed):
    """``CheckpointStore.refusal`` (asked before a capture takes its private blocks) against the
    publication it predicts, on random bundles sharing blocks, of every kind, with reuse distances
    that protect some of them: a predicted refusal is always a refusal (no bundle the budget would
    keep is skipped), and a refusal it did not predict is only the newcomer evicted by the budget
    behind lasting bundles (the one case it leaves to publication)."""
    from boundary_checkpoints.core.checkpoint import Checkpoint
    from boundary_checkpoints.core.keys import CheckpointKey
    from boundary_checkpoints.core.store import CheckpointStore

    rng = random.Random(seed)
    store = CheckpointStore(release=lambda blocks: None, max_blocks=8)
    blocks = [Block(i) for i in range(24)]
    outcomes = {"predicted": 0, "kept": 0, "behind_lasting": 0}
    for n in range(200):
        kind = rng.choice(["prompt", "response", "response", INSTRUCTION])
        ids = rng.sample(range(24), rng.randint(1, 5)) if rng.random() < 0.97 else list(range(9))  # some oversize
        bundle = Checkpoint(CheckpointKey(("root", None, None), 0, (n,)), kind, (tuple(blocks[i] for i in ids),),
                            producer=f"p{n}")  # fmt: skip
        predicted = store.refusal(set(ids), 0, bundle.lasting)
        oversize_before = store.counters.refused_oversize
        store.publish(bundle)
        refused = bundle.key not in store
        if predicted is not None:
            assert refused, (n, predicted)
            assert (store.counters.refused_oversize == oversize_before + 1) == (predicted == "oversize"), n
            outcomes["predicted"] += 1
        elif refused:
            assert not bundle.lasting and all(c.lasting for c in store.checkpoints()), n
            outcomes["behind_lasting"] += 1
        else:
            outcomes["kept"] += 1
        retained = store.checkpoints()
        if retained and rng.random() < 0.5:  # a restore: a reuse distance, so protection starts
            store.record_lookup(rng.choice(retained))
    assert outcomes["predicted"] > 0 and outcomes["kept"] > 0, outcomes


def test_a_demoted_prompt_bundle_goes_first_and_without_protection():
    """Once a request's response bundle is retained, the scheduler demotes its prompt bundle
    (``CheckpointStore.demote``): under a full budget a newcomer evicts it instead of being
    refused for it, and the response bundle stays."""
    from boundary_checkpoints.core.checkpoint import Checkpoint
    from boundary_checkpoints.core.keys import CheckpointKey
    from boundary_checkpoints.core.store import CheckpointStore

    def bundle(n: int, kind: str, producer: str, ids: tuple[int, ...]) -> Checkpoint:
        return Checkpoint(CheckpointKey(("root", None, None), 0, (n,)), kind, (tuple(Block(i) for i in ids),),
                          producer=producer)  # fmt: skip

    for demote in (False, True):
        store = CheckpointStore(release=lambda blocks: None, max_blocks=3)
        prompt, response = bundle(1, "prompt", "a", (10, 11)), bundle(2, "response", "a", (11, 12))
        assert store.publish(prompt) and store.publish(response)
        store.reuse.record_hit(0)  # a reuse distance of 2 publications: both bundles are young enough
        if demote:
            store.demote(prompt)
        newcomer = bundle(3, "prompt", "b", (20,))
        assert store.refusal({20}, 0, lasting=False) == (None if demote else "protected")
        store.publish(newcomer)
        assert (newcomer.key in store, prompt.key in store, response.key in store) == (demote, not demote, True)
