"""GPU host: in-step prompt capture end to end under vLLM's GPU defaults (Model Runner V2, CUDA
graphs, async scheduling) with the FLA Triton GDN prefill kernel, on the tiny Qwen3-Next.

One fresh process (:func:`engine_script.run_engine_script`: engine core and worker in it) runs
``bench.probe_scenario.run_probes`` (cold producer, exact resend, continuation restored from the
response, two cold controls; every phase one shared batch of 10 conversations, prompt lengths 1,
B - 1, B, B + 1 and 3000, B the engine's block size) three times: the plugin (``prompt_capture``
set to ``in_step``, as ``auto`` decides with this kernel);
the same engine with its scheduler re-classed to
``corrupt_restore``'s corrupting scheduler (its prompt checkpoints hold the state after ``P``:
the negative control, fresh prompts); stock ``aligned`` on a second engine, the plugin's prompts
(its partial hits and cold controls calibrate the bounds). Each scheduler records the prefill
chunks that end at ``P - 1``.

Checked: the engine ran in step (decision, GPU defaults); no prefill chunk of the plugin ends at
``P - 1`` except where vLLM's own align-mode split ends stock's there too; every capture pair was
taken by the GDN layers (``prompt_stops`` 0, ``prompt_captures_in_step`` > 0, worker pairs =
captures x recurrent groups); exact cached counts and first-token logprobs within the bounds
calibrated in the same run; the corrupted resends fail those bounds. ``BC_RESULTS_DIR`` (if set)
receives ``gpu-in-step-probes.json``. About two engine starts and three short scenarios.
"""

from __future__ import annotations

import pytest
from corrupt_restore import corrupted_pairs
from engine_script import calibrated, engine_fixture

from bc_tools.bench.probes import probe_failures, state_failures

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[2])  # tests/helpers/: the corrupting schedulers
from vllm import LLM
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from bc_tools.bench.probe_scenario import run_probes
from boundary_checkpoints.core.scheduler import BoundaryAsyncScheduler
from corrupt_restore import CorruptAsyncScheduler, CorruptScheduler
from chunk_recorder import record_p_minus_1_chunks

def engine(policy):
    return LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=4096,
               max_num_seqs=16, gpu_memory_utilization=0.3, enable_prefix_caching=True, seed=0,
               additional_config={"gdn_prefill_backend": "triton",
                                  "boundary_checkpoints": {"policy": policy, "prompt_capture": "in_step"}})

def run(llm, scheduler, lengths, seed):
    chunks = record_p_minus_1_chunks(scheduler)
    rows = run_probes(llm, lengths, 2 * len(lengths), 32, seed=seed)
    del scheduler.schedule  # the class's again
    return {"rows": [row.as_dict() for row in rows], "p_minus_1_chunks": chunks}

out = {}
llm = engine("request_boundaries")
config = llm.llm_engine.vllm_config
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
block = config.cache_config.block_size
lengths = [1, block - 1, block, block + 1, 3000]
out["setup"] = {"block": block, "async_scheduling": config.scheduler_config.async_scheduling,
                "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
                "scheduler": type(scheduler).__name__, "prompt_capture": scheduler._prompt_capture.mode,
                "recurrent_groups": sum(g.kind.value == "recurrent" for g in scheduler._geometries)}
out["request_boundaries"] = run(llm, scheduler, lengths, 0)
stats = scheduler.boundary_stats()
out["setup"].update(prompt_stops=stats["prompt_stops"], prompt_captures_in_step=stats["prompt_captures_in_step"],
                    in_step_pairs=llm.collective_rpc("boundary_in_step_count")[0])
scheduler.__class__ = CorruptAsyncScheduler if isinstance(scheduler, BoundaryAsyncScheduler) else CorruptScheduler
out["corrupt"] = run(llm, scheduler, lengths, 1)
del llm, scheduler
gc.collect()
cleanup_dist_env_and_memory()
llm = engine("aligned")
out["aligned"] = run(llm, llm.llm_engine.engine_core.engine_core.scheduler, lengths, 0)
del llm
gc.collect()
cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(out))
"""


runs = engine_fixture(
    SCRIPT, runs=("request_boundaries", "corrupt", "aligned"), timeout=600, then=calibrated("gpu-in-step-probes.json")
)


def test_gpu_defaults_run_in_step(runs):
    info, _, _ = runs
    setup = info["setup"]
    assert setup["async_scheduling"] is True and "NONE" not in setup["cudagraph_mode"], setup
    assert setup["scheduler"] == "BoundaryAsyncScheduler" and setup["prompt_capture"] == "in_step", setup


def test_no_prefill_of_the_plugin_stops_at_p_minus_1(runs):
    info, rows, _ = runs
    setup, chunks = info["setup"], info["request_boundaries"]["p_minus_1_chunks"]
    # vLLM's align-mode split ends non-final chunks on the block grid only, so a chunk ending at
    # P - 1 with P - 1 off the grid can only be the plugin's stop.
    assert all((length - 1) % setup["block"] == 0 for length in chunks), chunks
    assert setup["prompt_stops"] == 0 and setup["prompt_captures_in_step"] >= len(rows["request_boundaries"]), setup
    assert setup["in_step_pairs"] == setup["prompt_captures_in_step"] * setup["recurrent_groups"], setup


def test_every_probe_hits_exactly_and_matches_its_cold_control(runs):
    _, rows, bounds = runs
    assert probe_failures(rows["request_boundaries"], bounds) == [], bounds


def test_a_prompt_checkpoint_after_p_fails_the_same_bound(runs):
    info, rows, bounds = runs
    block = info["setup"]["block"]
    corrupted = [row for row in rows["corrupt"] if "resend" in corrupted_pairs(row.prompt_len, row.committed, block)]
    assert len(corrupted) >= 4
    for row in corrupted:
        assert row.resend.cached == row.prompt_len - 1
        assert state_failures("resend", row.resend, row.producer, bounds), (row.prompt_len, bounds)
