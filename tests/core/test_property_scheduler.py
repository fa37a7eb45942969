"""Property tests: random streams of scheduler operations against the shadow model.

Hypothesis draws a block-pool configuration (and how prompt checkpoints are taken: in the step
that computes the prompt, or by stopping at ``P - 1``) and a stream of operations -- add a fresh request,
resend an earlier prompt (same or another salt), branch off an earlier prompt, send the next
turn of a conversation, abort an unfinished request, run a few engine steps, reset the prefix
cache with running requests (as POST /reset_prefix_cache, pause and sleep do) -- and plays it on
vLLM's real scheduler with the plugin (sync, and async with one step in flight) against
:class:`shadow_engine.ShadowWorker`. The pools are small, so preemptions and checkpoint
evictions happen all the time.

Invariants, checked after every operation and once every request has finished:

* no :class:`~shadow_engine.ShadowMismatch`: every state or attention row a request reads
  (restored ones included) equals the one recomputed from its own tokens;
* restored == cold: every request's output tokens are (a prefix of, while it runs or when it
  was aborted) the shadow model's greedy output computed from its prompt alone;
* isolation: the cached tokens vLLM reports for a request never exceed the longest common
  prefix of its prompt with the tokens of a request of the same salt added before it (so a
  first request of a salt, or one of another salt, reports 0), nor ``P - 1``;
* provenance: every retained checkpoint is ``P - 1`` of some prompt or the committed length of
  a request that finished STOPPED or LENGTH_CAPPED (aborted producers publish nothing);
* budget: the store never retains more blocks than ``max_retained_fraction`` of the pool;
* no leak: once everything finished and the store is cleared, the pool has as many free
  blocks as before the first request.

Over each test (not per example) hits, restores, evictions, preemptions and dropped captures
must all have happened, otherwise the stream is too tame to mean anything. Those invariants only
bound cached tokens from above; ``test_boundaries_hit_exactly_on_a_roomy_pool`` checks from
below that, without pressure, resends and next turns restore exactly at their boundaries.

Size: a small default for CI. ``BC_PROPERTY_OPS=N`` runs at least ``N`` operations in total
(half sync, half async) and prints the totals::

    BC_PROPERTY_OPS=10000 .venv/bin/python -m pytest -q tests/core/test_property_scheduler.py -s

``BC_PROPERTY_SEED`` replaces the fixed seed (the streams are reproducible for a given seed).

The player (``Stream``) and these checks are in ``tests/helpers/property_stream.py`` and, shared with
the MTP property tests, ``tests/helpers/property_player.py``; this module draws the examples and runs them.
"""

from __future__ import annotations

import math
import os
import time

import pytest
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st
from property_ops import Abort, Branch, Continue, Fresh, Resend, Reset, Steps, random_tokens, reference_output
from property_player import Tracked
from property_stream import PoolConfig, Stream, Totals

pytestmark = pytest.mark.usefixtures("quiet_vllm")  # conftest: vLLM's INFO lines off

SALTS = (None, "a", "b")

SEED = int(os.environ.get("BC_PROPERTY_SEED", "20261129"))  # another seed explores other streams
TARGET_OPS = int(os.environ.get("BC_PROPERTY_OPS", "0") or 0)
MODES = {"sync": 0, "async": 1}  # name -> Driver lag (and async scheduling)
if TARGET_OPS:
    MIN_OPS, MAX_OPS = 30, 80
    EXAMPLES = math.ceil(math.ceil(TARGET_OPS / len(MODES)) / MIN_OPS)
else:
    MIN_OPS, MAX_OPS = 5, 60
    EXAMPLES = 100
BOUNDARY_EXAMPLES = 300 if TARGET_OPS else 60


prompt_lengths = st.one_of(st.integers(1, 70), st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65]))
max_tokens = st.integers(1, 10)
stops = st.one_of(st.none(), st.integers(0, 9))
picks = st.integers(0, 1000)
seeds = st.integers(0, 2**16)

fresh = st.builds(Fresh, seeds, prompt_lengths, max_tokens, st.sampled_from(SALTS), stops)
resend = st.builds(Resend, picks, max_tokens, st.one_of(st.just(False), st.sampled_from(SALTS)))
branch = st.builds(Branch, picks, st.integers(1, 70), st.integers(0, 20), seeds, max_tokens)
continuation = st.builds(Continue, picks, st.integers(0, 20), seeds, max_tokens, stops)
abort = st.builds(Abort, picks)
steps = st.builds(Steps, st.integers(1, 5))
reset = st.builds(Reset)
# one_of picks its branches uniformly: repeating one weights it.
operations = st.one_of(
    fresh, fresh, resend, resend, branch, continuation, continuation, abort, steps, steps, steps, reset
)
# Every stream starts with a fresh request, so that the other operations have something to use.
streams = st.builds(
    lambda first, rest: [first, *rest], fresh, st.lists(operations, min_size=MIN_OPS - 1, max_size=MAX_OPS - 1)
)


