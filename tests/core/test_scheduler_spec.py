"""MTP speculative decoding with boundary checkpoints: vLLM's real Scheduler, driven step by step.

The shadow runner (``spec_shadow.py``) mirrors align mode's speculative state columns and the MTP
draft rows; it raises :class:`ShadowMismatch` whenever a step reads a recurrent state, a target
row or an MTP draft row that differs from what a cold run computed. Drafts are scripted: each step
proposes ``k`` drafts of which the first ``accept(request, step)`` are right. Under async
scheduling (driven with one step in flight, as vLLM's engine core does) the shadow runs its own
drafts in place of the scheduler's placeholders. The prompt checkpoint at ``P`` under MTP
(``prompt_capture: end``): ``test_scheduler_spec_prompt_end.py``.
"""

from __future__ import annotations

import random

import pytest
from mtp_checks import UNSERVED_COUNTERS, unserved_responses
from shadow_engine import ShadowMismatch
from shadow_scheduler import make_request, tokens
from spec_expectations import (
    BLOCK,
    CASES,
    async_path,
    check_next_turn,
    expected_async_boundary,
    expected_response_boundary,
    greedy_next,
    pattern,
    published,
    spec_engine,
)

from boundary_checkpoints.core.boundaries import PROMPT, RESPONSE
from boundary_checkpoints.core.layout import describe_layout
from boundary_checkpoints.core.scheduler import BoundaryAsyncScheduler, BoundaryScheduler


@pytest.mark.parametrize(("k", "accept", "prompt_len", "max_tokens"), CASES)
def test_response_bundle_holds_the_committed_state_and_restores_exactly(model_dir, k, accept, prompt_len, max_tokens):
    """The producer's response checkpoint lands at its last step's exact state (column 0), the
    next turn restores there and every read of the shadow runner matches a cold run."""
    scheduler, worker, driver = spec_engine(model_dir, k, pattern(accept, k))
    rng = random.Random(prompt_len * 7 + k)
    prompt = tokens(rng, prompt_len)
    producer = make_request(prompt, max_tokens=max_tokens, salt="s")
    [answer] = driver.run([producer])
    assert len(answer) == max_tokens
    last = worker.steps[producer.request_id][-1]
    boundary = expected_response_boundary(last, prompt_len + max_tokens)
    assert [c.num_tokens for c in published(scheduler, RESPONSE)] == ([boundary] if boundary else [])
    assert boundary == 0 or prompt_len <= boundary <= prompt_len + max_tokens - 1

    check_next_turn(driver, prompt + answer + tokens(rng, 5), 4, boundary or prompt_len - 1)
    accepted = sum(s.num_accepted for s in worker.steps[producer.request_id] if s.num_drafts)
    if accept != "none":
        assert accepted > sum(1 for s in worker.steps[producer.request_id] if s.num_drafts)  # drafts were accepted


class CommittedCountScheduler(BoundaryScheduler):
    """Negative control: the response capture of a run without speculation (the committed count,
    state block ``(N - 1) // B``), which reads a column written after a draft."""

    def _response_boundary(self, request):
        return request.num_computed_tokens, None, None


def test_the_committed_count_rule_reads_the_wrong_column_under_speculation(model_dir):
    """With accepted drafts in the last step, the stock rule keys the state after ``c + 1``
    tokens under the committed count ``c + a``: the next turn's restore reads a wrong state."""
    scheduler, worker, driver = spec_engine(model_dir, 2, pattern("one", 2), CommittedCountScheduler)
    rng = random.Random(5)
    prompt = tokens(rng, 20)
    producer = make_request(prompt, max_tokens=9, salt="s")  # 1 + 4 steps of 2: no length-cap trim
    [answer] = driver.run([producer])
    last = worker.steps[producer.request_id][-1]
    assert last.num_accepted == 2 and last.end % BLOCK  # the case the rule gets wrong
    assert [c.num_tokens for c in published(scheduler, RESPONSE)] == [last.start + 2]
    continuation = make_request(prompt + answer + tokens(rng, 5), max_tokens=4, salt="s")
    with pytest.raises(ShadowMismatch, match="recurrent state"):
        driver.run([continuation])


