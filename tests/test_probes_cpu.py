"""The GPU probe scenario (``bench.probes``) on the real CPU engine: every probe hits exactly.

Same code path as ``test_gpu_e2e.py`` (``run_probes`` + ``probe_failures``) at CPU size: prompt
lengths 1, B-1, B, B+1 and 600 (B = the engine's block size), all conversations in one batch,
in a fresh process (in-process engine core and worker, as ``vllm.LLM`` does with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import pytest
from engine_script import run_engine_script

from boundary_checkpoints.bench.probes import ProbeRow, probe_failures

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
from vllm import LLM
from boundary_checkpoints.bench.probes import run_probes
llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
          enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True, seed=0,
          additional_config={"boundary_checkpoints": {"policy": "request_boundaries"}})
block = llm.llm_engine.vllm_config.cache_config.block_size
rows = run_probes(llm, [1, block - 1, block, block + 1, 600], 5, 8)
print("RESULT " + json.dumps({"block": block, "rows": [r.as_dict() for r in rows],
                              "copies": llm.collective_rpc("boundary_copy_counts")[0]}))
"""


def test_cpu_engine_probes_hit_exactly(tiny_model_dir):
    info, _ = run_engine_script(SCRIPT, str(tiny_model_dir))
    rows = [ProbeRow(**row) for row in info["rows"]]
    assert sorted(r.prompt_len for r in rows) == sorted([1, info["block"] - 1, info["block"], info["block"] + 1, 600])
    assert probe_failures(rows) == []
    for row in rows:  # probe_failures checks ">="; on this engine the hits are exactly the boundaries
        assert row.resend_cached == max(row.prompt_len - 1, 0) and row.continuation_cached == row.committed, row
    captures, restores = info["copies"]
    assert captures > 0 and restores > 0
