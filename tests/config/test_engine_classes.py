"""A real engine start picks the plugin's scheduler and worker classes, or stock ones for aligned.

Each engine runs in a fresh process (in-process engine core and worker, as ``vllm.LLM`` does with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the classes checked are the instances vLLM built.
"""

from __future__ import annotations

import pytest
from engine_script import run_engine_script

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
from vllm import LLM
llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
          enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True,
          disable_log_stats=False,
          additional_config={"boundary_checkpoints": {"policy": sys.argv[2], "prompt_capture": "in_step"}})
core = llm.llm_engine.engine_core.engine_core
copy_us = []  # the capture-copy times each step's SchedulerStats carries to the frontend
make_stats = core.scheduler.make_stats
def spy(*args, **kwargs):
    stats = make_stats(*args, **kwargs)
    if stats is not None:
        copy_us.extend(v for k, v in stats.num_kv_fetch_reqs_by_stage.items() if "capture_copy_us" in k)
    return stats
core.scheduler.make_stats = spy
worker = llm.collective_rpc(lambda self: type(self.worker).__module__ + "." + type(self.worker).__qualname__)[0]
# compat.engine_core_shares_worker_config: under the uni executor the worker holds the engine core's config
config_shared = llm.collective_rpc(lambda self: id(self.worker.vllm_config))[0] == id(core.vllm_config)
out = llm.generate([{"prompt_token_ids": list(range(4, 304))}] * 2, use_tqdm=False)
out += llm.generate([{"prompt_token_ids": list(range(4, 304))}], use_tqdm=False)  # a resend
copies = llm.collective_rpc("boundary_copy_counts")[0] if sys.argv[2] != "aligned" else None
print("RESULT " + json.dumps({
    "copies": copies,
    "copy_us": copy_us,
    "scheduler": type(core.scheduler).__module__ + "." + type(core.scheduler).__qualname__,
    "worker": worker,
    "config_shared": config_shared,
    "cached": [o.num_cached_tokens for o in out],
}))
"""


def start_engine(model_dir, policy: str) -> dict:
    info, log = run_engine_script(SCRIPT, str(model_dir), policy, timeout=600)
    return {**info, "log": log}


def test_request_boundaries_engine_uses_plugin_classes(tiny_model_dir):
    info = start_engine(tiny_model_dir, "request_boundaries")
    assert info["scheduler"] == "boundary_checkpoints.core.scheduler.BoundaryScheduler"
    assert info["worker"] == "boundary_checkpoints.worker.cpu.BoundaryCPUWorker"
    assert info["config_shared"]  # where the worker's prefix match unit reaches the engine core (match_unit.py)
    assert "boundary_checkpoints: policy=request_boundaries -> request_boundaries" in info["log"]
    assert "boundary_checkpoints: request_boundaries active" in info["log"]
    assert "capture-copy times on /metrics (the worker runs in the engine core's process)" in info["log"]
    assert "prompts hitting one cached recurrent state start a step apart (auto: a CPU step's" in info["log"]
    # The resend restores the prompt checkpoint at P - 1; the worker applied the capture and the
    # restore copies itself (vLLM's runner got a step without them).
    assert info["cached"][2] == 299
    captures, restores = info["copies"]
    assert captures > 0 and restores > 0
    # The worker timed its capture copies, and the times rode the engine's stats (worker in process).
    assert info["copy_us"] and all(us > 0 for us in info["copy_us"])


def test_aligned_engine_uses_stock_classes(tiny_model_dir):
    info = start_engine(tiny_model_dir, "aligned")
    assert info["scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert info["worker"] == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert "boundary_checkpoints: policy=aligned -> aligned" in info["log"]
    assert info["cached"][2] < 299
    assert info["copy_us"] == []
