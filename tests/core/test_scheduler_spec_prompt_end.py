"""``prompt_capture: end`` under MTP speculative decoding: vLLM's real Scheduler, driven step by step
(CPU, the ``spec_shadow.py`` runner, sync and async). A fresh prompt's prefill runs to ``P`` with no
stop; its checkpoint at ``P`` is copied before the next (verify) step's forward and guarded by the
first sampled token; an explicit ``stop`` keeps the stop at ``P - 1``. Negative controls: copies
held back past the verify step, and a checkpoint at ``P`` without its next-token guard, are caught.
Without speculative decoding: ``test_scheduler_prompt_end.py``.
"""

from __future__ import annotations

import random

import pytest
from corrupt_restore import HeldPromptCopies
from shadow_engine import ShadowMismatch
from shadow_scheduler import make_request, tokens
from spec_expectations import check_next_turn, pattern, published, spec_engine

from boundary_checkpoints.core.boundaries import PROMPT
from boundary_checkpoints.core.scheduler import BoundaryAsyncScheduler, BoundaryScheduler

END_CASES = [(k, lag, n) for k in (1, 3) for lag in (0, 1) for n in (15, 16, 17, 40)] + [(2, 1, 33), (2, 0, 31)]


def _other_than(token: int) -> int:
    return 4 + (token - 3) % 1000


@pytest.mark.parametrize(("k", "lag", "prompt_len"), END_CASES)
def test_prompt_checkpoint_at_p_under_mtp_takes_no_stop_and_is_guarded_by_the_first_sampled_token(
    model_dir, k, lag, prompt_len
):
    """``end`` under MTP: a fresh prompt's prefill runs to ``P`` without a stop; its checkpoint at
    ``P`` is copied before the next (verify) step's forward, and records the first sampled token,
    which its MTP draft row ``P - 1`` read. A later prompt that extends the prompt with that token
    restores exactly ``P`` (every state column and draft row the shadow checks); one with another
    token at ``P`` does not restore it (counted); a resend gets vLLM's block-grid hit and stops at
    ``P - 1``, so the send after it restores ``P - 1``."""
    scheduler, worker, driver = spec_engine(model_dir, k, pattern("one", k), async_scheduling=bool(lag),
                                            prompt_capture="end")  # fmt: skip
    assert scheduler._prompt_at_end and scheduler._next_token_guard
    rng = random.Random(prompt_len * 11 + k)
    prompt = tokens(rng, prompt_len)
    [answer] = driver.run([make_request(prompt, max_tokens=8, salt="s")])
    stats = scheduler.boundary_stats()
    assert stats["prompt_stops"] == 0 and stats["prompt_captures_in_step"] == 0
    [bundle] = published(scheduler, PROMPT)
    assert bundle.num_tokens == prompt_len and bundle.next_token == answer[0]

    # A later turn whose history re-renders the answer after its first token (so no response
    # checkpoint serves it) restores all of the prompt.
    later = prompt + [answer[0], _other_than(answer[1])] + tokens(rng, 4)
    check_next_turn(driver, later, 4, prompt_len)
    assert scheduler.boundary_stats()["draft_next_token_fallbacks"] == 0

    # Another token at P: the MTP draft row P - 1 of the bundle read the sampled one.
    edited = make_request(prompt + [_other_than(answer[0])] + tokens(rng, 4), max_tokens=3, salt="s")
    cold = make_request(edited.prompt_token_ids, max_tokens=3, salt="cold")
    assert driver.run([edited]) == driver.run([cold])
    assert driver.cached_tokens[edited.request_id] < prompt_len - 1  # a stock block-grid hit at most
    assert scheduler.boundary_stats()["miss_draft_next_token"] == 1

    resend = make_request(prompt, max_tokens=3, salt="s")
    driver.run([resend])
    assert driver.cached_tokens[resend.request_id] < prompt_len - 1
    assert scheduler.boundary_stats()["prompt_stops"] == 1  # the resend keeps P - 1 by the stop
    if lag:
        return  # the async shadow has no drafts for the padded row a restore at P - 1 leaves
    third = make_request(prompt, max_tokens=3, salt="s")
    driver.run([third])
    assert driver.cached_tokens[third.request_id] == prompt_len - 1
    # Now a shorter bundle serves the edited prompt: the guard's refusal is a fallback.
    again = make_request(edited.prompt_token_ids, max_tokens=3, salt="s")
    assert driver.run([again]) == driver.run([make_request(edited.prompt_token_ids, max_tokens=3, salt="cold2")])
    assert driver.cached_tokens[again.request_id] == prompt_len - 1
    assert scheduler.boundary_stats()["draft_next_token_fallbacks"] == 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_explicit_stop_keeps_the_p_minus_1_stop_under_mtp(model_dir, async_scheduling):
    scheduler, worker, driver = spec_engine(model_dir, 2, pattern("one", 2), async_scheduling=async_scheduling,
                                            prompt_capture="stop")  # fmt: skip
    prompt = tokens(random.Random(3), 20)
    driver.run([make_request(prompt, max_tokens=4, salt="s")])
    assert scheduler.boundary_stats()["prompt_stops"] == 1
    [bundle] = published(scheduler, PROMPT)
    assert bundle.num_tokens == 19 and bundle.next_token == prompt[-1]


class LateEndCopyScheduler(HeldPromptCopies, BoundaryScheduler):
    """Negative control: the prompt checkpoint at ``P`` copied one step late, after the verify step
    that follows the prefill wrote its state columns."""


def test_a_prompt_checkpoint_copied_after_the_verify_step_is_caught(model_dir):
    scheduler, worker, driver = spec_engine(model_dir, 1, pattern("one", 1), LateEndCopyScheduler,
                                            prompt_capture="end")  # fmt: skip
    rng = random.Random(7)
    prompt = tokens(rng, 20)  # P - 1 and the verify step's end in one block: it rewrites the state column
    [answer] = driver.run([make_request(prompt, max_tokens=6, salt="s")])
    assert [c.num_tokens for c in published(scheduler, PROMPT)] == [20]
    with pytest.raises(ShadowMismatch, match="recurrent state"):
        driver.run([make_request(prompt + [answer[0], _other_than(answer[1])] + tokens(rng, 4), max_tokens=3,
                                 salt="s")])  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_without_the_guard_a_restore_at_p_reads_a_wrong_mtp_draft_row(model_dir, async_scheduling):
    """Negative control: the checkpoint at ``P`` without its next token serves a prompt with
    another token at ``P``, whose MTP draft row ``P - 1`` differs."""
    cls = type("Unguarded", (BoundaryAsyncScheduler if async_scheduling else BoundaryScheduler,), {})

    def settle(self, output, runner_output):
        BoundaryScheduler._settle_speculative_step(self, output, runner_output)
        for pending in self._pending:
            if pending.kind == PROMPT:
                pending.checkpoint.next_token = None

    cls._settle_speculative_step = settle
    scheduler, worker, driver = spec_engine(model_dir, 1, pattern("one", 1), cls, async_scheduling,
                                            prompt_capture="end")  # fmt: skip
    rng = random.Random(4)
    prompt = tokens(rng, 20)
    [answer] = driver.run([make_request(prompt, max_tokens=6, salt="s")])
    with pytest.raises(ShadowMismatch, match="MTP draft row 19"):
        driver.run([make_request(prompt + [_other_than(answer[0])] + tokens(rng, 4), max_tokens=3, salt="s")])
