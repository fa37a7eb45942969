"""GLM-5.3-Flash under MTP with ``--prefix-match-unit`` on the indexer's pool grid (CPU, shadow
runner; ``docs/design.md`` contract 13): vLLM's own cache then keeps each prompt's recurrent state
at its last hash-block boundary below the end, inside the prompt's last chunk where the kernels
save a state there (KDA on FlashKDA: ``num_prefill_checkpoint_blocks``), so the plugin takes no
prompt checkpoint and runs no pool-grid stop: a fresh prompt longer than a block prefills in one
step, one within a block in vLLM's own two (as many as with the plugin's stop).

The layout is ``ring_engine.py``'s under MTP (attention, two recurrent groups, the
lookahead ring; 16-token blocks, a pool of 4 tokens), with kernels that save an in-chunk state at
the pool's alignment and a prefix match unit of one pool. The shadow worker writes that state
where vLLM's rule puts it and checks every state, attention row, MTP draft row and ring a step
reads against a cold run, so a next turn that resumes from a wrong state raises.
"""

from __future__ import annotations

import random

import pytest
from ring_engine import ACCEPT, KPOOL, spec_ring_engine
from shadow_engine import ShadowMismatch
from shadow_scheduler import make_request, tokens

from boundary_checkpoints import support
from boundary_checkpoints.prompt_capture import OFF, STOP
from boundary_checkpoints.settings import BoundaryConfigError

K = 3
BLOCK = 16
UNIT = 2 * KPOOL  # a unit longer than a verify row (1 + k), as FlashKDA's 16 is at GLM's k <= 3


def grid_engine(model_dir, unit: int | None = KPOOL, policy: str = "request_boundaries", accept: str = "cycle"):
    """The ring layout under MTP k = 3 on the shadow of a Hopper indexer, its recurrent kernels
    saving a state inside a prefill chunk at the pool's alignment, at prefix match unit ``unit``.
    The shadow's check that no prefill row is as short as a verify row is off: at a finer unit
    vLLM runs such rows itself (a hit inside a block runs to the block's end first), and
    :func:`short_prefill_rows` compares the plugin's with stock's instead."""
    scheduler, worker, driver = spec_ring_engine(
        model_dir, K, ACCEPT[accept](K), policy=policy, prefill_checkpoint_alignment=KPOOL, prefix_match_unit=unit
    )
    worker.no_short_prefill_rows = False
    return scheduler, worker, driver


def short_prefill_rows(worker) -> set[tuple[int, int, int]]:
    """``(request number, start, tokens)`` of every prefill row that starts inside a block and is no
    longer than a verify row (``1 + k`` tokens), requests numbered in the order they ran. (A row
    from a block boundary is one stock runs after any block-grid hit.)"""
    return {
        (number, step.start, step.num_scheduled)
        for number, steps in enumerate(worker.steps.values())
        for step in steps
        if step.start % BLOCK and not step.num_drafts and step.num_scheduled <= 1 + K
    }


def vllm_checkpoint(length: int, unit: int = KPOOL) -> int:
    """Where vLLM keeps a prompt's state at prefix match unit ``unit`` under MTP, whose EAGLE-style
    lookups drop the hit's last unit (``get_mamba_prefill_checkpoint_position``)."""
    return length // unit * unit - unit


def first_step_tokens(worker, request) -> int:
    return worker.steps[request.request_id][0].num_scheduled


def test_the_plugin_leaves_prompt_checkpoints_to_vllm_and_says_so(model_dir):
    scheduler, _, _ = grid_engine(model_dir)
    assert scheduler.boundaries_active and scheduler._grid_only
    assert scheduler.hash_block_size == KPOOL
    assert scheduler._prompt_capture.mode == OFF and not scheduler._prompt_captures_on
    described = scheduler._prompt_capture.describe()
    assert described.startswith("off (vLLM's own cache keeps each prompt's state on the indexer's pool grid")
    assert "(prompt vLLM's own, responses only where they end on it)" in scheduler._pool_grid_line()


@pytest.fixture
def k_validated_only_at_the_unit(monkeypatch):
    """The shadow's architecture validated under MTP at k = 1 everywhere and at this file's k only
    with the pool as vLLM's unit, as GLM-5.3-Flash is at k = 3 (``support.MATCH_UNIT_ONLY_K``)."""
    architecture = "Qwen3NextForCausalLM"
    monkeypatch.setitem(support.VALIDATED_SPECULATIVE_ARCHITECTURES, architecture, {"mtp": 1})
    monkeypatch.setitem(support.MATCH_UNIT_ONLY_K, (architecture, "mtp"), K)


def test_a_k_validated_only_at_the_unit_runs_under_auto_at_the_unit(model_dir, k_validated_only_at_the_unit):
    scheduler, _, _ = grid_engine(model_dir, policy="auto")
    assert scheduler.boundaries_active and scheduler._prompt_capture.mode == OFF


