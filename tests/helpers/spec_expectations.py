"""MTP speculative decoding on the shadow engine: the engine builder and the expectations the
scheduler tests share (``tests/core/test_scheduler_spec.py``, ``tests/core/test_scheduler_dflash.py``):
where a response checkpoint must be, from the shadow's own record of the producer's steps."""

from __future__ import annotations

from shadow_engine import EMPTY_STATE, advance, sample
from shadow_scheduler import build_scheduler, make_request
from spec_shadow import SpecDriver, SpecShadowWorker

BLOCK = 16


def spec_engine(
    model_dir, k: int, accept, scheduler_cls=None, async_scheduling: bool = False, prompt_capture: str = "in_step"
):
    """The shadow engine under MTP; ``prompt_capture`` as configured (``in_step``, the builder's
    default, stops at ``P - 1`` under speculative decoding; ``auto`` / ``end`` keep ``P``)."""
    scheduler, worker = build_scheduler(
        model_dir,
        num_speculative_tokens=k,
        worker_cls=SpecShadowWorker,
        async_scheduling=async_scheduling,
        prompt_capture=prompt_capture,
    )
    if scheduler_cls is not None:
        scheduler.__class__ = scheduler_cls
    worker.num_spec, worker.accept, worker.async_scheduling = k, accept, async_scheduling
    return scheduler, worker, SpecDriver(scheduler, worker, lag=1 if async_scheduling else 0)


def expected_response_boundary(step, num_tokens: int, block: int = BLOCK) -> int:
    """Where the response checkpoint must be (0: nowhere), from the producer's last step and its
    final token count (computed by the test from the shadow's record, not by the plugin)."""
    if step.num_drafts == 0:
        boundary = step.start + step.num_accepted
    elif step.num_accepted == step.num_drafts + 1 and step.end % block == 0:
        boundary = step.end  # vLLM's post-step copy moved the committed state whole into column 0
    else:
        boundary = step.end - step.num_drafts
    return boundary if boundary < num_tokens else 0  # a length cap trimmed what it covers


def published(scheduler, kind: str) -> list:
    return [c for c in scheduler.checkpoint_store.checkpoints() if c.kind == kind]


# (k, accept pattern, prompt length, max tokens): none / all / some drafts accepted, a final step
# that crosses a block or ends on one; (3, all, 20, 12) ends on a block with drafts past the length
# cap: no exact state is left, and no response checkpoint.
CASES = [
    (1, "none", 20, 9),
    (1, "all", 20, 9),
    (2, "all", 27, 8),
    (2, "one", 20, 10),
    (3, "all", 20, 12),
    (3, "two", 21, 11),
    (3, "cycle", 40, 17),
]


def check_next_turn(driver, follow_up: list[int], max_tokens: int, expected_cached: int) -> None:
    """``follow_up`` (same salt as its producer) caches exactly ``expected_cached`` tokens and
    answers as the same prompt computed cold under another salt."""
    continuation = make_request(follow_up, max_tokens=max_tokens, salt="s")
    cold = make_request(follow_up, max_tokens=max_tokens, salt="cold")
    [restored] = driver.run([continuation])
    [from_cold] = driver.run([cold])
    assert driver.cached_tokens[continuation.request_id] == expected_cached
    assert restored == from_cold


def pattern(name: str, k: int):
    return {
        "none": lambda request_id, step: 0,
        "all": lambda request_id, step: k,
        "one": lambda request_id, step: 1,
        "two": lambda request_id, step: 2,
        "cycle": lambda request_id, step: step % (k + 1),
    }[name]


def greedy_next(prefix: list[int]) -> int:
    """The token the shadow samples after ``prefix`` (what an in-flight step samples first)."""
    state = EMPTY_STATE
    for token in prefix:
        state = advance(state, token)
    return sample(state)


def async_path(steps, num_tokens: int, block: int = BLOCK) -> str:
    """How the producer's last step (the shadow's record) relates to its final ``num_tokens``:
    ``finish`` (it sampled the last token: nothing was in flight), ``trimmed`` (in flight on a
    token a stop or length cap dropped), ``overwritten`` (in flight, accepted every draft and
    ended on a block), ``crossing`` (in flight, ending in the block after token ``num_tokens -
    1``) or ``in_flight``."""
    last = steps[-1]
    if last.start < num_tokens - 1:
        return "finish"
    if last.start > num_tokens - 1:
        return "trimmed"
    if last.num_drafts and last.num_accepted == last.num_drafts + 1 and last.end % block == 0:
        return "overwritten"
    return "crossing" if (num_tokens - 1) // block != (last.end - 1) // block else "in_flight"


def expected_async_boundary(steps, num_tokens: int) -> int:
    """Where the response checkpoint must be (0: nowhere), from the shadow's record: the
    finishing step's rule without a step in flight, else the state after every token."""
    path = async_path(steps, num_tokens)
    if path == "finish":
        return expected_response_boundary(steps[-1], num_tokens)
    return num_tokens if path in ("in_flight", "crossing") else 0
