"""Restored rows fit a CUDA graph (``core/graph_fit.py``, ``graph_fit_tokens``).

The rule on its own (:func:`defers`, :class:`GraphFit`), then vLLM's real scheduler over the
shadow runner (every state a row reads checked against a cold run), on Qwen3-Next's layout and
GLM-5.3-Flash's (indexer ring, pool grid, in-chunk states): four conversations' next
turns, each restored with 10 tokens to compute, arrive at once. With a ceiling of 24 tokens two
start now and two in the next step (two graph steps); with the rule off (the negative control)
all four share one step, and with a ceiling the rest would not fit either (15) nothing is split.
The restored tokens and the answers are the same in every case.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

from boundary_checkpoints.compat import mixed_batch_graph_ceiling
from boundary_checkpoints.core.graph_fit import GraphFit, defers, graph_fit_for, startup_phrase, waiting_rows
from boundary_checkpoints.settings import BoundaryConfig

# ---- the rule ---------------------------------------------------------------------------------


def test_eight_restored_next_turns_split_into_two_graphs_of_512():
    """The measured case: 8 rows of 101 tokens overflow 512; 5 start now, 3 (beside the first 5's
    decode rows) in the next step: the sixth waits."""
    assert not defers(404, 101, 4, [101] * 4, ceiling=512)  # the fifth still fits
    assert defers(505, 101, 5, [101] * 3, ceiling=512)


def test_no_wait_where_the_rest_would_not_fit_the_next_graph_either():
    """At 128 tokens the 7 left over take 707: waiting would add steps to an eager one."""
    assert not defers(101, 101, 1, [101] * 7, ceiling=128)


def test_no_wait_where_the_row_fits_or_the_step_is_eager_or_empty_anyway():
    assert not defers(404, 101, 4, [101], ceiling=512)
    assert not defers(600, 10, 1, [10], ceiling=512)
    assert not defers(0, 600, 0, [600], ceiling=512)


def test_no_wait_past_a_row_the_rule_cannot_size():
    """A waiting request behind that is not a restore (None) may be long."""
    assert not defers(505, 101, 5, [101, None], ceiling=512)


def test_the_next_steps_rows_count_against_its_graph():
    """Three rows of 30 now; the three left over (90) beside the first three's decode rows: 93
    tokens with one token each, 102 under MTP k = 3 (4 each), past the ceiling of 100."""
    assert defers(90, 30, 3, [30] * 3, ceiling=100)
    assert not defers(90, 30, 12, [30] * 3, ceiling=100)


def test_after_a_step_where_requests_waited_none_waits_and_each_wait_counts_its_rows():
    waited = []
    fit = GraphFit(24, 1, is_restored=lambda r: True, rows_behind=lambda r: [10], on_wait=waited.append)
    row = SimpleNamespace(num_tokens=58)
    for step in range(3):
        fit.step_starts()
        fit.allocated(row, 48, 10)
        fit.allocated(row, 48, 10)
        assert fit.waits(row, 48, 10) == (step != 1)
        assert fit.waits(row, 48, 10) == (step != 1)  # asked again in the same step: counted once
    assert waited == [2, 2]


def test_only_restored_requests_wait_and_rows_are_sized_as_the_next_step_takes_them():
    fit = GraphFit(24, 1, is_restored=lambda r: False, rows_behind=lambda r: [], on_wait=lambda n: None)
    row = SimpleNamespace(num_tokens=58)
    fit.allocated(row, 48, 10)
    fit.allocated(row, 48, 10)
    assert not fit.waits(row, 48, 10)
    new, resumed = SimpleNamespace(num_computed_tokens=0), SimpleNamespace(num_computed_tokens=7)
    assert waiting_rows([new, resumed, new], limit=2, tokens_after_restore=lambda r: 10) == [10, None]


def test_the_setting_and_the_ceiling():
    counters = SimpleNamespace(rows_fit_to_graph=0)

    def rule(setting, ceiling, num_spec_tokens=0):
        return graph_fit_for(setting, ceiling, num_spec_tokens, lambda r: True, lambda r: [], counters)

    assert rule("auto", 0) is None  # no CUDA graph for batches with prefills
    assert rule(0, 512) is None  # off
    assert rule("auto", 512, 3).ceiling == 512
    assert rule(256, 512, 3).decode_tokens == 4
    assert BoundaryConfig(graph_fit_tokens=64).graph_fit_tokens == 64
    assert "past 512 tokens" in startup_phrase(rule("auto", 512), "auto")
    assert "(auto: batches with prefills run without them)" in startup_phrase(None, "auto")
    assert startup_phrase(None, 0) == ""


def test_the_ceiling_is_vllms_largest_graph_for_batches_with_prefills():
    from vllm.config.compilation import CUDAGraphMode

    def config(mode, eager=False):
        compilation = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=512)
        return SimpleNamespace(compilation_config=compilation, model_config=SimpleNamespace(enforce_eager=eager))

    assert mixed_batch_graph_ceiling(config(CUDAGraphMode.FULL_AND_PIECEWISE)) == 512
    assert mixed_batch_graph_ceiling(config(CUDAGraphMode.PIECEWISE)) == 512
    assert mixed_batch_graph_ceiling(config(CUDAGraphMode.FULL_DECODE_ONLY)) == 0
    assert mixed_batch_graph_ceiling(config(CUDAGraphMode.NONE)) == 0
    assert mixed_batch_graph_ceiling(config(CUDAGraphMode.FULL_AND_PIECEWISE, eager=True)) == 0


# ---- on vLLM's scheduler ----------------------------------------------------------------------


LAYOUTS = {
    "qwen3_next": {},
    # GLM-5.3-Flash's: an indexer tail ring on a 4-token pool grid, recurrent states saved inside chunks
    "glm": {"ring_kpool": 4, "prefill_checkpoint_alignment": 4},
}


def next_turns_at_once(
    model_dir, graph_fit, async_scheduling=False, first_prompt=45, layout="qwen3_next", last_bypasses_cache=False
):
    """Four first turns of ``first_prompt`` tokens answered with 4 tokens, then their next turns (9
    new tokens each) sent at once: (the scheduler, prefill rows per step until all started, cached
    tokens, answers). At 45 tokens each restores at 48, a block boundary, and computes its 10
    tokens in one chunk; at 40 at 43, and its first chunk ends at the block's end (5 tokens).
    ``last_bypasses_cache``: the last next turn skips the prefix cache (as with prompt logprobs)."""
    scheduler, worker = build_scheduler(
        model_dir, policy="request_boundaries", block_size=16, num_blocks=512, max_num_seqs=16,
        max_num_batched_tokens=512, max_model_len=1024, async_scheduling=async_scheduling, prompt_capture="auto",
        graph_fit_tokens=graph_fit, **LAYOUTS[layout],
    )  # fmt: skip
    driver = Driver(scheduler, worker, lag=int(async_scheduling))
    rng = random.Random(5)
    first = [make_request(tokens(rng, first_prompt), max_tokens=4) for _ in range(4)]
    answers = driver.run(first)
    turns = [make_request(r.prompt_token_ids + a + tokens(rng, 9), max_tokens=3) for r, a in zip(first, answers)]
    turns[-1].skip_reading_prefix_cache = last_bypasses_cache
    per_step, outputs = driver.start_at_once(turns)
    return scheduler, per_step, [driver.cached_tokens[r.request_id] for r in turns], outputs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_restored_next_turns_past_the_ceiling_start_in_two_graph_sized_steps(model_dir, async_scheduling, layout):
    scheduler, per_step, cached, outputs = next_turns_at_once(model_dir, 24, async_scheduling, layout=layout)
    _, per_step_off, cached_off, outputs_off = next_turns_at_once(model_dir, 0, async_scheduling, layout=layout)
    assert per_step_off == [4], "negative control: without the rule the four share one step"
    assert per_step == [2, 2]
    assert cached == cached_off == [48] * 4  # each restored at its exact boundary either way
    assert outputs == outputs_off
    assert scheduler.checkpoint_store.counters.rows_fit_to_graph == 2


def test_nothing_waits_where_the_rest_would_not_fit_the_next_graph(model_dir):
    scheduler, per_step, cached, _ = next_turns_at_once(model_dir, 15)
    assert per_step == [4] and cached == [48] * 4
    assert scheduler.checkpoint_store.counters.rows_fit_to_graph == 0


def test_a_waiting_request_that_skips_the_prefix_cache_is_not_sized_as_a_restore(model_dir):
    """The fourth next turn computes its whole prompt: the rule cannot tell the next step fits."""
    scheduler, per_step, cached, _ = next_turns_at_once(model_dir, 24, last_bypasses_cache=True)
    assert per_step == [4] and cached == [48, 48, 48, 0]
    assert scheduler.checkpoint_store.counters.rows_fit_to_graph == 0


def test_the_rule_counts_the_tokens_vllm_schedules(model_dir):
    """Restores at 43 compute 5 tokens each in their first step: four fit 24 together."""
    scheduler, per_step, cached, _ = next_turns_at_once(model_dir, 24, first_prompt=40)
    assert per_step == [4] and cached == [43] * 4
    assert scheduler.checkpoint_store.counters.rows_fit_to_graph == 0


def test_auto_on_a_cpu_is_off_and_on_a_gpu_takes_vllms_ceiling(model_dir, monkeypatch):
    scheduler, per_step, _, _ = next_turns_at_once(model_dir, "auto")
    assert scheduler._graph_fit is None and per_step == [4]
    monkeypatch.setattr("boundary_checkpoints.core.scheduler.mixed_batch_graph_ceiling", lambda config: 24)
    scheduler, per_step, _, _ = next_turns_at_once(model_dir, "auto")
    assert scheduler._graph_fit.ceiling == 24 and per_step == [2, 2]


def test_the_waiting_queue_is_read_only_where_the_step_would_cross_the_ceiling():
    reads = []
    fit = GraphFit(
        24, 1, is_restored=lambda r: True, rows_behind=lambda r: reads.append(r) or [], on_wait=lambda n: None
    )
    row = SimpleNamespace(num_tokens=58)
    fit.step_starts()
    for _ in range(2):
        assert not fit.waits(row, 48, 10)
        fit.allocated(row, 48, 10)
    assert reads == []
    assert fit.waits(row, 48, 10) and reads == [row]
