"""DFlash speculative decoding with boundary checkpoints: vLLM's real Scheduler, driven step by step.

The scheduler runs with a DFlash speculative config (``method: dflash``, a config-only drafter of
``fixtures/dflash.py``: vLLM's lookahead of ``k + 1`` slots and prefill lookahead 1) over a
hand-built layout (``dflash_shadow.LAYOUT``): the target's attention group (block 16), a full
draft group on 32-token pages, a sliding-window draft group (block 16, window 24) and two
recurrent groups (align mode, ``k`` speculative blocks). ``dflash_shadow.DFlashShadowWorker``
writes, per step, the context rows of the valid rows and query junk past the committed count in
every draft group, checks every draft row a step's drafter reads (window groups: the window only)
and refuses any write into a page a published bundle holds. Drafts are scripted as in
``test_scheduler_spec.py``.

Checked (docs/notes/spec-decode.md §11): exact restores at the prompt and response boundaries in
every group (sync and async, k = 1-3, accepted, rejected and mixed drafts); one resume point and a
private tail in every attention and window group; window bundles holding every page of the window
and nulls below it; a hole keeps no checkpoint; no next-token guard (a next turn with another
token ``N`` restores the whole boundary). Negative controls: a hole let through, a restore without
the draft pages, a restore without copy-on-write, a bundle one token past its state.
"""

from __future__ import annotations

import random

import pytest
from dflash_shadow import BLOCK, LAYOUT, QUERY, WINDOW, dflash_engine, write_drafter_config
from shadow_engine import ShadowMismatch
from shadow_scheduler import make_request, tokens
from spec_expectations import (
    CASES,
    async_path,
    check_next_turn,
    expected_async_boundary,
    expected_response_boundary,
    greedy_next,
    pattern,
    published,
)

from boundary_checkpoints.core import capture as capture_module
from boundary_checkpoints.core import scheduler as scheduler_module
from boundary_checkpoints.core.boundaries import PROMPT, RESPONSE
from boundary_checkpoints.core.group_kinds import GroupKind, first_window_page

WINDOW_GROUP = 2  # index of the sliding-window draft group in LAYOUT
MERGED = (("attention+draft", BLOCK), ("window", BLOCK), ("recurrent", BLOCK), ("recurrent", BLOCK))


@pytest.fixture(scope="module")
def drafter(model_dir, tmp_path_factory):
    return write_drafter_config(tmp_path_factory.mktemp("dflash_drafter"), model_dir)


def engine(model_dir, drafter, k: int, accept: str = "one", **kwargs):
    return dflash_engine(model_dir, drafter, k, pattern(accept, k), **kwargs)


def window_nulls(checkpoint, group: int = WINDOW_GROUP) -> int:
    """Leading null blocks of a bundle's window group; asserts none follows a live block."""
    nulls = [block.is_null for block in checkpoint.group_blocks[group]]
    first_live = nulls.index(False) if False in nulls else len(nulls)
    assert not any(nulls[first_live:]), nulls
    return first_live


def test_layout_has_a_window_group_and_bundles_no_next_token(model_dir, drafter):
    scheduler, worker, driver = engine(model_dir, drafter, 3)
    assert scheduler.boundaries_active and scheduler.num_lookahead_tokens == 4  # bonus + k mask slots
    kinds = [(g.kind, g.block_size, g.window) for g in scheduler._geometries]
    assert kinds == [(GroupKind.ATTENTION, 16, 0), (GroupKind.ATTENTION, 32, 0), (GroupKind.WINDOW, 16, WINDOW),
                     (GroupKind.RECURRENT, 16, 0), (GroupKind.RECURRENT, 16, 0)]  # fmt: skip
    prompt = tokens(random.Random(1), 40)
    driver.run([make_request(prompt, max_tokens=9, salt="s")])
    bundles = scheduler.checkpoint_store.checkpoints()
    assert {c.kind for c in bundles} == {PROMPT, RESPONSE}
    assert all(c.next_token is None for c in bundles)


# Longer prompts than test_scheduler_spec's: the window (24) slides past whole pages.
DFLASH_CASES = [*CASES, (1, "none", 75, 9), (2, "cycle", 64, 12), (3, "one", 100, 14)]