pool_configs = st.builds(
    PoolConfig,
    st.one_of(st.integers(20, 32), st.integers(33, 80)),  # small pools preempt, larger ones retain
    st.sampled_from([32, 48, 64]),
    st.sampled_from([0.25, 0.5, 1.0]),
    st.booleans(),
    st.sampled_from(["in_step", "stop"]),
)


# ---- the tests --------------------------------------------------------------------------------
def test_reference_output_honours_stops_and_max_tokens():
    prompt = random_tokens(0, 20)
    full = reference_output(prompt, 10)
    assert len(full) == 10
    assert reference_output(prompt, 3) == full[:3]
    stop = full[4]
    stopped = reference_output(prompt, 10, (stop,))
    assert stopped == full[: full.index(stop) + 1]


@pytest.mark.parametrize("mode", list(MODES))
def test_operation_streams_keep_every_contract(model_dir, mode):
    lag = MODES[mode]
    totals = Totals()
    started = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @seed(SEED + lag)  # fixed streams per mode: reruns are reproducible, modes see different streams
    @given(config=pool_configs, ops=streams)
    def play(config, ops):
        note(f"{mode}: {config}")
        totals.add(Stream(model_dir, lag, config).play(ops))

    play()
    totals.seconds = time.monotonic() - started
    print(f"\n[property {mode}] {totals}")
    # The streams must have exercised what they claim to test.
    assert totals.checkpoint_hits > 0 and totals.restored_reads > 0, totals
    assert totals.requests_with_cached_tokens > 0, totals
    assert totals.evictions > 0, totals
    assert totals.preemptions > 0, totals
    assert totals.aborts > 0 and totals.captures_dropped > 0, totals
    assert totals.resets > 0, totals
    assert totals.stopped_early > 0, totals
    assert totals.prompt_stops > 0 and totals.prompt_captures_in_step > 0, totals  # both capture modes ran
    if TARGET_OPS:
        assert totals.operations >= math.ceil(TARGET_OPS / len(MODES)), totals


@settings(max_examples=BOUNDARY_EXAMPLES, deadline=None, database=None, print_blob=True)
@seed(SEED)
@given(
    length=prompt_lengths,
    max_tokens=max_tokens,
    stop_at=stops,
    extra=st.integers(0, 20),
    salt=st.sampled_from(SALTS),
    lag=st.sampled_from([0, 1]),
    token_seed=seeds,
    prompt_capture=st.sampled_from(["in_step", "stop"]),
)
def test_boundaries_hit_exactly_on_a_roomy_pool(
    model_dir, length, max_tokens, stop_at, extra, salt, lag, token_seed, prompt_capture
):
    """Without pressure nothing is lost: an exact resend restores ``P - 1`` tokens and each next
    turn restores at least the committed length of the turn before (the streams above only bound
    cached tokens from above; this catches captures that silently go missing)."""
    stream = Stream(model_dir, lag, PoolConfig(256, 64, 0.5, reserve_full_prompt=True, prompt_capture=prompt_capture))

    def turn(op, drain: bool = True) -> Tracked:
        """One request at a time, like a client: send it and wait for its last token. With
        ``drain`` also let the engine return the step still in flight (async); without it the
        next request is looked up before that step returned, while the turn's response bundle
        is still pending, and must restore it all the same (scheduler contract 6)."""
        stream.apply(op)
        stream.step_until(stream.tracked[-1].request.is_finished)
        if drain:
            stream.driver.drain()
        return stream.tracked[-1]

    def floor(previous: Tracked, extra: int) -> int:
        """Least a next turn (``extra`` new tokens) of ``previous`` must restore."""
        committed = len(previous.prompt) + len(previous.expected) - 1  # tokens whose state it computed
        # Under async scheduling the response checkpoint may include the last sampled token (its
        # step was in flight), which a next turn without new tokens cannot use: the prompt one remains.
        return committed if extra or not lag else len(previous.prompt) - 1

    first = turn(Fresh(token_seed, length, max_tokens, salt, stop_at))
    resend = turn(Resend(0, max_tokens))  # a branch: it must not drop the first turn's bundles
    next_turn = turn(Continue(0, extra, token_seed + 1, max_tokens, stop_at), drain=False)
    third = turn(Continue(2, extra, token_seed + 2, max_tokens, None))  # arrives before the drain
    cold = turn(Resend(3, max_tokens, other_salt="cold"))  # the same third turn, computed cold
    stream.finish()

    cached = stream.driver.cached_tokens
    assert cached[first.request.request_id] == 0
    assert cached[resend.request.request_id] == length - 1
    assert floor(first, extra) <= cached[next_turn.request.request_id] <= len(next_turn.prompt) - 1
    assert floor(next_turn, extra) <= cached[third.request.request_id] <= len(third.prompt) - 1
    assert cached[cold.request.request_id] == 0
    assert list(third.request.output_token_ids) == list(cold.request.output_token_ids) == third.expected