def test_a_stop_token_among_accepted_drafts_keeps_an_exact_checkpoint(model_dir):
    """A stop token accepted as a draft trims the answer behind vLLM's computed count; the
    response checkpoint stays at the last step's first token, inside the kept answer."""
    k = 3
    scheduler, worker, driver = spec_engine(model_dir, k, pattern("all", k))
    rng = random.Random(11)
    prompt = tokens(rng, 20)
    probe = make_request(prompt, max_tokens=16, salt="probe")
    [full] = driver.run([probe])
    # A token sampled as the second of a step that accepted every draft: a stop there trims two.
    position, offset = 0, len(prompt)
    for step in worker.steps[probe.request_id]:
        if step.num_drafts and step.num_accepted == k + 1:
            position = step.start + 2 - offset
            if full[position] not in full[:position]:
                break
    stop = full[position]
    producer = make_request(prompt, max_tokens=16, salt="s", stop_token_ids=[stop])
    [answer] = driver.run([producer])
    assert answer == full[: position + 1]
    last = worker.steps[producer.request_id][-1]
    assert last.start + last.num_accepted > len(prompt) + len(answer) - 1  # computed past the kept tokens
    [response] = [c for c in published(scheduler, RESPONSE) if c.producer == producer.request_id]
    assert response.num_tokens == last.end - last.num_drafts <= len(prompt) + len(answer) - 1
    continuation = make_request(prompt + answer + tokens(rng, 4), max_tokens=3, salt="s")
    driver.run([continuation])
    assert driver.cached_tokens[continuation.request_id] == response.num_tokens


@pytest.mark.parametrize("prompt_len", [17, 20, 33])
def test_prompt_boundary_with_lookahead_one_and_the_next_token_guard(model_dir, prompt_len):
    """Single-module MTP (prefill lookahead 1): prefills stop at ``P - 1`` and a resend restores
    there. The prompt bundle's MTP draft row ``P - 2`` was computed from token ``P - 1``: a prompt
    that shares the first ``P - 1`` tokens but not token ``P - 1`` does not restore it."""
    scheduler, worker, driver = spec_engine(model_dir, 1, pattern("all", 1))
    rng = random.Random(prompt_len)
    prompt = tokens(rng, prompt_len)
    driver.run([make_request(prompt, max_tokens=3, salt="s")])
    [bundle] = published(scheduler, PROMPT)
    assert bundle.num_tokens == prompt_len - 1 and bundle.next_token == prompt[-1]
    resend = make_request(prompt, max_tokens=3, salt="s")
    driver.run([resend])
    assert driver.cached_tokens[resend.request_id] == prompt_len - 1
    other = prompt[:-1] + [4 + (prompt[-1] - 3) % 1000] + tokens(rng, 3)
    edited = make_request(other, max_tokens=3, salt="s")
    driver.run([edited])
    assert driver.cached_tokens[edited.request_id] < prompt_len - 1  # a stock block-grid hit at most
    assert scheduler.boundary_stats()["miss_draft_next_token"] == 1


class UnguardedScheduler(BoundaryScheduler):
    """Negative control: bundles without the next-token guard."""

    def _plan_capture(self, *args, **kwargs):
        super()._plan_capture(*args, **kwargs)
        for pending in self._pending:
            pending.checkpoint.next_token = None


def test_without_the_guard_a_restore_reads_a_wrong_mtp_draft_row(model_dir):
    scheduler, worker, driver = spec_engine(model_dir, 1, pattern("all", 1), UnguardedScheduler)
    rng = random.Random(3)
    prompt = tokens(rng, 20)
    driver.run([make_request(prompt, max_tokens=3, salt="s")])
    other = prompt[:-1] + [4 + (prompt[-1] - 3) % 1000] + tokens(rng, 3)
    with pytest.raises(ShadowMismatch, match="MTP draft row 18"):
        driver.run([make_request(other, max_tokens=3, salt="s")])


