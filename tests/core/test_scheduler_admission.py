"""Prompt admission on vLLM's real scheduler (the shadow runner): under ``prompt_admission: auto``
fresh prompts that nothing reuses stop keeping checkpoints after ``MIN_EVIDENCE`` prompts (one in
``SAMPLE_EVERY`` still does), and a skipped prompt sent again keeps its checkpoint, so that the
sends after it restore all but the last token. ``all`` is the control: every prompt keeps one."""

from __future__ import annotations

import random

import pytest
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.core.admission import MIN_EVIDENCE, SAMPLE_EVERY

FRESH = MIN_EVIDENCE + 4 * SAMPLE_EVERY  # the 4 multiples of SAMPLE_EVERY after the evidence keep one


def fresh_prompts(model_dir, admission: str):
    scheduler, worker = build_scheduler(
        model_dir, num_blocks=2048, max_retained_fraction=0.5, prompt_admission=admission, prompt_capture="auto"
    )
    driver = Driver(scheduler, worker)
    rng = random.Random(5)
    prompts = [tokens(rng, 40) for _ in range(FRESH)]
    for prompt in prompts:
        driver.run([make_request(prompt, max_tokens=2)])
    return scheduler, driver, prompts


@pytest.mark.parametrize(("admission", "skipped"), [("auto", FRESH - MIN_EVIDENCE - 4), ("all", 0)])
def test_fresh_prompts_stop_keeping_checkpoints_under_auto(model_dir, admission, skipped):
    scheduler, _, _ = fresh_prompts(model_dir, admission)
    assert scheduler.checkpoint_store.counters.prompts_skipped == skipped


def test_a_skipped_prompt_sent_again_keeps_its_checkpoint(model_dir):
    scheduler, driver, prompts = fresh_prompts(model_dir, "auto")
    counters = scheduler.checkpoint_store.counters
    skipped_before = counters.prompts_skipped
    prompt = prompts[-2]  # sampled out (the last one, a multiple of SAMPLE_EVERY, was kept)
    cached = []
    for _ in range(3):
        request = make_request(prompt, max_tokens=2)
        driver.run([request])
        cached.append(driver.cached_tokens[request.request_id])
    assert counters.prompts_skipped == skipped_before  # every send again is admitted
    # The first send again keeps P, the second P - 1 (a resend), which the third restores.
    assert cached[0] < len(prompt) - 1
    assert cached[2] == len(prompt) - 1
