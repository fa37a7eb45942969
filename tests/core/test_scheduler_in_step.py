"""In-step prompt capture on vLLM's real scheduler (CPU, shadow runner): which prefill steps keep
the ``P - 1`` stop, a capture taken after ``P`` instead is caught, and the engines that fall back
to the stop.

The shadow runner models the GDN layers' split (``shadow_engine``): it writes the state after all
but the last token of a capture row into the destination and raises if a restored request ever
reads a state that differs from the recomputed one.
"""

from __future__ import annotations

import random

import pytest
from chunk_recorder import record_chunk_ends
from shadow_engine import ShadowMismatch
from shadow_scheduler import Driver, build_scheduler, make_request, tokens
from spec_shadow import SpecDriver, SpecShadowWorker

BLOCK = 16


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("prompt_len", [2, 3, 15, 16, 17, 33, 40, 64, 65])
def test_fresh_prompts_are_not_stopped_and_resends_restore_p_minus_1(model_dir, lag, prompt_len):
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    driver = Driver(scheduler, worker, lag=lag)
    chunk_ends = record_chunk_ends(scheduler)
    prompt = tokens(random.Random(prompt_len), prompt_len)
    first = make_request(prompt, salt="s")
    [out_first] = driver.run([first])
    resend = make_request(prompt, salt="s")
    assert driver.run([resend]) == [out_first]
    assert driver.cached_tokens[resend.request_id] == prompt_len - 1
    # vLLM's own align-mode split ends a chunk at the last block boundary below P, which is P - 1
    # when P - 1 is a multiple of the block; the plugin adds no stop.
    assert (prompt_len - 1 in chunk_ends[first.request_id]) == ((prompt_len - 1) % BLOCK == 0)
    stats = scheduler.boundary_stats()
    assert stats["prompt_stops"] == 0
    assert stats["prompt_captures_in_step"] == ((prompt_len - 1) % BLOCK != 0)
    assert worker.in_step_captures == 2 * stats["prompt_captures_in_step"]  # one per recurrent group


def test_a_one_token_remainder_after_a_restore_keeps_the_stop(model_dir):
    """A prompt that restores at ``P - 2`` (an earlier prompt's ``P - 1`` checkpoint) has one token
    before ``P - 1``: after a stop that token runs as a decode row, so the split (which runs it as a
    prefill row) would not be the two-step arithmetic, and the plugin stops there instead."""
    scheduler, worker = build_scheduler(model_dir)
    driver = Driver(scheduler, worker)
    chunk_ends = record_chunk_ends(scheduler)
    prompt = tokens(random.Random(5), 20)
    driver.run([make_request(prompt, salt="s")])  # prompt checkpoint at 19
    longer = make_request(prompt + [7], salt="s")  # P = 21 restores 19 = P - 2
    [out_longer] = driver.run([longer])
    assert driver.cached_tokens[longer.request_id] == 19
    assert chunk_ends[longer.request_id][:2] == [20, 21]
    stats = scheduler.boundary_stats()
    assert (stats["prompt_stops"], stats["prompt_captures_in_step"]) == (1, 1)
    resend = make_request(prompt + [7], salt="s")
    assert driver.run([resend]) == [out_longer]
    assert driver.cached_tokens[resend.request_id] == 20


def test_prompt_checkpoint_min_tokens_applies_to_in_step_captures(model_dir):
    scheduler, worker = build_scheduler(model_dir, prompt_checkpoint_min_tokens=30)
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(6), 20)  # its one step computes 19 < 30 tokens before P - 1
    driver.run([make_request(prompt, salt="s")])
    resend = make_request(prompt, salt="s")
    driver.run([resend])
    assert driver.cached_tokens[resend.request_id] == 16  # the block grid
    stats = scheduler.boundary_stats()
    assert (stats["prompt_stops"], stats["prompt_captures_in_step"]) == (0, 0)


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_a_capture_taken_after_p_instead_is_caught(model_dir, lag):
    """Negative control: ``corrupt_restore``'s schedulers copy the state blocks after the step's
    forward instead of letting the layers split: the bundle keyed ``P - 1`` holds the state after
    ``P``, and the shadow runner catches the resend that restores it."""
    from corrupt_restore import CorruptAsyncScheduler, CorruptScheduler

    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag))
    scheduler.__class__ = CorruptAsyncScheduler if lag else CorruptScheduler
    driver = Driver(scheduler, worker, lag=lag)
    prompt = tokens(random.Random(7), 40)
    driver.run([make_request(prompt, salt="s")])
    assert worker.in_step_captures == 0 and scheduler.boundary_stats()["prompt_captures_in_step"] == 1
    with pytest.raises(ShadowMismatch, match="state at 39 is wrong"):
        driver.run([make_request(prompt, salt="s")])


def test_mtp_speculative_decoding_falls_back_to_the_stop(model_dir):
    """The split handles non-speculative rows only: under MTP the prefill stops at ``P - 1``."""
    scheduler, worker = build_scheduler(model_dir, num_speculative_tokens=1, worker_cls=SpecShadowWorker)
    worker.num_spec = 1
    driver = SpecDriver(scheduler, worker)
    chunk_ends = record_chunk_ends(scheduler)
    prompt = tokens(random.Random(8), 20)
    first = make_request(prompt, salt="s")
    driver.run([first])
    assert 19 in chunk_ends[first.request_id]
    stats = scheduler.boundary_stats()
    assert (stats["prompt_stops"], stats["prompt_captures_in_step"]) == (1, 0)
    assert scheduler._prompt_capture.mode == "stop" and "speculative" in scheduler._prompt_capture.reason


def test_an_indexer_ring_layout_falls_back_to_the_stop(model_dir):
    """The GLM indexer tail ring is copied after its step: an in-step capture would copy the ring
    after ``P``. (GLM's KDA layers are no Qwen GDN layers either; this layout is synthetic.)"""
    scheduler, worker = build_scheduler(model_dir, ring_kpool=4)
    assert scheduler._prompt_capture.mode == "stop" and "ring" in scheduler._prompt_capture.reason
    driver = Driver(scheduler, worker)
    chunk_ends = record_chunk_ends(scheduler)
    first = make_request(tokens(random.Random(9), 22), salt="s")
    driver.run([first])
    assert 21 in chunk_ends[first.request_id]