def test_layout_accepts_speculative_columns_only_for_the_configured_draft_count(model_dir):
    scheduler, _, _ = spec_engine(model_dir, 2, pattern("all", 2))
    assert scheduler.boundaries_active
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    _, reasons = describe_layout(scheduler.kv_cache_config, managers, num_spec_tokens=2)
    assert reasons == []
    _, reasons = describe_layout(scheduler.kv_cache_config, managers, num_spec_tokens=3)
    assert any("keeps 2 speculative state blocks for 3 draft tokens" in r for r in reasons)
    _, reasons = describe_layout(scheduler.kv_cache_config, managers, num_spec_tokens=0)
    assert any("for 0 draft tokens" in r for r in reasons)


# ---- async scheduling: a request finishes with its next verify step in flight -----------------


# (k, accept pattern, prompt length, max tokens, path of the producer's last step)
ASYNC_CASES = [
    (1, "one", 17, 3, "in_flight"),
    (1, "one", 23, 9, "crossing"),
    (1, "one", 20, 11, "overwritten"),
    (1, "cycle", 17, 5, "finish"),
    (2, "one", 17, 5, "in_flight"),
    (2, "one", 20, 11, "crossing"),
    (2, "all", 17, 13, "overwritten"),
    (2, "all", 17, 3, "trimmed"),
    (2, "all", 17, 5, "finish"),
    (3, "one", 17, 7, "in_flight"),
    (3, "all", 40, 17, "in_flight"),
    (3, "one", 17, 13, "crossing"),
    (3, "all", 20, 9, "overwritten"),
    (3, "all", 17, 11, "trimmed"),
    (3, "cycle", 17, 7, "finish"),
]


@pytest.mark.parametrize(("k", "accept", "prompt_len", "max_tokens", "path"), ASYNC_CASES)
def test_async_response_bundle_adopts_the_in_flight_step_and_restores_exactly(
    model_dir, k, accept, prompt_len, max_tokens, path
):
    """Async scheduling: a response finished with a verify step in flight keeps the state that
    step leaves after every token (its column 0), keyed with the token it sampled first; a length
    cap inside accepted drafts, or a step that overwrote its column, leaves none (counted)."""
    scheduler, worker, driver = spec_engine(model_dir, k, pattern(accept, k), async_scheduling=True)
    rng = random.Random(prompt_len * 7 + k)
    prompt = tokens(rng, prompt_len)
    producer = make_request(prompt, max_tokens=max_tokens, salt="s")
    [answer] = driver.run([producer])
    assert len(answer) == max_tokens
    num_tokens = prompt_len + len(answer)
    steps = worker.steps[producer.request_id]
    assert async_path(steps, num_tokens) == path
    boundary = expected_async_boundary(steps, num_tokens)
    responses = published(scheduler, RESPONSE)
    assert [c.num_tokens for c in responses] == ([boundary] if boundary else [])
    assert scheduler.boundary_stats()["responses_spec_in_flight"] == (path in ("trimmed", "overwritten"))
    assert scheduler.boundary_stats()["captures_pending"] == 0

    next_token = greedy_next(prompt + answer)
    if boundary == num_tokens:  # the in-flight step's bundle serves only its own next token
        other = prompt + answer + [4 + (next_token - 3) % 1000] + tokens(rng, 5)
        edited = make_request(other, max_tokens=4, salt="s")
        driver.run([edited])
        assert driver.cached_tokens[edited.request_id] == prompt_len - 1  # the prompt checkpoint
    check_next_turn(driver, prompt + answer + [next_token] + tokens(rng, 5), 4, boundary or prompt_len - 1)