def test_a_k_validated_only_at_the_unit_falls_back_without_it(model_dir, k_validated_only_at_the_unit):
    """Negative control of the test above: at vLLM's block unit the same engine under ``auto``
    runs stock's retention, and an explicit ``request_boundaries`` is refused, naming the unit."""
    scheduler, _, _ = grid_engine(model_dir, unit=None, policy="auto")
    assert not scheduler.boundaries_active
    with pytest.raises(BoundaryConfigError, match="validated only with the indexer's pool as vLLM's prefix match unit"):
        grid_engine(model_dir, unit=None)


def test_without_a_finer_unit_the_pool_grid_stop_stays(model_dir):
    """The same kernels at vLLM's default unit (the block) keep no state on the pool grid below
    P: the plugin's stop stays, and a fresh prompt runs in two steps."""
    scheduler, worker, driver = grid_engine(model_dir, unit=None)
    assert scheduler.hash_block_size == BLOCK
    assert scheduler._prompt_capture.mode == STOP and scheduler._prompt_captures_on
    prompt = tokens(random.Random(1), 42)
    request = make_request(prompt, salt="s")
    driver.run([request])
    assert first_step_tokens(worker, request) < len(prompt)


@pytest.mark.parametrize("accept", ["none", "cycle", "all"])
def test_fresh_prompts_prefill_in_one_step_and_next_turns_resume_from_vllms_state(model_dir, accept):
    """Prompts longer than a block (vLLM's in-chunk state needs a column below the last) prefill in
    one step, beside a request that decodes with drafts. Their resends and next turns resume
    exactly where stock with the same unit does, at vLLM's state; answers equal cold runs'. (A
    unit of two pools, longer than a verify row; the lengths keep vLLM's rows from the resends'
    hits longer than one, which the next test's do not.)"""
    runs = {}
    lengths = (23, 29, 39, 47, 55)
    for policy in ("aligned", "request_boundaries"):
        scheduler, worker, driver = grid_engine(model_dir, unit=UNIT, policy=policy, accept=accept)
        rng = random.Random(7)
        scheduler.add_request(make_request(tokens(rng, 21), max_tokens=600, salt="neighbour", hash_block_size=UNIT))
        cached, steps = [], []
        for length in lengths:
            prompt = tokens(rng, length)
            first = make_request(prompt, salt="s", hash_block_size=UNIT)
            [answer] = driver.run([first])
            steps.append(first_step_tokens(worker, first) == length)
            resend = make_request(prompt, salt="s", hash_block_size=UNIT)
            assert driver.run([resend]) == [answer]
            follow_up = prompt + answer + tokens(rng, 13)
            nxt = make_request(follow_up, salt="s", hash_block_size=UNIT)
            cold = make_request(follow_up, salt=f"cold-{length}", hash_block_size=UNIT)
            assert driver.run([nxt]) == driver.run([cold])
            assert driver.cached_tokens[cold.request_id] == 0
            cached.append((driver.cached_tokens[resend.request_id], driver.cached_tokens[nxt.request_id]))
        assert worker.internal_checkpoints > 0
        runs[policy] = cached, steps, short_prefill_rows(worker)
    (stock_cached, stock_steps, stock_short), (plugin_cached, plugin_steps, plugin_short) = runs.values()
    assert plugin_steps == stock_steps == [True] * 5
    assert plugin_short <= stock_short  # the plugin runs no short prefill row stock does not
    assert [resend for resend, _ in plugin_cached] == [vllm_checkpoint(n, UNIT) for n in lengths]
    for (stock_resend, stock_next), (resend, nxt) in zip(stock_cached, plugin_cached, strict=True):
        assert resend == stock_resend and nxt >= stock_next


def test_with_the_plugins_stop_a_fresh_prompt_takes_a_second_step(model_dir, monkeypatch):
    """Negative control: where the plugin did not leave the prompt to vLLM it would stop on the
    pool grid, and the test above would see a two-step prefill."""
    from boundary_checkpoints.core.pool_snapshots import PoolGridMixin

    monkeypatch.setattr(PoolGridMixin, "_vllm_keeps_prompts_on_grid", lambda self: False)
    scheduler, worker, driver = grid_engine(model_dir)
    assert scheduler._prompt_capture.mode == STOP
    prompt = tokens(random.Random(3), 42)
    request = make_request(prompt, salt="s", hash_block_size=KPOOL)
    driver.run([request])
    assert first_step_tokens(worker, request) < len(prompt)


def test_negative_control_a_state_written_one_token_late_is_caught(model_dir, monkeypatch):
    """The shadow's own control for this path: where the kernels' in-chunk state is written one
    token late, the resend that resumes from it raises instead of answering."""
    from spec_shadow import SpecShadowWorker

    write = SpecShadowWorker._internal_checkpoint

    def one_token_late(self, start, end, blocks):
        internal = write(self, start, end, blocks)
        return None if internal is None else (internal[0] + 1, internal[1])

    monkeypatch.setattr(SpecShadowWorker, "_internal_checkpoint", one_token_late)
    _, _, driver = grid_engine(model_dir)
    prompt = tokens(random.Random(5), 42)
    driver.run([make_request(prompt, salt="s", hash_block_size=KPOOL)])
    with pytest.raises(ShadowMismatch, match="recurrent state"):
        driver.run([make_request(prompt, salt="s", hash_block_size=KPOOL)])


