"""``prompt_capture: end`` on vLLM's real scheduler (CPU, shadow runner): the prompt checkpoint
holds the state after all ``P`` prompt tokens, copied after the step that computes them, with no
stop and no split; a prompt that extends the prompt restores all of it, a resend of the same
prompt gets vLLM's block-grid hit and keeps ``P - 1`` for the sends after it, and a corrupted
checkpoint is caught.

The shadow runner raises if a restored request ever reads a recurrent state or attention row that
differs from the recomputed one.
"""

from __future__ import annotations

import random

import pytest
from chunk_recorder import record_chunk_ends
from shadow_engine import ShadowMismatch
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

BLOCK = 16


def _end_scheduler(model_dir, lag: int):
    scheduler, worker = build_scheduler(model_dir, async_scheduling=bool(lag), prompt_capture="end")
    return scheduler, worker, Driver(scheduler, worker, lag=lag)


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("prompt_len", [2, 15, 16, 17, 33, 40])
def test_the_prompt_checkpoint_sits_at_p_and_costs_no_stop(model_dir, lag, prompt_len):
    scheduler, worker, driver = _end_scheduler(model_dir, lag)
    chunk_ends = record_chunk_ends(scheduler)
    rng = random.Random(prompt_len)
    prompt = tokens(rng, prompt_len)
    first = make_request(prompt, salt="s")
    driver.run([first])
    # vLLM's own align-mode split ends a chunk at the last block boundary below P; the plugin adds none.
    assert [end for end in chunk_ends[first.request_id] if end % BLOCK and end < prompt_len] == []
    stats = scheduler.boundary_stats()
    assert stats["prompt_stops"] == 0 and stats["prompt_captures_in_step"] == 0 and worker.in_step_captures == 0
    prompts = [c for c in scheduler.checkpoint_store.checkpoints() if c.kind == "prompt"]
    assert [c.key.num_tokens for c in prompts] == [prompt_len]

    # A later turn whose history is not the generated answer (a template that re-renders it)
    # shares only the prompt: it restores all P tokens.
    later = make_request(prompt + tokens(rng, 6), salt="s")
    cold = make_request(later.prompt_token_ids, salt="cold")
    [out_later] = driver.run([later])
    [out_cold] = driver.run([cold])
    assert driver.cached_tokens[later.request_id] == prompt_len
    assert driver.cached_tokens[cold.request_id] == 0
    assert out_later == out_cold
    assert worker.restored_reads >= 1


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("prompt_len", [17, 40])
def test_a_resend_gets_the_block_grid_hit_and_keeps_p_minus_1_for_the_next(model_dir, lag, prompt_len):
    scheduler, worker, driver = _end_scheduler(model_dir, lag)
    prompt = tokens(random.Random(prompt_len), prompt_len)
    [out_first] = driver.run([make_request(prompt, salt="s")])
    resend = make_request(prompt, salt="s")
    assert driver.run([resend]) == [out_first]
    assert driver.cached_tokens[resend.request_id] == (prompt_len - 1) // BLOCK * BLOCK
    # The resend took P - 1 inside its step (in-step capture, as auto does on this engine), unless
    # vLLM's block grid already reached P - 1.
    taken = int((prompt_len - 1) % BLOCK != 0)
    assert scheduler.boundary_stats()["prompt_captures_in_step"] == taken and worker.in_step_captures == 2 * taken
    third = make_request(prompt, salt="s")
    assert driver.run([third]) == [out_first]
    assert driver.cached_tokens[third.request_id] == prompt_len - 1
    assert scheduler.boundary_stats()["prompt_captures_in_step"] == taken  # the third captured nothing again


def test_the_next_turn_still_restores_the_response(model_dir):
    scheduler, worker, driver = _end_scheduler(model_dir, lag=1)
    rng = random.Random(5)
    prompt = tokens(rng, 40)
    [out_first] = driver.run([make_request(prompt, salt="s")])
    turn = make_request(prompt + out_first + tokens(rng, 5), salt="s")
    driver.run([turn])
    assert driver.cached_tokens[turn.request_id] == len(prompt) + len(out_first) - 1


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
def test_a_one_token_answer_is_restored_at_p(model_dir, lag):
    """With ``max_tokens=1`` the request finishes at ``P``: synchronously no next step carries the
    prompt checkpoint's copies, and its response bundle (adopted, at ``P`` too) takes its place."""
    scheduler, worker, driver = _end_scheduler(model_dir, lag)
    rng = random.Random(9)
    prompt = tokens(rng, 40)
    driver.run([make_request(prompt, salt="s", max_tokens=1)])
    later = make_request(prompt + tokens(rng, 3), salt="s")
    driver.run([later])
    assert driver.cached_tokens[later.request_id] == 40
    assert scheduler.boundary_stats()["captures_dropped"] == 0


def test_a_corrupted_prompt_end_checkpoint_is_caught(model_dir):
    """Negative control: flip the retained state of the checkpoint at ``P``; the later turn that
    restores it reads a wrong state."""
    scheduler, worker, driver = _end_scheduler(model_dir, lag=0)
    rng = random.Random(11)
    prompt = tokens(rng, 40)
    driver.run([make_request(prompt, salt="s")])
    checkpoint = next(c for c in scheduler.checkpoint_store.checkpoints() if c.kind == "prompt")
    worker.states[checkpoint.group_blocks[1][-1].block_id] ^= 1
    with pytest.raises(ShadowMismatch):
        driver.run([make_request(prompt + tokens(rng, 6), salt="s")])