@pytest.mark.parametrize(("k", "max_tokens"), [(1, 3), (2, 5), (3, 7)])
def test_next_turns_the_guard_refuses_are_counted(model_dir, k, max_tokens):
    """Under async scheduling (planted fixture, k = 1 on a GPU) producers finish with their next
    step in flight, and each in-flight bundle is keyed with the token that step sampled. A
    continuation with another token (the successor of the answer's last token, which the target
    did not sample there) is refused that bundle by the guard, rightly (its MTP draft row ``N - 1``
    was computed from the sampled token, and no exact state before ``N`` is left); the lookup then
    restores the prompt checkpoint at ``P - 1``. Counted by kind only, such a hit would hide the
    refusal; only a prompt of one token (no prompt checkpoint) would count a miss
    ``draft_next_token``. Here each refusal is counted either
    way, so the GPU test's account of continuations restored at ``P - 1``
    (``mtp_checks.unserved_responses``) covers every one; a next turn with the sampled token still
    restores the whole in-flight boundary."""
    scheduler, worker, driver = spec_engine(model_dir, k, pattern("one", k), async_scheduling=True)
    rng = random.Random(100 + k)
    conversations = []
    for prompt_len in (1, 17, 33):
        prompt = tokens(rng, prompt_len)
        producer = make_request(prompt, max_tokens=max_tokens, salt="s")
        [answer] = driver.run([producer])
        assert async_path(worker.steps[producer.request_id], prompt_len + len(answer)) == "in_flight"
        conversations.append((prompt, answer, greedy_next(prompt + answer)))
    before = scheduler.boundary_stats()
    # Another token N first (one batch): restoring the prompt checkpoint retires nothing, while a
    # next turn restored from the response retires its producer's prompt checkpoint (lineage).
    others = [
        make_request(p + a + [4 + (sampled - 3) % 1000] + tokens(rng, 5), max_tokens=3, salt="s")
        for p, a, sampled in conversations
    ]
    driver.run(others)
    assert [driver.cached_tokens[r.request_id] for r in others] == [len(p) - 1 for p, _, _ in conversations]
    stats = scheduler.boundary_stats()
    counted = {name: stats.get(name, 0) - before.get(name, 0) for name in UNSERVED_COUNTERS}
    assert counted == {"draft_next_token_fallbacks": 2, "miss_draft_next_token": 1, "responses_spec_in_flight": 0}
    assert unserved_responses(counted) == len(others)  # every restore at P - 1 is accounted for
    assert stats["hit_prompt"] - before.get("hit_prompt", 0) == 2
    same = [make_request(p + a + [sampled] + tokens(rng, 5), max_tokens=3, salt="s") for p, a, sampled in conversations]
    driver.run(same)
    assert [driver.cached_tokens[r.request_id] for r in same] == [len(p) + len(a) for p, a, _ in conversations]
    after = scheduler.boundary_stats()
    assert all(after.get(name, 0) == stats.get(name, 0) for name in UNSERVED_COUNTERS), after


def stop_position(steps, prompt_len: int, where: str) -> int:
    """Output index of a token sampled by a drafting step: its last (``last``) or, in a step
    that accepted a draft, its first (``inside``: a stop there trims the rest)."""
    for step in steps:
        if not step.num_drafts or (where == "inside" and step.num_accepted < 2):
            continue
        first = step.end - step.num_drafts - prompt_len
        return first + step.num_accepted - 1 if where == "last" else first
    raise AssertionError("no such step")


