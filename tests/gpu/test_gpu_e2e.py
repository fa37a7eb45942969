"""GPU host: boundary probes under Model Runner V2, CUDA graphs and async scheduling (vLLM defaults).

32 conversations at once, prompt lengths 1, B-1, B, B+1, 3000, 8193 and 32768 (B = the engine's
block size), each with a cold producer, an exact resend, a continuation and two cold controls under
fresh salts; stock ``aligned`` measured in the same run (its partial hits calibrate the bounds).
The negative control (a corrupted restore must fail these criteria) runs on CPU:
``test_probes_cpu.py`` and ``test_server_boundaries.py``. ``BC_RESULTS_DIR`` (if set) receives
``gpu-probes.json`` and ``gpu-probes.md``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
from results_out import results_dir, save_json

from bc_tools.bench.probes import calibrate, probe_failures
from bc_tools.bench.reference_pairs import reference_pairs

pytestmark = pytest.mark.gpu

CONVERSATIONS = 32
MAX_TOKENS = 64


def run_policy(model_dir: Path, policy: str):
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from bc_tools.bench.probe_scenario import run_probes

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        mamba_ssm_cache_dtype="float32",
        max_model_len=33_280,
        max_num_seqs=CONVERSATIONS,
        gpu_memory_utilization=0.35,
        enable_prefix_caching=True,
        seed=0,
        additional_config={
            "gdn_prefill_backend": "triton",
            "boundary_checkpoints": {"policy": policy, "prompt_capture": "in_step"},
        },
    )
    config = llm.llm_engine.vllm_config
    block = config.cache_config.block_size
    setup = {
        "block_size": block,
        "async_scheduling": config.scheduler_config.async_scheduling,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "scheduler_cls": str(config.scheduler_config.scheduler_cls),
        "worker_cls": config.parallel_config.worker_cls,
    }
    rows = run_probes(llm, [1, block - 1, block, block + 1, 3000, 8193, 32768], CONVERSATIONS, MAX_TOKENS)
    if policy != "aligned":  # capture and restore copies the plugin's worker applied
        setup["worker_copies"] = llm.collective_rpc("boundary_copy_counts")[0]
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return setup, rows


@pytest.fixture(scope="module")
def probe_results(tiny_model_dir):
    results = {policy: run_policy(tiny_model_dir, policy) for policy in ("request_boundaries", "aligned")}
    out = results_dir()
    if out is not None:
        from bc_tools.bench.probe_scenario import summarize

        bounds = calibrate(reference_pairs(results["request_boundaries"][1], results["aligned"][1]))
        payload = {p: {"setup": s, "rows": [r.as_dict() for r in rows]} for p, (s, rows) in results.items()}
        save_json("gpu-probes.json", {**payload, "bounds": bounds.as_dict()})
        text = "\n\n".join(f"## {p}\n{json.dumps(s)}\n\n{summarize(rows, bounds)}" for p, (s, rows) in results.items())
        (out / "gpu-probes.md").write_text(text + "\n")
    return results


def test_gpu_defaults_are_in_force(probe_results):
    setup, _ = probe_results["request_boundaries"]
    assert setup["async_scheduling"] is True
    assert "NONE" not in setup["cudagraph_mode"]
    assert setup["scheduler_cls"].endswith("BoundaryAsyncScheduler")
    assert setup["worker_cls"].endswith("BoundaryGPUWorker")
    captures, restores = setup["worker_copies"]  # the worker's kernel applied both kinds
    assert captures > 0 and restores > 0, setup


def test_every_probe_hits_exactly_and_matches_its_cold_control(probe_results):
    """Exact hits everywhere and restored states as good as cold ones, within bounds calibrated on
    this run's stock partial hits and cold-vs-cold pairs (criteria and why in ``bench.probes``)."""
    _, rows = probe_results["request_boundaries"]
    _, stock_rows = probe_results["aligned"]
    bounds = calibrate(reference_pairs(rows, stock_rows))
    assert probe_failures(rows, bounds) == [], bounds


def test_stock_aligned_never_beats_the_plugin(probe_results):
    _, plugin_rows = probe_results["request_boundaries"]
    _, stock_rows = probe_results["aligned"]
    for plugin, stock in zip(plugin_rows, stock_rows, strict=True):
        assert stock.prompt_len == plugin.prompt_len
        assert stock.resend.cached <= plugin.resend.cached, stock.prompt_len
        assert stock.restored.cached <= plugin.restored.cached, stock.prompt_len
