"""The GLM indexer tail ring under speculative decoding on vLLM's real scheduler (CPU, spec shadow
runner; ``docs/design.md`` contract 13, ``docs/notes/model-families.md`` §10): under MTP the ring
group has vLLM's lookahead slots (``SLOTS``) over the model's pool of ``KPOOL`` tokens, prompt and
response bundles restore both rings exactly, and every checkpoint sits on the pool grid so that no
restore needs a one-token step that completes a pool beside verify rows, nor leaves a prefill row
as short as a verify row; under DFlash the pooled indexer gets the same grid rule. The negative
controls take the grid rule, the row rule, the ring copy or the span rule away and see the shadow
worker object, and the plugin refuses rings that cannot hold the pool and the drafts.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from dflash_shadow import write_drafter_config
from ring_engine import ACCEPT, KPOOL, RING, SLOTS, recorded_steps, restore_rounds, ring_scheduler, spec_ring_engine
from shadow_engine import ShadowMismatch
from shadow_scheduler import build_scheduler, make_request, tokens

from boundary_checkpoints.core import layout
from boundary_checkpoints.core.boundaries import restore_tail
from boundary_checkpoints.core.group_kinds import GroupKind
from boundary_checkpoints.core.kinds import MissReason
from boundary_checkpoints.settings import BoundaryConfigError

# A fresh prompt's checkpoint under contract 13, by k, worked out by hand. vLLM (block 16, MTP's block
# drop) prefills a prompt of up to 31 tokens in one chunk, and a chunk that starts inside a block it
# ends at the next boundary. So a stop at g leaves the rows [0, g) and [g, min(16 * ceil(g / 16), P))
# and, where that ends below P, [16, P): each must be longer than a verify row (k + 2 tokens or more)
# or one vLLM runs anyway. E.g. k = 3, P = 20: a stop at 16 leaves 4 tokens, one at 8 or 12 adds the
# row [16, 20), which vLLM would not run: no checkpoint.
GRID_RESENDS = {
    1: {5: 0, 8: 4, 13: 8, 15: 12, 16: 12, 17: 0, 20: 16, 22: 16, 24: 20, 30: 24},
    2: {5: 0, 8: 4, 13: 8, 15: 8, 16: 12, 17: 0, 20: 16, 22: 16, 24: 20, 30: 24},
    3: {5: 0, 8: 0, 13: 8, 15: 8, 16: 8, 17: 0, 20: 0, 22: 16, 24: 16, 30: 24},
}


def grid_resend_at(length: int, k: int) -> int:
    return GRID_RESENDS[k][length]


def test_lookahead_ring_is_accepted_with_the_model_pool(model_dir):
    """Under MTP the ring group has the lookahead slots and the pool grid is the model's kpool."""
    scheduler, _, _ = spec_ring_engine(model_dir, 3, ACCEPT["all"](3))
    assert scheduler.boundaries_active
    ring = scheduler._geometries[RING]
    assert (ring.kind, ring.block_size, ring.pool, ring.label) == (GroupKind.RING, SLOTS, KPOOL, "ring/8 p4")
    assert scheduler._kpool == KPOOL


@pytest.mark.parametrize("accept", sorted(ACCEPT))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_lookahead_ring_restores_exactly_under_mtp(model_dir, k, accept):
    """Prompt and response bundles restore both rings (the target's and the MTP layer's) exactly:
    every decode step that completes a pool open at a restore reads the committed keys.
    Synchronous scheduling only: the async shadow (``spec_shadow.py``) does not model a request
    whose first step is scheduled with draft placeholders, which these resends are."""
    _, worker, driver = spec_ring_engine(model_dir, k, ACCEPT[accept](k))
    restore_rounds(driver, random.Random(10 * k), resend_at=lambda length: grid_resend_at(length, k))
    assert worker.ring_reads > 0


def rounds_beside_a_decoding_request(scheduler, driver, seed: int) -> None:
    """``restore_rounds`` with prompts on and off the pool grid (P - 1 and P multiples of 4
    among them) while a long request decodes beside them: its verify rows share their steps."""
    rng = random.Random(seed)
    scheduler.add_request(make_request(tokens(rng, 9), max_tokens=900, salt="neighbour"))
    k = scheduler.num_spec_tokens
    resend_at = (lambda length: grid_resend_at(length, k)) if scheduler._grid_only else None  # else P - 1
    restore_rounds(driver, rng, lengths=(5, 8, 13, 16, 17, 20, 24, 30), resend_at=resend_at)