def prefill_steps(worker, request, length: int) -> int:
    return sum(step.start < length for step in worker.steps[request.request_id])


def test_a_prompt_within_one_block_runs_vllms_split_as_many_steps_as_the_stop(model_dir):
    """vLLM saves the in-chunk state only where the prompt's last step crosses a block boundary
    (``is_mamba_prefill_checkpoint_valid``): a prompt within one block gets vLLM's own split at its
    last unit boundary, stock with the unit too, as many steps as the plugin's pool-grid stop at
    vLLM's default unit; its resend resumes at vLLM's state."""
    steps = {}
    for name, policy, unit in (("stock", "aligned", KPOOL), ("plugin", "request_boundaries", KPOOL),
                               ("stop", "request_boundaries", None)):  # fmt: skip
        _, worker, driver = grid_engine(model_dir, policy=policy, unit=unit)
        prompt = tokens(random.Random(9), 14)
        first = make_request(prompt, salt="s", hash_block_size=unit or BLOCK)
        [answer] = driver.run([first])
        steps[name] = prefill_steps(worker, first, len(prompt))
        resend = make_request(prompt, salt="s", hash_block_size=unit or BLOCK)
        assert driver.run([resend]) == [answer]
        if unit:
            assert driver.cached_tokens[resend.request_id] == vllm_checkpoint(len(prompt))
    assert steps == {"stock": 2, "plugin": 2, "stop": 2}


# Past a block: the resend hits one pool below its end. The last three exceed the step's token
# budget (64), so their first send's first chunk ends on the block grid, at 64.
AT_A_BLOCKS_END = (17, 18, 19, 33, 34, 35, 81, 82, 83)


def resend_rows(model_dir, policy: str, unit: int | None, strict_rows: bool):
    """Prompts whose resend vLLM hits one pool below a block boundary at a prefix match unit of
    one pool (``KPOOL``, no longer than a verify row: a unit a user may give), each sent twice.
    Returns the resends' cached tokens, the short rows run, and the scheduler."""
    scheduler, worker, driver = grid_engine(model_dir, unit=unit, policy=policy)
    worker.no_short_prefill_rows = strict_rows
    rng, cached = random.Random(11), []
    for length in AT_A_BLOCKS_END:
        prompt = tokens(rng, length)
        [answer] = driver.run([make_request(prompt, salt="s", hash_block_size=unit or BLOCK)])
        resend = make_request(prompt, salt="s", hash_block_size=unit or BLOCK)
        assert driver.run([resend]) == [answer]
        cached.append(driver.cached_tokens[resend.request_id])
    return cached, short_prefill_rows(worker), scheduler


def test_vllms_own_hit_that_would_run_a_short_row_is_lowered(model_dir):
    """Stock at that unit resumes one pool below the block's end and runs that pool as a prefill
    row as short as a verify row (on Hopper the indexer's index assert). The plugin lowers such a
    hit of vLLM's to a state vLLM keeps at a block boundary below, else to none: no short row,
    each resend exact. At this unit vLLM keeps one state per prompt, the one inside its last chunk
    (none at 64, where the first chunk ended), so here every such resend computes its prompt
    again: below stock at vLLM's default unit, which splits a prompt of two blocks or more at the
    last block boundary to keep a state there. The price of a unit no longer than a verify row;
    the unit the plugin chooses (``match_unit.py``: 16 at GLM's k <= 3) never meets it."""
    stock_cached, stock_short, _ = resend_rows(model_dir, "aligned", KPOOL, strict_rows=False)
    assert {(start, tokens) for _, start, tokens in stock_short} == {(12, 4), (28, 4), (76, 4)}  # the risk
    assert stock_cached == [vllm_checkpoint(n) for n in AT_A_BLOCKS_END]
    default_cached, _, _ = resend_rows(model_dir, "aligned", None, strict_rows=False)
    assert default_cached == [0, 0, 0, 16, 16, 16, 64, 64, 64]
    cached, short, scheduler = resend_rows(model_dir, "request_boundaries", KPOOL, strict_rows=True)
    assert not short
    assert cached == [0] * len(AT_A_BLOCKS_END)
    assert scheduler.boundary_stats()["vllm_hits_lowered"] == len(AT_A_BLOCKS_END)


def test_negative_control_without_lowering_the_plugin_runs_short_rows(model_dir, monkeypatch):
    from boundary_checkpoints.core.chunk_stops import ChunkStopMixin

    monkeypatch.setattr(ChunkStopMixin, "_runs_short_rows_from", lambda self, request, start: False)
    with pytest.raises(ShadowMismatch, match="no longer than a verify row"):
        resend_rows(model_dir, "request_boundaries", KPOOL, strict_rows=True)
