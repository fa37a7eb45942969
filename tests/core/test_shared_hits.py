"""Prompts that hit one cached recurrent state start in the same engine step (``core/shared_hits.py``).

vLLM's real scheduler over the shadow runner, whose rows read their recurrent states as the step
found them (``parallel_rows``, as on a GPU; any state read that differs from a cold run raises), on
Qwen3-Next's layout and GLM-5.3-Flash's (indexer ring, in-chunk states). Six prompts share a cached
96-token prefix and arrive at once: stock starts one per step (one per two under async
scheduling), the plugin all six in one step, each with stock's hit and the tokens of a cold run.
Negative control: a release that also takes back the mark of a state its own step computes lets a
sibling read that state before it is written, and the runner says so.
"""

from __future__ import annotations

import random

import pytest
from shadow_engine import ShadowMismatch
from shadow_scheduler import Driver, build_scheduler, make_request, tokens
from shared_hits_variants import ReleasingEveryMark

from boundary_checkpoints.compat import same_step_marks, single_type_managers
from boundary_checkpoints.core.shared_hits import decide_together

LAYOUTS = {
    "qwen3_next": {},
    # GLM-5.3-Flash's: an indexer tail ring on a 4-token pool grid, recurrent states saved inside chunks
    "glm": {"ring_kpool": 4, "prefill_checkpoint_alignment": 4},
}


def engine(model_dir, policy: str, async_scheduling: bool, layout: str = "qwen3_next", together: bool | str = True):
    scheduler, worker = build_scheduler(
        model_dir, policy=policy, block_size=16, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=512,
        max_model_len=1024, async_scheduling=async_scheduling, prompt_capture="auto", **LAYOUTS[layout],
        shared_hits_together=together,
    )  # fmt: skip
    assert worker.parallel_rows, "the negative control needs rows that read their states at once"
    return scheduler, Driver(scheduler, worker, lag=int(async_scheduling))


def run_siblings(
    model_dir, policy: str, async_scheduling: bool, prefix_cached: bool = True, layout="qwen3_next", together=True
):
    """Six prompts sharing a 96-token prefix (cached first unless ``prefix_cached`` is False), sent
    at once: (prefill rows per step until all have started, their cached tokens, their outputs)."""
    scheduler, driver = engine(model_dir, policy, async_scheduling, layout, together)
    rng = random.Random(3)
    prefix = tokens(rng, 96)
    primer = make_request(prefix + tokens(rng, 7), max_tokens=2)
    if prefix_cached:
        driver.run([primer])
    requests = [make_request(prefix + tokens(rng, 7), max_tokens=2) for _ in range(6)]
    prefills_per_step, outputs = driver.start_at_once(requests)
    return scheduler, prefills_per_step, [driver.cached_tokens[r.request_id] for r in requests], outputs


@pytest.fixture
def cold_outputs(model_dir):
    """The six prompts' outputs, each run alone on a fresh stock engine."""
    rng = random.Random(3)
    prefix = tokens(rng, 96)
    tokens(rng, 7)
    prompts = [prefix + tokens(rng, 7) for _ in range(6)]
    outputs = []
    for prompt in prompts:
        _, driver = engine(model_dir, "aligned", False)
        outputs += driver.run([make_request(prompt, max_tokens=2)])
    return outputs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stock_starts_prompts_sharing_a_cached_state_one_step_apart(model_dir, async_scheduling, layout):
    """Why the plugin does it: vLLM defers every sibling of the first a step (two under async)."""
    _, per_step, cached, _ = run_siblings(model_dir, "aligned", async_scheduling, layout=layout)
    assert max(per_step) == 1
    assert len(per_step) == (11 if async_scheduling else 6)
    assert cached == [96] * 6


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_plugin_starts_them_in_one_step_with_stocks_hit_and_a_cold_runs_tokens(
    model_dir, cold_outputs, async_scheduling, layout
):
    scheduler, per_step, cached, outputs = run_siblings(
        model_dir, "request_boundaries", async_scheduling, layout=layout
    )
    assert per_step == [6]
    assert cached == [96] * 6
    assert outputs == cold_outputs
    assert scheduler.checkpoint_store.counters.shared_hits_released >= 5


@pytest.mark.parametrize("setting", ["auto", False])
def test_on_a_cpu_the_default_and_false_keep_vllms_order(model_dir, setting):
    scheduler, per_step, cached, _ = run_siblings(model_dir, "request_boundaries", False, together=setting)
    assert max(per_step) == 1 and cached == [96] * 6
    assert scheduler.kv_cache_manager.shared_hits is None


def test_on_a_gpu_the_default_starts_them_in_one_step(model_dir, cold_outputs, monkeypatch):
    monkeypatch.setattr("boundary_checkpoints.core.scheduler.platform_is_cpu", lambda: False)
    scheduler, per_step, cached, outputs = run_siblings(model_dir, "request_boundaries", False, together="auto")
    assert per_step == [6] and cached == [96] * 6 and outputs == cold_outputs


def test_the_startup_phrase_says_what_auto_decided_and_why():
    on_gpu, on_cpu = decide_together("auto", on_cpu=False), decide_together("auto", on_cpu=True)
    assert on_gpu[0] and "same step (auto: a GPU" in on_gpu[1]
    assert not on_cpu[0] and "a step apart (auto: a CPU" in on_cpu[1]
    assert decide_together(True, on_cpu=True) == (
        True,
        ", prompts hitting one cached recurrent state start in the same step",
    )
    assert decide_together(False, on_cpu=False) == (False, "")


def test_a_state_computed_in_the_same_step_still_defers_its_hits(model_dir, cold_outputs):
    """Nothing cached: the first prompt computes the shared state, its siblings' hits on it wait
    for that step to end, as in stock, and read it exactly."""
    _, per_step, cached, outputs = run_siblings(model_dir, "request_boundaries", False, prefix_cached=False)
    assert per_step[0] == 1
    assert cached[0] == 0 and all(c >= 96 for c in cached[1:])
    assert outputs == cold_outputs


def test_negative_control_a_hit_on_a_state_its_own_step_computes_reads_it_unwritten(model_dir):
    scheduler, driver = engine(model_dir, "request_boundaries", False)
    scheduler.kv_cache_manager.shared_hits = ReleasingEveryMark(scheduler.kv_cache_manager, lambda: None)
    assert any(same_step_marks(m) is not None for m in single_type_managers(scheduler.kv_cache_manager))
    rng = random.Random(3)
    prefix = tokens(rng, 96)
    requests = [make_request(prefix + tokens(rng, 7), max_tokens=2) for _ in range(6)]
    with pytest.raises(ShadowMismatch, match="recurrent group"):
        driver.run(requests)