@pytest.mark.parametrize("k", [1, 3])
def test_under_mtp_checkpoints_sit_on_the_pool_grid_beside_verify_rows(model_dir, k):
    """Contract 13, on the shadow of an indexer that needs uniform decode rows (Hopper): prompt
    checkpoints sit at a pool boundary below P - 1 (``GRID_RESENDS``) and responses are kept only
    on the grid, so no restore needs a one-token step that completes a pool beside verify rows, and
    no prefill row of the plugin's is as short as a verify row. Every restore is exact; some
    responses ended off the grid and kept nothing."""
    scheduler, worker, driver = spec_ring_engine(model_dir, k, ACCEPT["cycle"](k))
    rounds_beside_a_decoding_request(scheduler, driver, seed=k)
    counters = scheduler.checkpoint_store.counters
    assert counters.responses_off_pool_grid > 0 and counters.hits > 0
    assert "checkpoints only on the indexer's 4-token pool grid" in scheduler._pool_grid_line()


def fresh_request(length: int) -> SimpleNamespace:
    """What ``_grid_prompt_target`` reads of a fresh request of ``length`` prompt tokens."""
    return SimpleNamespace(request_id=f"fresh-{length}", num_prompt_tokens=length, num_tokens=length,
                           num_computed_tokens=0, shared_prefix_boundary=0)  # fmt: skip


def test_under_dflash_the_pooled_indexer_gets_the_pool_grid_rule(model_dir, tmp_path):
    """Contract 13 is not MTP's alone: with a DFlash config of k = 3 (a config-only drafter of
    ``fixtures/dflash.py``; vLLM's lookahead of k + 1) over the lookahead ring, the scheduler keeps
    checkpoints on the pool grid (``_grid_only``, restore tail ``k + 2``) and puts each fresh
    prompt's checkpoint where it does under MTP (``GRID_RESENDS``). Negative control: the same
    DFlash config without a ring (no pooled indexer) cuts nothing to a grid."""
    drafter = write_drafter_config(tmp_path / "drafter", model_dir)
    k = 3
    scheduler, _ = ring_scheduler(model_dir, ring_slots=SLOTS, num_speculative_tokens=k, drafter=drafter)
    assert scheduler.boundaries_active and scheduler.num_lookahead_tokens == k + 1  # DFlash, not MTP
    assert scheduler._grid_only and scheduler._restore_tail == restore_tail(k) == k + 2
    assert scheduler._geometries[RING].label == f"ring/{SLOTS} p{KPOOL}"
    targets = {length: scheduler._grid_prompt_target(fresh_request(length), 0) for length in GRID_RESENDS[k]}
    assert targets == GRID_RESENDS[k]
    assert "checkpoints only on the indexer's 4-token pool grid" in scheduler._pool_grid_line()
    no_ring, _ = build_scheduler(model_dir, num_speculative_tokens=k, drafter=drafter)
    assert no_ring.boundaries_active and not no_ring._grid_only and no_ring._restore_tail == 1


def test_under_mtp_without_the_row_rule_a_stop_leaves_a_short_prefill_row(model_dir, monkeypatch):
    """Negative control: with every pool boundary below ``P - 1`` taken as it comes, a stop leaves
    prefill rows of 1 to 4 tokens, no longer than a verify row at k = 3: the row shape in which
    the H200 test's first batch at k = 3 hit a device-side index assert (docs/results/gpu-glm-mtp-h200.md)."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3))
    monkeypatch.setattr(scheduler, "_adds_prefill_rows_only", lambda *args, **kwargs: True)
    with pytest.raises(ShadowMismatch, match="no longer than a verify row"):
        rounds_beside_a_decoding_request(scheduler, driver, seed=3)


@pytest.mark.parametrize("budget", [20, 24])
def test_under_mtp_a_budget_cut_before_a_stop_leaves_no_short_prefill_row(model_dir, budget):
    """vLLM's token budget ends a chunk on a block boundary just below the prompt checkpoint (e.g.
    at 48 for a stop at 52): the plugin then does not stop there, so no prefill row of its own is
    as short as a verify row (the shadow raises on one)."""
    _, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), max_num_batched_tokens=budget)
    rng = random.Random(budget)
    for length in range(40, 90, 3):
        driver.run([make_request(tokens(rng, length), salt=f"budget-{length}", max_tokens=2)])


def test_under_mtp_a_restore_leaves_a_prefill_row_even_on_the_block_grid(model_dir):
    """A 22-token producer keeps its checkpoint at 16, on vLLM's block grid: prompts that share its
    first 16 tokens and leave 2 to 4 more restore nothing (vLLM would not run those rows: under
    MTP its own hit leaves a block and more), one that leaves 5 restores 16. The three misses are
    counted as the rule's (``short_row``)."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3))
    rng = random.Random(3)
    prompt = tokens(rng, 22)
    driver.run([make_request(prompt, salt="s")])
    misses = scheduler.checkpoint_store.counters.misses_by_reason
    before = misses.get(MissReason.SHORT_ROW, 0)
    for length, cached in ((18, 0), (19, 0), (20, 0), (21, 16)):
        request = make_request(prompt[: length - 1] + tokens(rng, 1), salt="s")
        driver.run([request])
        assert driver.cached_tokens[request.request_id] == cached, length
    assert misses[MissReason.SHORT_ROW] - before == 3