@pytest.mark.parametrize("layout", [LAYOUT, MERGED], ids=["separate", "merged"])
@pytest.mark.parametrize(("k", "accept", "prompt_len", "max_tokens"), DFLASH_CASES)
def test_boundaries_restore_exactly_in_every_draft_group(model_dir, drafter, layout, k, accept, prompt_len,
                                                         max_tokens):  # fmt: skip
    """Prompt (``P - 1``) and response bundles restore exactly: the resend and the next turn read
    every target row, draft context row (window: the window's) and recurrent state a cold run
    computed, and answer as it does; the window group of each bundle holds nulls below the window
    and every page from there on."""
    scheduler, worker, driver = engine(model_dir, drafter, k, accept, layout=layout)
    window_group = [kind for kind, _ in layout].index("window")
    rng = random.Random(prompt_len * 7 + k)
    prompt = tokens(rng, prompt_len)
    producer = make_request(prompt, max_tokens=max_tokens, salt="s")
    [answer] = driver.run([producer])
    boundary = expected_response_boundary(worker.steps[producer.request_id][-1], prompt_len + max_tokens)
    assert [c.num_tokens for c in published(scheduler, RESPONSE)] == ([boundary] if boundary else [])
    for bundle in scheduler.checkpoint_store.checkpoints():
        assert window_nulls(bundle, window_group) == first_window_page(bundle.num_tokens, BLOCK, WINDOW)

    resend = make_request(prompt, max_tokens=max_tokens, salt="s")
    assert driver.run([resend]) == [answer]
    assert driver.cached_tokens[resend.request_id] == prompt_len - 1
    reads = worker.draft_reads
    check_next_turn(driver, prompt + answer + tokens(rng, 5), 4, boundary or prompt_len - 1)
    assert worker.draft_reads > reads
    assert scheduler.boundary_stats()["captures_dropped"] == 0


ASYNC_DFLASH_CASES = [
    (1, "one", 17, 3, "in_flight"),
    (2, "one", 20, 11, "crossing"),
    (2, "all", 17, 13, "overwritten"),
    (2, "all", 17, 3, "trimmed"),
    (3, "all", 40, 17, "in_flight"),
    (3, "cycle", 17, 7, "finish"),
    (3, "one", 70, 9, "crossing"),
    (2, "all", 70, 12, "trimmed"),
]


@pytest.mark.parametrize(("k", "accept", "prompt_len", "max_tokens", "path"), ASYNC_DFLASH_CASES)
def test_async_response_bundle_serves_any_next_token(model_dir, drafter, k, accept, prompt_len, max_tokens, path):
    """Async scheduling: a response finished with a verify step in flight keeps the state that step
    leaves after every token, as under MTP, but without the next-token guard: DFlash's row ``N - 1``
    (the in-flight step's input, written by that step's drafter) depends on the prefix only, so a
    next turn whose token ``N`` differs from the one the model sampled restores the whole boundary."""
    scheduler, worker, driver = engine(model_dir, drafter, k, accept, async_scheduling=True)
    rng = random.Random(prompt_len * 7 + k)
    prompt = tokens(rng, prompt_len)
    producer = make_request(prompt, max_tokens=max_tokens, salt="s")
    [answer] = driver.run([producer])
    num_tokens = prompt_len + len(answer)
    steps = worker.steps[producer.request_id]
    assert async_path(steps, num_tokens) == path
    boundary = expected_async_boundary(steps, num_tokens)
    assert [c.num_tokens for c in published(scheduler, RESPONSE)] == ([boundary] if boundary else [])
    other = [4 + (greedy_next(prompt + answer) - 3) % 1000]
    check_next_turn(driver, prompt + answer + other + tokens(rng, 5), 4, boundary or prompt_len - 1)
    assert scheduler.boundary_stats().get("miss_draft_next_token", 0) == 0


