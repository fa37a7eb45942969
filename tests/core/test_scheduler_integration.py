"""vLLM's real Scheduler + KV cache manager with the plugin, driven step by step (CPU): exact
restores at the prompt and response boundaries (resends and next turns, sync and async), stock's
``aligned`` policy, salt isolation, eviction under pressure and the retention budget, the plugin's
scheduler class picked through vLLM's config, one kept turn per conversation and a next turn sent
while the finishing step is in flight. How prompt checkpoints are taken and kept:
``test_scheduler_prompt_checkpoints.py``.

Every step runs against the shadow runner of ``shadow_engine``: it raises if a restored request
ever reads a recurrent state or attention row that differs from the recomputed one.
"""

from __future__ import annotations

import random

import pytest
from shadow_engine import ShadowMismatch
from shadow_scheduler import Driver, build_scheduler, free_blocks, make_request, tokens

BLOCK = 16


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async-one-step-in-flight"])
@pytest.mark.parametrize("prompt_len", [2, 15, 16, 17, 31, 33, 40])
def test_resend_and_continuation_hit_exact_boundaries(model_dir, lag, prompt_len):
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    driver = Driver(scheduler, worker, lag=lag)
    rng = random.Random(prompt_len)
    prompt = tokens(rng, prompt_len)

    first = make_request(prompt, salt="s")
    [out_first] = driver.run([first])
    resend = make_request(prompt, salt="s")
    [out_resend] = driver.run([resend])
    assert driver.cached_tokens[first.request_id] == 0
    assert driver.cached_tokens[resend.request_id] == prompt_len - 1
    assert out_resend == out_first

    continuation = prompt + out_first + tokens(rng, 5)
    cont = make_request(continuation, salt="s")
    cold = make_request(continuation, salt="fresh")
    [out_cont] = driver.run([cont])
    [out_cold] = driver.run([cold])
    committed = prompt_len + len(out_first) - 1
    assert driver.cached_tokens[cont.request_id] >= committed
    assert driver.cached_tokens[cold.request_id] == 0
    assert out_cont == out_cold
    assert worker.restored_reads >= 2  # both hits really read restored state
    stats = scheduler.boundary_stats()
    assert stats["captures_dropped"] == 0
    kinds = sorted(c.kind for c in scheduler.checkpoint_store.checkpoints())
    # The continuation superseded the first turn's bundles; the cold control keeps its own.
    assert kinds.count("prompt") == 2 and kinds.count("response") == 2
    assert stats["superseded"] == 2


@pytest.mark.parametrize("prompt_len", [17, 40])
def test_stock_aligned_policy_floors_to_the_block_grid(model_dir, prompt_len):
    scheduler, worker = build_scheduler(model_dir, policy="aligned")
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(1), prompt_len)
    first, resend = make_request(prompt), make_request(prompt)
    driver.run([first])
    driver.run([resend])
    assert driver.cached_tokens[resend.request_id] == (prompt_len - 1) // BLOCK * BLOCK
    assert not hasattr(scheduler, "checkpoint_store")


def test_different_salt_never_hits(model_dir):
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(2), 40)
    driver.run([make_request(prompt, salt="alice")])
    for salt in ("bob", None):
        other = make_request(prompt, salt=salt)
        driver.run([other])
        assert driver.cached_tokens[other.request_id] == 0
    again = make_request(prompt, salt="alice")
    driver.run([again])
    assert driver.cached_tokens[again.request_id] == 39


@pytest.mark.parametrize("retention", ["hold", "borrow"])
def test_eviction_under_pressure_never_starves_requests_and_leaks_nothing(model_dir, retention):
    # 48 usable blocks; every 40-token request needs 3 attention + 2x(1-3) recurrent blocks.
    scheduler, worker = build_scheduler(
        model_dir, num_blocks=48, max_retained_fraction=0.75, max_num_seqs=4, retention=retention
    )
    driver = Driver(scheduler, worker)
    rng = random.Random(5)
    total = free_blocks(scheduler)
    for wave in range(6):
        batch = [make_request(tokens(rng, 40), max_tokens=6, salt=f"w{wave}") for _ in range(3)]
        driver.run(batch)
    stats = scheduler.boundary_stats()
    # hold: allocations that did not fit evicted bundles; borrow: bundles yielded to the cache first
    assert stats["evictions_pressure" if retention == "hold" else "evictions_cached"] > 0
    assert scheduler.checkpoint_store.budgeted_blocks <= 36  # max_retained_fraction 0.75 of 48
    scheduler.checkpoint_store.clear()
    assert free_blocks(scheduler) == total


def test_retention_budget_is_respected(model_dir):
    scheduler, worker = build_scheduler(model_dir, num_blocks=200, max_retained_fraction=0.1)
    driver = Driver(scheduler, worker)
    rng = random.Random(6)
    for i in range(10):
        driver.run([make_request(tokens(rng, 40), max_tokens=3, salt=str(i))])
        assert scheduler.checkpoint_store.budgeted_blocks <= 20
    assert scheduler.boundary_stats()["evictions"] > 0