def test_under_mtp_without_the_grid_rule_a_one_token_step_completes_a_pool_on_the_prefill_path(model_dir):
    """Negative control: without contract 13 the P - 1 stop leaves a one-token step that completes
    the pool beside the neighbour's verify rows, which the indexer runs on its prefill path."""
    scheduler, _, driver = spec_ring_engine(model_dir, 1, ACCEPT["cycle"](1), grid_only=False, uniform_decode_rows=True)
    with pytest.raises(ShadowMismatch, match="a 1-token step starts off the pool grid"):
        rounds_beside_a_decoding_request(scheduler, driver, seed=1)


def test_under_mtp_without_the_ring_copy_a_restore_reads_a_fresh_ring(model_dir, monkeypatch):
    """The off-grid restore path (no pool-grid rule): the resend restores at 21."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), grid_only=False)
    monkeypatch.setattr(scheduler, "_copy_restored_rings", lambda output: setattr(scheduler, "_ring_restores", {}))
    with pytest.raises(ShadowMismatch, match=r"ring group 3 at 22 is wrong \(position 20\)"):
        restore_rounds(driver, random.Random(5), lengths=(22,))  # the resend's first verify step reads 20, 21


def first_steps_after_prompt_restore(scheduler, driver, rng) -> list[int]:
    """Step sizes of a longer prompt that restores at its producer's ``P - 1`` = 26 (10 tokens past
    the block boundary 16: at least a pool past it for pools of 4 and 8)."""
    outputs = recorded_steps(scheduler)
    prompt = tokens(rng, 27)
    driver.run([make_request(prompt, salt="s")])
    longer = make_request(prompt + tokens(rng, 30), salt="s")
    first = len(outputs)
    driver.run([longer])
    assert driver.cached_tokens[longer.request_id] == 26
    return [s for s in (o.num_scheduled_tokens.get(longer.request_id) for o in outputs[first:]) if s][:8]


def test_under_mtp_the_pool_grid_is_the_model_pool_not_the_ring(model_dir, monkeypatch):
    """The off-grid path (no pool-grid rule): from 26 the consumer steps one token at a time to the
    pool boundary 28 and then prefills; a scheduler that took the pool from the ring's 8 slots
    would step one token at a time to 32."""
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), grid_only=False)
    steps = first_steps_after_prompt_restore(scheduler, driver, random.Random(8))
    assert steps[:2] == [1, 1] and steps[2] > 1
    scheduler, _, driver = spec_ring_engine(model_dir, 3, ACCEPT["all"](3), grid_only=False)
    monkeypatch.setattr(scheduler, "_kpool", SLOTS)
    steps = first_steps_after_prompt_restore(scheduler, driver, random.Random(8))
    assert steps[:6] == [1] * 6 and steps[6] > 1


def test_under_mtp_a_pool_sized_ring_is_refused(model_dir):
    """A ring of one pool under MTP is not the ring vLLM sizes: ``request_boundaries`` refuses."""
    with pytest.raises(BoundaryConfigError, match="is not the ring of 8 slots vLLM sizes for a pool of 4 tokens and 3"):
        spec_ring_engine(model_dir, 3, ACCEPT["all"](3), slots=KPOOL)


def test_the_drafter_passes_overrun_the_lookahead_ring_at_k4(model_dir, monkeypatch):
    """At k = 4 vLLM's ring of 8 slots holds the pool and the verify step's drafts, but the MTP
    drafter's 3 later passes wrap onto the open pool: the plugin refuses, and with the span rule
    taken away (counting the verify step's drafts only) the shadow sees a clobbered key."""
    with pytest.raises(BoundaryConfigError, match="of 8 slots cannot hold the 10 positions"):
        spec_ring_engine(model_dir, 4, ACCEPT["all"](4))
    monkeypatch.setattr(layout, "ring_span_at_boundary", lambda kpool, k: kpool - 1 + k)
    _, _, driver = spec_ring_engine(model_dir, 4, ACCEPT["all"](4), grid_only=False)
    with pytest.raises(ShadowMismatch, match="ring group 3 at .* is wrong"):
        restore_rounds(driver, random.Random(4), lengths=(5, 8, 15, 17, 22, 30, 31, 33))


def test_under_mtp_an_instruction_checkpoint_sits_on_the_pool_grid(model_dir):
    """Contract 13 for instruction boundaries: a shared instruction of 10 tokens keeps its
    checkpoint at 8, where a second conversation sharing it restores."""
    from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY

    scheduler, _, driver = spec_ring_engine(model_dir, 1, ACCEPT["cycle"](1))
    rng = random.Random(12)
    instruction = tokens(rng, 10)
    first, second = (make_request(instruction + tokens(rng, 9), salt="s") for _ in range(2))
    for request in (first, second):
        request.sampling_params.extra_args = {INSTRUCTION_TOKENS_KEY: 10}
        driver.run([request])
    assert driver.cached_tokens[second.request_id] == 8
