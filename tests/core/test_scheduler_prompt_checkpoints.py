"""Prompt checkpoints (the state at ``P - 1``) on vLLM's real Scheduler with the plugin, driven step
by step (CPU): a bundle is published only once the step carrying its capture returned (the stop at
``P - 1`` or in-step capture, sync and async), an aborted producer publishes nothing, a resend while
the capture step is in flight restores ``P - 1``, the ``prompt_checkpoints`` switch and
``prompt_checkpoint_min_tokens``, the stop at ``P - 1`` keeps stock's in-chunk block state for a
shared prefix, and a finished request's prompt bundle is demoted behind its response.

Every step runs against the shadow runner of ``shadow_engine``: it raises if a restored request
ever reads a recurrent state or attention row that differs from the recomputed one.
"""

from __future__ import annotations

import random

import pytest
from chunk_recorder import record_chunk_ends
from shadow_scheduler import Driver, build_scheduler, free_blocks, make_request, tokens

BLOCK = 16


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_prompt_checkpoint_is_published_only_after_its_copy_step_returned(model_dir, lag):
    scheduler, worker = build_scheduler(
        model_dir, async_scheduling=bool(lag), max_num_batched_tokens=64, prompt_capture="stop"
    )
    driver = Driver(scheduler, worker, lag=lag)
    prompt = tokens(random.Random(3), 40)
    request = make_request(prompt, max_tokens=4)
    scheduler.add_request(request)

    def schedule_and_run():
        output = scheduler.schedule()
        return output, worker.execute(output)

    step1 = schedule_and_run()  # prefill chunk [0, 32): aligned stop
    assert step1[0].num_scheduled_tokens[request.request_id] == 32
    if lag:
        step2 = schedule_and_run()
        scheduler.update_from_output(*step1)
    else:
        scheduler.update_from_output(*step1)
        step2 = schedule_and_run()
    assert step2[0].num_scheduled_tokens[request.request_id] == 7  # chunk ends at P - 1 = 39
    assert not getattr(step2[0], "boundary_capture_copies", None)
    assert len(scheduler.checkpoint_store) == 0
    if not lag:
        scheduler.update_from_output(*step2)
    step3 = schedule_and_run()  # last prompt token; carries the capture copies
    copies = step3[0].boundary_capture_copies
    assert copies and len(copies) == 3  # tail page + two recurrent states
    if lag:
        scheduler.update_from_output(*step2)
    assert len(scheduler.checkpoint_store) == 0  # copies have not returned yet
    scheduler.update_from_output(*step3)
    [checkpoint] = scheduler.checkpoint_store.checkpoints()
    assert checkpoint.kind == "prompt" and checkpoint.num_tokens == 39
    driver.finish([request])


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_in_step_prompt_checkpoint_is_taken_by_the_step_that_computes_the_prompt(model_dir, lag):
    """In-step capture: no stop at P - 1; the step that ends the prompt carries the recurrent
    (slot, destination) pairs and the attention tail copy, and its return publishes the bundle."""
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag), max_num_batched_tokens=64)
    driver = Driver(scheduler, worker, lag=lag)
    request = make_request(tokens(random.Random(3), 40), max_tokens=4)
    scheduler.add_request(request)
    step1 = scheduler.schedule()  # prefill chunk [0, 32): aligned split
    assert step1.num_scheduled_tokens[request.request_id] == 32
    assert not getattr(step1, "boundary_in_step_captures", None)
    out1 = worker.execute(step1)
    if not lag:
        scheduler.update_from_output(step1, out1)
    step2 = scheduler.schedule()  # [32, 40): the whole rest of the prompt, no stop at 39
    assert step2.num_scheduled_tokens[request.request_id] == 8
    in_step, after = step2.boundary_in_step_captures, step2.boundary_post_forward_copies
    recurrent = scheduler.kv_cache_manager.coordinator.single_type_managers[1:]
    slots = {manager.req_to_blocks[request.request_id][39 // BLOCK].block_id for manager in recurrent}
    assert {slot for slot, _ in in_step} == slots  # the blocks holding the state after this step
    assert len(after) == 1  # the attention tail page of rows [32, 39)
    assert not getattr(step2, "boundary_capture_copies", None)
    out2 = worker.execute(step2)
    assert worker.in_step_captures == 2
    if lag:
        scheduler.update_from_output(step1, out1)
    assert len(scheduler.checkpoint_store) == 0
    scheduler.update_from_output(step2, out2)
    [checkpoint] = scheduler.checkpoint_store.checkpoints()
    assert checkpoint.kind == "prompt" and checkpoint.num_tokens == 39
    stats = scheduler.boundary_stats()
    assert stats["prompt_captures_in_step"] == 1 and stats["prompt_stops"] == 0
    driver.finish([request])
    resend = make_request(request.prompt_token_ids, max_tokens=4)
    assert driver.run([resend]) == [list(request.output_token_ids)]
    assert driver.cached_tokens[resend.request_id] == 39


@pytest.mark.parametrize("prompt_capture", ["stop", "in_step"])
def test_aborted_producer_publishes_nothing(model_dir, prompt_capture):
    """Aborted before the step that takes its prompt capture returned (stop: the copy step, one
    step after the chunk that reached P - 1; in step: the step that computes the prompt, with one
    step in flight under async scheduling)."""
    lag = 0 if prompt_capture == "stop" else 1
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag), prompt_capture=prompt_capture)
    driver = Driver(scheduler, worker, lag=lag)
    prompt = tokens(random.Random(4), 40)
    request = make_request(prompt, max_tokens=4)
    scheduler.add_request(request)
    baseline = free_blocks(scheduler) + 0
    for _ in range(2):  # stop: [0, 32) then [32, 39), the capture is planned; in step: [32, 40) in flight
        driver.step()
    assert scheduler._pending
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
    driver.step()
    driver.drain()
    assert len(scheduler.checkpoint_store) == 0
    assert scheduler.boundary_stats()["captures_dropped"] == 1
    assert free_blocks(scheduler) == baseline  # nothing leaked