def test_shadow_runner_detects_a_corrupted_checkpoint(model_dir):
    """The harness can fail: corrupt a retained recurrent state and the restore is caught."""
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(7), 40)
    driver.run([make_request(prompt)])
    checkpoint = next(c for c in scheduler.checkpoint_store.checkpoints() if c.kind == "prompt")
    worker.states[checkpoint.group_blocks[1][-1].block_id] ^= 1
    with pytest.raises(ShadowMismatch):
        driver.run([make_request(prompt)])


def test_plugin_picks_its_scheduler_class_through_vllm_config(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    def scheduler_cls(policy):
        config = EngineArgs(
            model=str(model_dir),
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            max_model_len=1024,
            additional_config={"boundary_checkpoints": {"policy": policy}},
        ).create_engine_config()
        return config.scheduler_config.get_scheduler_cls()

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from boundary_checkpoints.core.scheduler import BoundaryCheckpointMixin

    assert issubclass(scheduler_cls("request_boundaries"), BoundaryCheckpointMixin)
    assert issubclass(scheduler_cls("auto"), BoundaryCheckpointMixin)
    assert scheduler_cls("aligned") in (Scheduler, AsyncScheduler)


def test_a_long_conversation_keeps_only_its_latest_turn(model_dir):
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    rng = random.Random(8)
    prompt = tokens(rng, 20)
    previous_committed = 0
    for turn in range(6):
        request = make_request(prompt, max_tokens=5, salt="chat")
        [answer] = driver.run([request])
        if turn:
            assert driver.cached_tokens[request.request_id] == previous_committed
        previous_committed = len(prompt) + len(answer) - 1
        prompt = prompt + answer + tokens(rng, 7)
        kinds = sorted(c.kind for c in scheduler.checkpoint_store.checkpoints())
        assert kinds == ["prompt", "response"], (turn, kinds)


def test_a_resend_that_answers_differently_does_not_drop_the_original_turn(model_dir):
    """Found on the GPU host: a resend whose greedy answer flipped at a near-tie published its own
    response and superseded the producer's bundles, so the producer's continuation missed."""
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(9), 40)
    first = make_request(prompt, salt="s")
    [answer] = driver.run([first])
    # A resend restored from the prompt checkpoint that (unlike the shadow model's greedy rule)
    # stops after a different number of tokens, so its response bundle has another key.
    resend = make_request(prompt, salt="s", max_tokens=3)
    driver.run([resend])
    assert driver.cached_tokens[resend.request_id] == 39
    continuation = make_request(prompt + answer + tokens(random.Random(10), 5), salt="s")
    driver.run([continuation])
    assert driver.cached_tokens[continuation.request_id] == len(prompt) + len(answer) - 1


def test_next_turn_submitted_while_the_finishing_step_is_in_flight_restores_the_response(model_dir):
    """Async, one step in flight: turn 1 stops on a stop token, and turn 2 arrives as soon as that
    output was processed, while the step scheduled after it (which still computes turn 1's last
    token) has not returned. The response bundle is adopted but not published yet; turn 2 must
    restore it rather than fall back to the prompt checkpoint at ``P - 1``."""
    scheduler, worker = build_scheduler(model_dir, async_scheduling=True)
    driver = Driver(scheduler, worker, lag=1)
    rng = random.Random(11)
    prompt = tokens(rng, 40)
    [plain] = Driver(*build_scheduler(model_dir)).run([make_request(prompt, max_tokens=8)])
    first = make_request(prompt, max_tokens=8, salt="s", stop_token_ids=[plain[3]])
    scheduler.add_request(first)
    while not first.is_finished():
        driver.step()
    answer = list(first.output_token_ids)
    assert answer == plain[:4] and first.status.name == "FINISHED_STOPPED"
    [step_in_flight] = driver.in_flight
    assert step_in_flight[0].num_scheduled_tokens.get(first.request_id) == 1  # its last token
    [response] = [p for p in scheduler._pending if p.kind == "response"]  # not published yet
    committed = len(prompt) + len(answer) - 1
    assert response.key.num_tokens == committed + 1  # includes the token of the in-flight step

    follow_up = prompt + answer + tokens(rng, 5)
    second = make_request(follow_up, salt="s")
    [out_second] = driver.run([second])
    assert driver.cached_tokens[second.request_id] == response.key.num_tokens
    assert worker.restored_reads >= 1
    cold = make_request(follow_up, salt="cold")
    [out_cold] = driver.run([cold])
    assert driver.cached_tokens[cold.request_id] == 0
    assert out_second == out_cold
    stats = scheduler.boundary_stats()
    assert stats["captures_dropped"] == 0 and stats["hits"] == 1
    # Turn 2 resumed from turn 1's response (published after the lookup): turn 1 is superseded.
    assert stats["superseded"] == 2
    producers = {c.producer for c in scheduler.checkpoint_store.checkpoints()}
    assert first.request_id not in producers