@pytest.mark.parametrize(("k", "accept", "where", "path"), [
    (1, "none", "last", "in_flight"),
    (2, "none", "last", "in_flight"),
    (3, "all", "last", "in_flight"),
    (2, "one", "last", "in_flight"),
    (3, "all", "inside", "trimmed"),
    (2, "one", "inside", "trimmed"),
])  # fmt: skip
def test_async_stop_token_with_a_step_in_flight(model_dir, k, accept, where, path):
    """A stop token sampled last by its step leaves the in-flight step's input untrimmed: the
    response checkpoint holds every token; one among accepted drafts trims that input: none."""
    scheduler, worker, driver = spec_engine(model_dir, k, pattern(accept, k), async_scheduling=True)
    rng = random.Random(40 + k)
    prompt = tokens(rng, 21)
    probe = make_request(prompt, max_tokens=16, salt="probe")
    [full] = driver.run([probe])
    position = stop_position(worker.steps[probe.request_id], len(prompt), where)
    stop = full[position]
    assert stop not in full[:position]
    producer = make_request(prompt, max_tokens=16, salt="s", stop_token_ids=[stop])
    [answer] = driver.run([producer])
    assert answer == full[: position + 1]
    num_tokens = len(prompt) + len(answer)
    steps = worker.steps[producer.request_id]
    assert async_path(steps, num_tokens) == path
    boundary = expected_async_boundary(steps, num_tokens)
    assert [c.num_tokens for c in published(scheduler, RESPONSE) if c.producer == producer.request_id] == (
        [boundary] if boundary else []
    )
    follow_up = prompt + answer + [greedy_next(prompt + answer)] + tokens(rng, 4)
    check_next_turn(driver, follow_up, 3, boundary or len(prompt) - 1)


class StockColumnScheduler(BoundaryAsyncScheduler):
    """Negative control: the in-flight step's bundle with its state read from block ``(N - 1) //
    B`` (the column of a step that ended at ``N``), not from the in-flight step's column 0."""

    def _response_boundary(self, request):
        num_tokens, state_end, in_flight = super()._response_boundary(request)
        return num_tokens, (num_tokens if in_flight is not None else state_end), in_flight


def test_reading_another_column_than_the_in_flight_steps_is_caught(model_dir):
    scheduler, worker, driver = spec_engine(model_dir, 3, pattern("one", 3), StockColumnScheduler, True)
    rng = random.Random(17 * 7 + 3)
    prompt = tokens(rng, 17)
    producer = make_request(prompt, max_tokens=13, salt="s")
    [answer] = driver.run([producer])
    assert async_path(worker.steps[producer.request_id], len(prompt) + len(answer)) == "crossing"
    follow_up = prompt + answer + [greedy_next(prompt + answer)] + tokens(rng, 5)
    with pytest.raises(ShadowMismatch, match="recurrent state"):
        driver.run([make_request(follow_up, max_tokens=4, salt="s")])


class EarlyPublishScheduler(BoundaryAsyncScheduler):
    """Negative control: the in-flight step's bundle published with the finishing step's output,
    before the in-flight step's output gave its next token (so it has no next-token guard)."""

    def _plan_capture(self, *args, **kwargs):
        super()._plan_capture(*args, **kwargs)
        for pending in self._pending:
            if pending.in_flight is not None:
                pending.in_flight, pending.ready_seq = None, self._processed_seq


def test_publishing_before_the_in_flight_step_returned_is_caught(model_dir):
    scheduler, worker, driver = spec_engine(model_dir, 2, pattern("one", 2), EarlyPublishScheduler, True)
    rng = random.Random(17 * 7 + 2)
    prompt = tokens(rng, 17)
    producer = make_request(prompt, max_tokens=5, salt="s")
    [answer] = driver.run([producer])
    num_tokens = len(prompt) + len(answer)
    assert async_path(worker.steps[producer.request_id], num_tokens) == "in_flight"
    assert [c.num_tokens for c in published(scheduler, RESPONSE)] == [num_tokens]
    other = prompt + answer + [4 + (greedy_next(prompt + answer) - 3) % 1000] + tokens(rng, 5)
    with pytest.raises(ShadowMismatch, match=f"MTP draft row {num_tokens - 1}"):
        driver.run([make_request(other, max_tokens=4, salt="s")])