def test_resend_while_the_prompt_capture_step_is_in_flight_restores_the_prompt_boundary(model_dir):
    """Async, one step in flight: a resend looked up after the step carrying the prompt capture
    copies was scheduled, but before it returned, restores ``P - 1`` from the pending bundle."""
    scheduler, worker = build_scheduler(model_dir, async_scheduling=True)
    driver = Driver(scheduler, worker, lag=1)
    prompt = tokens(random.Random(12), 40)
    first = make_request(prompt, max_tokens=6, salt="s")
    scheduler.add_request(first)
    while not any(p.ready_seq is not None for p in scheduler._pending):
        driver.step()  # [0, 32), [32, 39), then [39, 40) carrying the copies
    assert len(scheduler.checkpoint_store) == 0  # the copy step has not returned
    resend = make_request(prompt, max_tokens=6, salt="s")
    driver.run([resend])
    driver.finish([first])
    assert driver.cached_tokens[resend.request_id] == len(prompt) - 1
    assert list(resend.output_token_ids) == list(first.output_token_ids)
    assert worker.restored_reads >= 1


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async-one-step-in-flight"])
@pytest.mark.parametrize("mode", ["in_step", "stop", "off"])
def test_prompt_checkpoints_switch(model_dir, lag, mode):
    """Off: the prefill runs in one chunk (no stop at P - 1) and no prompt checkpoint exists, so a
    resend falls back to the stock block grid; the next turn still restores the response. Stop:
    a chunk ends at P - 1. In step: no chunk ends at P - 1, and the prompt checkpoint is there."""
    scheduler, worker = build_scheduler(
        model_dir, async_scheduling=bool(lag), prompt_checkpoints=mode != "off",
        prompt_capture="stop" if mode == "stop" else "in_step",
    )  # fmt: skip
    driver = Driver(scheduler, worker, lag=lag)
    chunk_ends = record_chunk_ends(scheduler)
    rng = random.Random(40)
    prompt = tokens(rng, 40)
    first = make_request(prompt, salt="s")
    [out_first] = driver.run([first])
    resend = make_request(prompt, salt="s")
    [out_resend] = driver.run([resend])
    cont = make_request(prompt + out_first + tokens(rng, 5), salt="s")
    [out_cont] = driver.run([cont])
    assert out_resend == out_first
    assert driver.cached_tokens[cont.request_id] >= len(prompt) + len(out_first) - 1
    kinds = {c.kind for c in scheduler.checkpoint_store.checkpoints()}
    stats = scheduler.boundary_stats()
    if mode != "off":
        assert (len(prompt) - 1 in chunk_ends[first.request_id]) == (mode == "stop")
        assert driver.cached_tokens[resend.request_id] == len(prompt) - 1
        assert "prompt" in kinds
        # Two prompt checkpoints: the first turn's and the next turn's (the resend restored one).
        assert (stats["prompt_stops"], stats["prompt_captures_in_step"]) == ((2, 0) if mode == "stop" else (0, 2))
    else:
        assert len(prompt) - 1 not in chunk_ends[first.request_id]  # 39: on no block grid
        assert driver.cached_tokens[resend.request_id] == (len(prompt) - 1) // BLOCK * BLOCK
        assert kinds == {"response"}


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async-one-step-in-flight"])
@pytest.mark.parametrize("prompt_capture", ["stop", "in_step"])
def test_prompt_checkpoint_min_tokens_skips_the_stop_for_short_tails(model_dir, lag, prompt_capture):
    """min 10: a cold 47-token prompt (vLLM's split runs 0-32, then 32-46: a 14-token last step)
    still keeps its prompt checkpoint (stop: a chunk ends at P - 1); the next turn, restored from
    the response checkpoint with 5 new tokens, keeps none (no stop), and its resend restores that
    response checkpoint (kept, not superseded) and recomputes the 5 tokens (same answer)."""
    scheduler, worker = build_scheduler(
        model_dir, async_scheduling=bool(lag), prompt_checkpoint_min_tokens=10, prompt_capture=prompt_capture
    )
    driver = Driver(scheduler, worker, lag=lag)
    chunk_ends = record_chunk_ends(scheduler)
    rng = random.Random(41)
    prompt = tokens(rng, 47)
    first = make_request(prompt, salt="s")
    [out_first] = driver.run([first])
    resend = make_request(prompt, salt="s")
    [out_resend] = driver.run([resend])
    assert (len(prompt) - 1 in chunk_ends[first.request_id]) == (prompt_capture == "stop")
    assert driver.cached_tokens[resend.request_id] == len(prompt) - 1
    assert out_resend == out_first
    cont_prompt = prompt + out_first + tokens(rng, 5)
    cont = make_request(cont_prompt, salt="s")
    [out_cont] = driver.run([cont])
    committed = driver.cached_tokens[cont.request_id]
    assert committed >= len(prompt) + len(out_first) - 1
    assert len(cont_prompt) - 1 not in chunk_ends[cont.request_id]
    assert scheduler.boundary_stats()["prompt_captures_in_step"] == (prompt_capture == "in_step")
    cont_resend = make_request(cont_prompt, salt="s")
    [out_cont_resend] = driver.run([cont_resend])
    assert driver.cached_tokens[cont_resend.request_id] == committed
    assert out_cont_resend == out_cont
    # Turn 3 moves on: turn 1's response (handed to turn 2) goes, turn 2's response stays as the
    # restore point of a turn-3 resend, so the conversation still holds a bounded set of states.
    third = make_request(cont_prompt + out_cont + tokens(rng, 5), salt="s")
    driver.run([third])
    committed_2 = driver.cached_tokens[third.request_id]
    assert committed_2 > committed
    retained = {c.num_tokens for c in scheduler.checkpoint_store.checkpoints()}
    assert committed not in retained and committed_2 in retained


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["aligned", "request_boundaries"])
def test_a_prompt_stopped_at_p_minus_1_keeps_stocks_block_state_for_a_shared_prefix(model_dir, policy, lag):
    """Recurrent kernels that export the last block boundary's state from inside a chunk (KDA,
    Mamba2 on the GPU): stock computes a 45-token prompt in one chunk and caches the state at 32
    for the next prompt that shares the first 40 tokens. The plugin's stop at P - 1 cuts that
    chunk at 44; the state at 32 must still be kept (otherwise a second conversation with the same
    system prompt caches 0 tokens where stock caches a block)."""
    scheduler, worker = build_scheduler(
        model_dir, policy=policy, prompt_capture="stop", prefill_checkpoint_alignment=1, async_scheduling=bool(lag)
    )
    driver = Driver(scheduler, worker, lag=lag)
    rng = random.Random(11)
    system = tokens(rng, 40)
    prompt = system + tokens(rng, 5)
    first, second = make_request(prompt, salt="s"), make_request(system + tokens(rng, 5), salt="s")
    [answer] = driver.run([first])
    driver.run([second])  # the shadow worker checks the state it restores at 32
    assert driver.cached_tokens[first.request_id] == 0
    assert driver.cached_tokens[second.request_id] == 32
    assert worker.internal_checkpoints >= 1
    # The plugin's own boundaries still hit exactly beside the kept block state.
    resend, continuation = make_request(prompt, salt="s"), make_request(prompt + answer + tokens(rng, 3), salt="s")
    driver.run([resend])
    driver.run([continuation])
    committed = len(prompt) + len(answer) - 1
    if policy == "request_boundaries":
        assert scheduler.boundary_stats()["prompt_stops"] >= 2  # the first two prompts did stop at P - 1
        assert driver.cached_tokens[resend.request_id] == len(prompt) - 1
        assert driver.cached_tokens[continuation.request_id] == committed
    else:
        assert driver.cached_tokens[resend.request_id] == 32
        stock_hit = driver.cached_tokens[continuation.request_id]
        assert stock_hit % BLOCK == 0 and stock_hit < committed