def test_every_group_resumes_at_the_same_token_with_private_tails(model_dir, drafter, monkeypatch):
    """The restore of a next turn hands every group the same ``N``: ``ceil(N / B)`` pages in each
    attention and window group (nulls below the window), the recurrent state at ``(N - 1) // B``;
    after admission every tail page is a private copy (vLLM's copy-on-write), the window's leading
    nulls are the ones vLLM itself gives a hit of ``N``."""
    scheduler, worker, driver = engine(model_dir, drafter, 2, "one")
    hits = []
    lookup = scheduler._get_local_prefix_cache_hit

    def recording_lookup(request):
        blocks, num_hit, *rest = lookup(request)
        hits.append((request.request_id, num_hit, [list(group) for group in blocks.blocks]))
        return (blocks, num_hit, *rest)

    monkeypatch.setattr(scheduler, "_get_local_prefix_cache_hit", recording_lookup)
    rng = random.Random(8)
    prompt = tokens(rng, 61)
    [answer] = driver.run([make_request(prompt, max_tokens=10, salt="s")])
    [response] = published(scheduler, RESPONSE)
    n = response.num_tokens
    assert n > WINDOW + 2 * BLOCK and any(n % size for _, size in LAYOUT)
    consumer = make_request(prompt + answer + tokens(rng, 6), max_tokens=3, salt="s")
    scheduler.add_request(consumer)
    driver.step()
    [(_, num_hit, groups)] = [h for h in hits if h[0] == consumer.request_id]
    assert num_hit == n
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    for g, ((kind, size), blocks) in enumerate(zip(LAYOUT, groups, strict=True)):
        table = managers[g].req_to_blocks[consumer.request_id]
        if kind == "recurrent":
            assert len(blocks) == (n - 1) // size + 1 and not blocks[-1].is_null
            continue
        assert len(blocks) == -(-n // size), (g, len(blocks))
        first = first_window_page(n, size, WINDOW) if kind == "window" else 0
        assert [b.is_null for b in blocks] == [True] * first + [False] * (len(blocks) - first)
        assert [b.is_null for b in table[:first]] == [True] * first
        assert table[first : n // size] == blocks[first : n // size]  # full pages shared by reference
        if n % size:
            assert table[n // size] is not blocks[n // size]  # the tail: a private copy-on-write page
    driver.finish([consumer])


def test_rejected_drafts_at_the_boundary_leave_junk_only_past_it(model_dir, drafter):
    """The producer's last step rejects every draft: its draft pages hold query junk right at and
    past the response boundary ``N`` (the drafter's bonus and mask rows), none below it, and the next
    turn restored at ``N`` reads clean rows only."""
    k = 3
    scheduler, worker, driver = engine(model_dir, drafter, k, "none")
    rng = random.Random(21)
    prompt = tokens(rng, 30)
    producer = make_request(prompt, max_tokens=9, salt="s")
    [answer] = driver.run([producer])
    last = worker.steps[producer.request_id][-1]
    assert last.num_drafts == k and last.num_accepted == 1
    [response] = published(scheduler, RESPONSE)
    n = response.num_tokens
    for g in (1, WINDOW_GROUP):  # the draft groups: adopted pages, read straight from the shadow
        size = LAYOUT[g][1]
        page = worker.context[response.group_blocks[g][n // size].block_id]
        assert QUERY not in page[: n % size] and page[n % size] == QUERY
    check_next_turn(driver, prompt + answer + tokens(rng, 5), 4, n)


class BundleOnePastScheduler(scheduler_module.BoundaryScheduler):
    """Negative control: every bundle is keyed one token later than the state and pages it holds."""

    def _key(self, request, num_tokens):
        return super()._key(request, num_tokens + 1) if num_tokens < request.num_tokens else None


def test_a_bundle_one_token_past_its_pages_reads_the_junk(model_dir, drafter):
    """The same producer as above, its bundles keyed one token past their content: the next turn
    resumes at ``N + 1`` and reads row ``N``, left by a rejected draft (target) and a query row
    (drafter)."""
    scheduler, worker, driver = engine(model_dir, drafter, 3, "none")
    scheduler.__class__ = BundleOnePastScheduler
    rng = random.Random(21)
    prompt = tokens(rng, 30)
    [answer] = driver.run([make_request(prompt, max_tokens=9, salt="s")])
    [response] = published(scheduler, RESPONSE)
    with pytest.raises(ShadowMismatch, match=f"row {response.num_tokens - 1} is wrong"):
        driver.run([make_request(prompt + answer + tokens(rng, 5), max_tokens=4, salt="s")])


def hole_at_window_start(scheduler, monkeypatch):
    """Make the producer's table show a hole: its first window page freed when the prompt capture
    is planned (what an eviction or a later vLLM's eager free would leave). Returns the calls."""
    calls = []
    request_blocks = scheduler._request_blocks

    def holed(request_id):
        groups = [list(blocks) for blocks in request_blocks(request_id)]
        request = scheduler.requests[request_id]
        first = first_window_page(request.num_prompt_tokens - 1, BLOCK, WINDOW)
        if len(groups[WINDOW_GROUP]) > first:
            groups[WINDOW_GROUP][first] = scheduler._block_pool.null_block
            calls.append(first)
        return groups

    monkeypatch.setattr(scheduler, "_request_blocks", holed)
    return calls


def test_a_hole_in_the_window_keeps_no_checkpoint(model_dir, drafter, monkeypatch):
    """A window page missing where the next token reads: no bundle is planned (counted); the
    resend computes from scratch (or a stock block-grid hit) and answers as the producer."""
    scheduler, worker, driver = engine(model_dir, drafter, 2, "one")
    calls = hole_at_window_start(scheduler, monkeypatch)
    prompt = tokens(random.Random(4), 70)
    producer = make_request(prompt, max_tokens=1, salt="s")  # no response bundle: only the prompt's
    [answer] = driver.run([producer])
    assert calls and scheduler.boundary_stats()["captures_dropped"] == len(calls)
    assert not published(scheduler, PROMPT)
    resend = make_request(prompt, max_tokens=1, salt="s")
    assert driver.run([resend]) == [answer]
    assert driver.cached_tokens[resend.request_id] < len(prompt) - 1
    assert scheduler.boundary_stats()["hits"] == 0


def test_a_hole_let_through_is_a_wrong_draft(model_dir, drafter, monkeypatch):
    """Negative control: the same hole, with a plan that lets it into the bundle (the window page
    listed as a null block): the resend's drafter finds that page empty."""
    scheduler, worker, driver = engine(model_dir, drafter, 2, "one")
    plan_bundle = capture_module.plan_bundle

    def leaky_plan(geometries, request_blocks, num_tokens, null_block, state_end=None):
        plan = plan_bundle(geometries, request_blocks, num_tokens, null_block, state_end)
        shared = list(plan.shared)
        first = first_window_page(num_tokens, BLOCK, WINDOW)
        shared[WINDOW_GROUP] = (*shared[WINDOW_GROUP][:first], null_block, *shared[WINDOW_GROUP][first + 1 :])
        return type(plan)(plan.num_tokens, tuple(shared), plan.sources)

    monkeypatch.setattr(capture_module, "plan_bundle", leaky_plan)
    prompt = tokens(random.Random(4), 70)
    driver.run([make_request(prompt, max_tokens=1, salt="s")])
    with pytest.raises(ShadowMismatch, match=f"draft context row {69 - WINDOW + 1} of group {WINDOW_GROUP} is wrong"):
        driver.run([make_request(prompt, max_tokens=1, salt="s")])


class WithoutDraftPagesScheduler(scheduler_module.BoundaryScheduler):
    """Negative control: a restore whose draft groups get null pages in place of the bundle's full
    pages (their tails, which vLLM's copy-on-write needs, stay): the drafter's context K/V below
    the tail is not restored, stock DFlash's prefix-cache failure."""

    def _get_local_prefix_cache_hit(self, request):
        blocks, num_hit, *rest = super()._get_local_prefix_cache_hit(request)
        if self._ledgers[request.request_id].restored_from is not None:
            groups = [list(group) for group in blocks.blocks]
            for g in (1, WINDOW_GROUP):
                groups[g][:-1] = [self._block_pool.null_block] * (len(groups[g]) - 1)
            blocks = type(blocks)(tuple(groups))
        return (blocks, num_hit, *rest)


def test_a_restore_without_the_draft_pages_is_caught(model_dir, drafter):
    scheduler, worker, driver = engine(model_dir, drafter, 2, "one")
    scheduler.__class__ = WithoutDraftPagesScheduler
    prompt = tokens(random.Random(6), 40)
    driver.run([make_request(prompt, max_tokens=4, salt="s")])
    with pytest.raises(ShadowMismatch, match="draft context row 0 of group 1 is wrong"):
        driver.run([make_request(prompt, max_tokens=4, salt="s")])


def test_without_copy_on_write_a_restore_writes_into_a_published_page(model_dir, drafter, monkeypatch):
    """Negative control for "shared pages are never rewritten": with vLLM's partial-hit
    copy-on-write turned off in the draft groups, the resend writes its rows into the bundle's tail
    page itself, which the shadow refuses."""
    scheduler, worker, driver = engine(model_dir, drafter, 2, "one")
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    for g in (1, WINDOW_GROUP):
        monkeypatch.setattr(managers[g], "_has_partial_local_hit", lambda *args: False)
    prompt = tokens(random.Random(6), 40)  # P - 1 = 39: inside a page of every draft group
    driver.run([make_request(prompt, max_tokens=4, salt="s")])
    with pytest.raises(ShadowMismatch, match="row 39 of group 1 is written into a published bundle's page"):
        driver.run([make_request(prompt, max_tokens=4, salt="s")])


def test_the_window_slides_on_the_producer_and_the_bundle_keeps_its_pages(model_dir, drafter):
    """A long prompt and answer: vLLM frees the producer's pages below its window as it decodes;
    each bundle keeps exactly the pages its own window needs (nulls below). The prompt bundle's
    window lies below the response's, so once the producer has moved on the bundle is the only
    holder of those pages, and a resend still restores from them."""
    scheduler, worker, driver = engine(model_dir, drafter, 1, "one")
    rng = random.Random(9)
    prompt = tokens(rng, 150)
    [answer] = driver.run([make_request(prompt, max_tokens=40, salt="s")])
    [prompt_bundle] = published(scheduler, PROMPT)
    [response] = published(scheduler, RESPONSE)
    windows = {}
    for bundle in (prompt_bundle, response):
        first = window_nulls(bundle)
        assert first == first_window_page(bundle.num_tokens, BLOCK, WINDOW) > 0
        windows[bundle.kind] = bundle.group_blocks[WINDOW_GROUP][first:]
    assert not {b.block_id for b in windows[PROMPT]} & {b.block_id for b in windows[RESPONSE]}
    assert all(b.ref_cnt == 1 for b in windows[PROMPT])  # the bundle's own reference only
    resend = make_request(prompt, max_tokens=3, salt="s")
    assert driver.run([resend]) == [answer[:3]]
    assert driver.cached_tokens[resend.request_id] == len(prompt) - 1
    check_next_turn(driver, prompt + answer + tokens(rng, 30), 5, response.num_tokens)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_batched_conversations_restore_exactly(model_dir, drafter, async_scheduling):
    """Three conversations in one batch, each turn sent while the others decode: resends (whose
    one remaining prompt token vLLM pads to a ``1 + k`` row next to decodes) and next turns restore
    exactly in every group and answer as their cold controls."""
    scheduler, worker, driver = engine(model_dir, drafter, 3, "cycle", async_scheduling=async_scheduling)
    rng = random.Random(31 + async_scheduling)
    prompts = [tokens(rng, n) for n in (23, 58, 91)]
    answers = driver.run([make_request(p, max_tokens=12, salt="s") for p in prompts])
    resends = [make_request(p, max_tokens=12, salt="s") for p in prompts]
    assert driver.run(resends) == answers
    assert [driver.cached_tokens[r.request_id] for r in resends] == [len(p) - 1 for p in prompts]
    follow_ups = [p + a + tokens(rng, 9) for p, a in zip(prompts, answers)]
    restored = [make_request(f, max_tokens=6, salt="s") for f in follow_ups]
    cold = [make_request(f, max_tokens=6, salt="cold") for f in follow_ups]
    assert driver.run(restored) == driver.run(cold)
    for request, prompt in zip(restored, prompts):
        assert driver.cached_tokens[request.request_id] >= len(prompt) + 12 - 1 - 3  # the response bundle
    assert scheduler.boundary_stats()["captures_dropped"] == 0
