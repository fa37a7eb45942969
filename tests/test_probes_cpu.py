"""The GPU probe scenario (``bench.probes``) on the real CPU engine: every probe hits exactly.

Same code path as ``test_gpu_e2e.py`` (``run_probes``, ``calibrate``, ``probe_failures``) at CPU
size: prompt lengths 1, B-1, B, B+1 and 600 (B = the engine's block size), all conversations in one
batch, in a fresh process (in-process engine core and worker, as ``vllm.LLM`` does with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Three engines run one after the other in that process: the
plugin, stock ``aligned`` (its partial block-grid hits calibrate the bounds, with cold-vs-cold
pairs), and the plugin with ``corrupt_restore.CorruptScheduler`` (restores one token of state off),
the negative control that must fail the same criteria. ``BC_RESULTS_DIR`` (if set) receives
``cpu-engine-probes.json``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from corrupt_restore import corrupted_pairs
from engine_script import run_engine_script
from results_out import save_json

from boundary_checkpoints.bench.probes import (
    ProbeRow,
    calibrate,
    count_failures,
    probe_failures,
    reference_pairs,
    state_failures,
)

pytestmark = pytest.mark.slow

SCRIPT = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[2])  # tests/: the corrupting scheduler
from vllm import LLM
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from boundary_checkpoints.bench.probes import run_probes
out = {}
for run in ("request_boundaries", "aligned", "corrupt"):
    extra = {"scheduler_cls": "corrupt_restore.CorruptScheduler"} if run == "corrupt" else {}  # CPU: sync
    policy = "aligned" if run == "aligned" else "request_boundaries"
    llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
              enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True, seed=0,
              additional_config={"boundary_checkpoints": {"policy": policy}}, **extra)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    rows = run_probes(llm, [1, block - 1, block, block + 1, 600], 5, 16)
    copies = llm.collective_rpc("boundary_copy_counts")[0] if policy != "aligned" else None
    out[run] = {"block": block, "rows": [r.as_dict() for r in rows], "copies": copies,
                "scheduler": type(llm.llm_engine.engine_core.engine_core.scheduler).__name__}
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    info, _ = run_engine_script(SCRIPT, str(tiny_model_dir), str(Path(__file__).resolve().parent))
    rows = {run: [ProbeRow.from_dict(row) for row in data["rows"]] for run, data in info.items()}
    bounds = calibrate(reference_pairs(rows["request_boundaries"], rows["aligned"]))
    save_json("cpu-engine-probes.json", {"bounds": bounds.as_dict(), **info})
    return info, rows, bounds


def test_cpu_engine_probes_hit_exactly(runs):
    info, rows, bounds = runs
    block = info["request_boundaries"]["block"]
    plugin = rows["request_boundaries"]
    assert sorted(r.prompt_len for r in plugin) == sorted([1, block - 1, block, block + 1, 600])
    assert bounds.references > len(plugin) * 2  # cold-vs-cold pairs of both engines plus stock hits
    assert probe_failures(plugin, bounds) == [], bounds
    captures, restores = info["request_boundaries"]["copies"]
    assert captures > 0 and restores > 0


def test_a_restore_one_token_off_fails_the_same_criteria(runs):
    """Negative control (see ``corrupt_restore``): a resend from a prompt checkpoint one token late
    keeps its exact count and fails the state criteria; a continuation from a response checkpoint
    keyed one token short fails the count (see ``test_server_boundaries`` for why only that)."""
    info, rows, bounds = runs
    assert info["corrupt"]["scheduler"] == "CorruptScheduler"
    block = info["corrupt"]["block"]
    resends = continuations = 0
    for row in rows["corrupt"]:
        expected = corrupted_pairs(row.prompt_len, row.committed, block)
        if "resend" in expected:
            resends += 1
            assert row.resend.cached == row.prompt_len - 1  # the count cannot see this one
            assert state_failures("resend", row.resend, row.producer, bounds), (row.prompt_len, bounds)
        if "continuation" in expected:
            continuations += 1
            assert any("continuation cached" in f for f in count_failures(row)), row.prompt_len
    assert resends >= 3 and continuations == len(rows["corrupt"])