@pytest.mark.parametrize("system_len,suffix,stock_hit", [(40, 5, 32), (48, 1, 48), (90, 5, 80), (40, 9, 0)])
def test_a_shared_prefix_caches_what_stock_caches_under_the_p_minus_1_stop(model_dir, system_len, suffix, stock_hit):
    """The same as above at the block grid's edges: a second prompt sharing the first one's prefix
    caches exactly what stock caches (45 tokens: the cut chunk holds the in-chunk state; 49: P - 1
    on a block boundary; 95: the cut is the second of two 64-token chunks; 49 after a 40-token
    prefix: stock keeps the state at 48 only, which the second prompt does not share)."""
    cached = {}
    for policy in ("aligned", "request_boundaries"):
        scheduler, worker = build_scheduler(
            model_dir, policy=policy, prompt_capture="stop", prefill_checkpoint_alignment=1
        )
        driver = Driver(scheduler, worker)
        rng = random.Random(system_len)
        system = tokens(rng, system_len)
        first, second = (make_request(system + tokens(rng, suffix), salt="s") for _ in range(2))
        driver.run([first])
        driver.run([second])
        cached[policy] = driver.cached_tokens[second.request_id]
    assert cached == {"aligned": stock_hit, "request_boundaries": stock_hit}


def test_a_finished_requests_prompt_bundle_is_demoted_behind_its_response(model_dir):
    """When a request's response bundle is published its own prompt bundle is demoted (evicted
    first under a tight budget, core/store.py); a resend still restores from it at P - 1."""
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(3), 40)
    driver.run([make_request(prompt, salt="s")])
    bundles = {c.kind: c for c in scheduler.checkpoint_store.checkpoints()}
    assert bundles["prompt"].demoted and not bundles["response"].demoted
    resend = make_request(prompt, salt="s")
    driver.run([resend])
    assert driver.cached_tokens[resend.request_id] == len(prompt) - 1
