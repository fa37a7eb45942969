"""The GPU probe scenario (``bench.probe_scenario``) on the real CPU engine: every probe hits exactly.

Same code path as ``test_gpu_e2e.py`` (``run_probes``, ``calibrate``, ``probe_failures``) at CPU
size: prompt lengths 1, B-1, B, B+1 and 600 (B = the engine's block size), all conversations in one
batch, in a fresh process (in-process engine core and worker, as ``vllm.LLM`` does with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Six engines run one after the other in that process: the
plugin (prompt checkpoints captured in the step, ``prompt_capture: in_step``), stock ``aligned`` (its partial
block-grid hits calibrate the bounds, with cold-vs-cold pairs), the plugin with
``corrupt_restore.CorruptScheduler`` (restores one token of state off: its prompt checkpoints hold
the state after ``P``), the negative control that must fail the same criteria, and the plugin
with ``prompt_capture: stop`` (the ``P - 1`` stop every engine falls back to where in-step capture
is unsupported); then the plugin and its negative control again with ``--prefix-match-unit 16``.
Each engine's scheduler records the prefill chunks that ended at ``P - 1``.
``BC_RESULTS_DIR`` (if set) receives ``cpu-engine-probes.json``.
"""

from __future__ import annotations

import pytest
from corrupt_restore import corrupted_pairs
from engine_script import calibrated, engine_fixture

from bc_tools.bench.probes import count_failures, probe_failures, state_failures

pytestmark = pytest.mark.slow

SCRIPT = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[2])  # tests/helpers/: the corrupting scheduler
from vllm import LLM
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from bc_tools.bench.probe_scenario import run_probes
from chunk_recorder import record_p_minus_1_chunks

out = {}
for run in ("request_boundaries", "aligned", "corrupt", "stop", "unit16", "corrupt_unit16"):
    extra = {"scheduler_cls": "corrupt_restore.CorruptScheduler"} if run.startswith("corrupt") else {}  # CPU: sync
    if run.endswith("unit16"):
        extra["prefix_match_unit"] = 16
    section = {"policy": "aligned" if run == "aligned" else "request_boundaries",
               "prompt_capture": "stop" if run == "stop" else "in_step"}
    llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
              enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True, seed=0,
              additional_config={"boundary_checkpoints": section}, **extra)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    chunks = record_p_minus_1_chunks(scheduler)
    rows = run_probes(llm, [1, block - 1, block, block + 1, 600], 5, 16)
    out[run] = {"block": block, "rows": [r.as_dict() for r in rows], "scheduler": type(scheduler).__name__,
                "p_minus_1_chunks": chunks}
    if run != "aligned":
        stats = scheduler.boundary_stats()
        out[run].update(
            copies=llm.collective_rpc("boundary_copy_counts")[0],
            in_step_pairs=llm.collective_rpc("boundary_in_step_count")[0],
            recurrent_groups=sum(g.kind.value == "recurrent" for g in scheduler._geometries),
            prompt_stops=stats["prompt_stops"], prompt_captures_in_step=stats["prompt_captures_in_step"],
        )
    del llm, scheduler
    gc.collect()
    cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(out))
"""


runs = engine_fixture(SCRIPT, then=calibrated("cpu-engine-probes.json"))


def test_cpu_engine_probes_hit_exactly(runs):
    info, rows, bounds = runs
    block = info["request_boundaries"]["block"]
    plugin = rows["request_boundaries"]
    assert sorted(r.prompt_len for r in plugin) == sorted([1, block - 1, block, block + 1, 600])
    assert bounds.references > len(plugin) * 2  # cold-vs-cold pairs of both engines plus stock hits
    assert probe_failures(plugin, bounds) == [], bounds
    captures, restores = info["request_boundaries"]["copies"]
    assert captures > 0 and restores > 0


def test_fresh_prompts_run_in_one_step_with_in_step_capture(runs):
    """No prefill chunk of the plugin ends at ``P - 1`` except where vLLM's own align-mode split
    puts one there (``P - 1`` a multiple of the block: stock ends the same chunk), every prompt
    checkpoint was captured in its step, and the worker's layers took every capture pair."""
    info, rows, _ = runs
    run = info["request_boundaries"]
    block = run["block"]
    assert all((length - 1) % block == 0 for length in run["p_minus_1_chunks"]), run["p_minus_1_chunks"]
    assert sorted(info["aligned"]["p_minus_1_chunks"]) == sorted(run["p_minus_1_chunks"])
    assert run["prompt_stops"] == 0
    # Producers of P > 1 whose P - 1 is off the block grid, and every continuation and cold control.
    fresh = [r for r in rows["request_boundaries"] if r.prompt_len > 1 and (r.prompt_len - 1) % block]
    assert run["prompt_captures_in_step"] >= len(fresh) + 3 * len(rows["request_boundaries"])
    assert run["in_step_pairs"] == run["prompt_captures_in_step"] * run["recurrent_groups"]


def test_a_finer_prefix_match_unit_hits_exactly(runs):
    """``--prefix-match-unit 16`` (vLLM's hash block finer than the 256-token block): the plugin's
    keys follow vLLM's hash block, and every probe hits exactly as with the default unit."""
    info, rows, bounds = runs
    assert probe_failures(rows["unit16"], bounds) == [], bounds
    captures, restores = info["unit16"]["copies"]
    assert captures > 0 and restores > 0


def test_the_stop_fallback_still_stops_at_p_minus_1_and_hits_exactly(runs):
    info, rows, bounds = runs
    run = info["stop"]
    block = run["block"]
    assert run["prompt_captures_in_step"] == 0 and run["in_step_pairs"] == 0
    assert run["prompt_stops"] > 0
    stopped = set(run["p_minus_1_chunks"])
    assert {r.prompt_len for r in rows["stop"] if r.prompt_len > 1} <= stopped
    assert {block - 1, block, 600} <= stopped  # off the grid: only the plugin's stop ends a chunk there
    assert probe_failures(rows["stop"], bounds) == [], bounds


@pytest.mark.parametrize("run", ["corrupt", "corrupt_unit16"])
def test_a_restore_one_token_off_fails_the_same_criteria(runs, run):
    """Negative control (see ``corrupt_restore``): a resend from a prompt checkpoint holding the
    state after ``P`` (copied after the step instead of split inside it) keeps its exact count and
    fails the state criteria; a continuation from a response checkpoint keyed one token short
    fails the count (see ``test_server_boundaries`` for why only that). ``corrupt_unit16``: the
    same with ``--prefix-match-unit 16``."""
    info, rows, bounds = runs
    assert info[run]["scheduler"] == "CorruptScheduler"
    assert info[run]["in_step_pairs"] == 0 and info[run]["prompt_captures_in_step"] > 0
    block = info[run]["block"]
    resends = continuations = 0
    for row in rows[run]:
        expected = corrupted_pairs(row.prompt_len, row.committed, block)
        if "resend" in expected:
            resends += 1
            assert row.resend.cached == row.prompt_len - 1  # the count cannot see this one
            assert state_failures("resend", row.resend, row.producer, bounds), (row.prompt_len, bounds)
        if "continuation" in expected:
            continuations += 1
            assert any("continuation cached" in f for f in count_failures(row)), row.prompt_len
    assert resends == 3 and continuations == len(rows[run])
