"""A new prompt waits one step for a shared prefix another request computes in it
(``core/prefix_in_flight.py``).

Unit: the chained-hash comparison, when a prompt waits and that it waits at most once. Scheduler:
vLLM's real scheduler under MTP with the shadow runner (which raises on any state read that differs
from a cold run), prompts that share a prefix arriving two in the first step and six in the next:
stock runs the second cold; the plugin lets it wait and it gets the hit stock gives the others.
"""

from __future__ import annotations

import random

import pytest
from shadow_scheduler import make_request, tokens
from spec_expectations import pattern
from spec_shadow import SpecDriver, SpecShadowWorker

from boundary_checkpoints.core.prefix_in_flight import MAX_MISSED, MIN_EVIDENCE, PrefixInFlight, shared_blocks


class FakeRequest:
    """What the rule reads of a vLLM request (which, like this, can be weakly referenced)."""

    def __init__(self, hashes, prompt_tokens: int) -> None:
        self.block_hashes, self.num_prompt_tokens = list(hashes), prompt_tokens


def request(hashes, prompt_tokens=1000) -> FakeRequest:
    return FakeRequest(hashes, prompt_tokens)


def in_flight(waits: list | None = None, drops_block: bool = False) -> PrefixInFlight:
    """16-token hash blocks, 64-token state blocks."""
    counted = [] if waits is None else waits
    return PrefixInFlight(16, 64, drops_block, lambda prompt: prompt // 64 * 64 - 64, on_wait=lambda: counted.append(1))


@pytest.mark.parametrize(("ours", "theirs", "shared"), [
    ("abcdef", "abcdef", 6), ("abcdef", "abcxyz", 3), ("abc", "abcdef", 3), ("xyz", "abc", 0), ("", "abc", 0),
])  # fmt: skip
def test_shared_blocks_counts_equal_leading_hashes(ours, theirs, shared):
    """Hashes chain: two requests that differ at a block differ at every block after it."""
    assert shared_blocks(list(ours), list(theirs)) == shared


def test_a_prompt_waits_for_the_state_its_lookup_reads_at_most_twice():
    waits: list = []
    prefix = in_flight(waits)
    producer, sibling = request("abcdefghij"), request("abcdefgxyz")  # 7 shared blocks: 112 tokens
    prefix.computed(producer, 0, 64)  # a chunk that ends on the state grid, inside the shared prefix
    assert [prefix.waits(sibling, hit=0) for _ in range(3)] == [True, True, False]
    assert len(waits) == 1, "counted once per request"


@pytest.mark.parametrize(("end", "hit", "sibling_hashes", "why"), [
    (128, 0, "abcdefgxyz", "the state is past the 112 shared tokens: the lookup reads 64"),
    (48, 0, "abcdefgxyz", "the chunk does not end on the 64-token state grid"),
    (64, 16, "abcdefgxyz", "less than a state block beyond the hit"),
    (64, 0, "zyxwvutsrq", "nothing shared"),
])  # fmt: skip
def test_a_prompt_does_not_wait_when_the_wait_cannot_pay(end, hit, sibling_hashes, why):
    prefix = in_flight()
    prefix.computed(request("abcdefghij"), 0, end)
    assert not prefix.waits(request(sibling_hashes), hit=hit), why


def test_the_state_inside_a_last_chunk_is_waited_for_where_the_lookup_drops_a_block():
    """A prompt of 150 tokens in one chunk keeps its state at 64 (128 less the dropped block); a
    sibling sharing 8 blocks (128 tokens) reads 64 there, one sharing 7 blocks reads 0."""
    prefix = in_flight(drops_block=True)
    prefix.computed(request("abcdefghij", prompt_tokens=150), 0, 150)
    assert prefix.waits(request("abcdefghxy"), hit=0)
    assert not prefix.waits(request("abcdefgxyz"), hit=0)


def test_states_leave_the_window_after_two_steps_and_decode_rows_leave_none():
    prefix = in_flight()
    prefix.computed(request("abcdefghij", prompt_tokens=160), 160, 192)  # past the prompt: a decode row
    assert not prefix.waits(request("abcdefghij"), hit=0)
    prefix.computed(request("abcdefghij"), 0, 64)
    prefix.step_starts()
    assert prefix.waits(request("abcdefgxyz"), hit=0)
    prefix.step_starts()
    assert not prefix.waits(request("abcdefgxyz"), hit=0)


def waits_that_got(prefix: PrefixInFlight, hits: list[int]) -> list[bool]:
    """One sibling per hit: it waits for the producer's state at 64, then is admitted with that hit;
    whether each waited."""
    prefix.computed(request("abcdefghij"), 0, 64)
    waited = []
    for n, hit in enumerate(hits):
        sibling = request(f"abcdefg{n:03d}")  # 7 shared blocks, then its own
        waited.append(prefix.waits(sibling, hit=0))
        prefix.admitted(sibling, hit)
    return waited


def test_the_rule_stops_when_waits_do_not_pay():
    prefix = in_flight()
    short = int(MAX_MISSED * MIN_EVIDENCE) + 1  # more than MAX_MISSED of the first MIN_EVIDENCE
    waited = waits_that_got(prefix, [0] * short + [64] * (MIN_EVIDENCE - short) + [64, 64])
    assert waited == [True] * MIN_EVIDENCE + [False, False]
    assert prefix.stopped and (prefix.missed, prefix.waited) == (short, MIN_EVIDENCE)


def test_the_rule_goes_on_while_waits_pay():
    prefix = in_flight()
    waited = waits_that_got(prefix, [0] * int(MAX_MISSED * MIN_EVIDENCE) + [64] * (2 * MIN_EVIDENCE))
    assert all(waited) and not prefix.stopped


def cached_tokens(model_dir, policy: str, async_scheduling: bool):
    """Under MTP k = 2: eight prompts of a 150-token shared prefix and 5 tokens of their own (so the
    first prompt's state, 128 tokens, is where the others' lookups read), two added before the
    first step and six before the second: each request's cached tokens (as vLLM reports them), and the scheduler."""
    from shadow_scheduler import build_scheduler

    scheduler, worker = build_scheduler(
        model_dir,
        policy=policy,
        num_speculative_tokens=2,
        worker_cls=SpecShadowWorker,
        prompt_capture="auto",
        max_num_batched_tokens=512,
    )
    worker.num_spec, worker.accept, worker.async_scheduling = 2, pattern("all", 2), async_scheduling
    driver = SpecDriver(scheduler, worker, lag=1 if async_scheduling else 0)
    rng = random.Random(3)
    prefix = tokens(rng, 150)
    requests = [make_request(prefix + tokens(rng, 5), max_tokens=3) for _ in range(8)]
    for group in (requests[:2], requests[2:]):
        for r in group:
            scheduler.add_request(r)
        driver.step()
    driver.finish(requests)
    return [driver.cached_tokens[r.request_id] for r in requests], scheduler


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_arriving_beside_its_prefix_waits_for_it_under_mtp(model_dir, async_scheduling):
    stock, _ = cached_tokens(model_dir, "aligned", async_scheduling)
    plugin, scheduler = cached_tokens(model_dir, "request_boundaries", async_scheduling)
    print("stock", stock, "plugin", plugin)
    assert stock[1] == 0 < stock[2], "stock runs the second prompt of the first step cold (the case guarded)"
    assert all(p >= s for p, s in zip(plugin, stock, strict=True)), (plugin, stock)
    assert plugin[1] == stock[2], "the prompt that waited gets the hit stock gives the later ones"
    assert scheduler.checkpoint_store.counters.prompts_waited == 1
