"""Diagnosis of run 40's crash (GLM-5.3-Flash planted MTP fixture, k = 3): does stock vLLM crash too?

Runs the producer and resend phases of ``bench.probe_scenario.run_probes`` (the traffic of
tests/test_gpu_spec_families.py's first scenario: 32 conversations, 16 answer tokens) under MTP
k = 3, once with policy ``aligned`` (stock) and once with ``request_boundaries``, each in its own
process with CUDA_LAUNCH_BLOCKING=1 so that a device-side assert names its Python frame.
Prints one line per policy: ``OK`` with the acceptance counts, or the tail of the failure.
Run on the GPU host: ``bash scripts/gpu_host.sh run python3 <this file>``.

Run 41 ran it without ``disable_log_stats=False``: both policies stopped at vLLM's "Stat logging
disabled" assertion before their first request. This copy has the argument; it ran in session 15
(run 42, docs/results/gpu-session15-h200.md §1): neither policy crashed.
"""

import os
import subprocess
import sys

CHILD = r"""
import json, sys
from vllm import LLM
from bc_tools.bench.probe_scenario import run_probes
from bc_tools.fixtures.qwen3_next_family import planted_successor
from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

family, policy = "glm5_next_mtp_planted", sys.argv[1]
model = make_tiny_model(default_model_dir(family, 0), family=family, seed=0)
llm = LLM(model=str(model), dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=33280,
          max_num_seqs=32, gpu_memory_utilization=0.3, enable_prefix_caching=True, seed=0, disable_log_stats=False,
          speculative_config={"method": "mtp", "num_speculative_tokens": 3},
          additional_config={"gdn_prefill_backend": "triton", "boundary_checkpoints": {"policy": policy}})
block = llm.llm_engine.vllm_config.cache_config.block_size
lengths = sorted({1, block - 1, block, block + 1, 8193, 32768, 97, 200, 2103, block - 8})
successor = planted_successor(0).tolist()
acceptance = {}
run_probes(llm, lengths, 32, 16, seed=0, acceptance=acceptance, next_token=lambda a: successor[a[-1]])
print("DIAG OK", policy, json.dumps(acceptance))
"""

# Session 16's repetition (docs/notes/next-gpu-session.md): DIAG_LAUNCH_BLOCKING=0 keeps launches
# asynchronous (as in run 40's crash), DIAG_ROUNDS=R runs the two policies R times, alternating.
ROUNDS = int(os.environ.get("DIAG_ROUNDS", "1"))
ORDER = [(r, policy) for r in range(ROUNDS) for policy in ("aligned", "request_boundaries")[:: 1 if r % 2 == 0 else -1]]
for round_index, policy in ORDER:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING=os.environ.get("DIAG_LAUNCH_BLOCKING", "1"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        result = subprocess.run([sys.executable, "-c", CHILD, policy], env=env, capture_output=True, text=True,
                                timeout=float(os.environ.get("DIAG_TIMEOUT_S", "170")))
    except subprocess.TimeoutExpired:
        print(f"DIAG TIMEOUT {policy} round {round_index}")
        continue
    ok = [line for line in result.stdout.splitlines() if line.startswith("DIAG OK")]
    if ok:
        print(ok[0], "round", round_index)
    else:
        frames = [line for line in result.stderr.splitlines() if "File " in line or "Error" in line or "assert" in line]
        print(f"DIAG FAILED {policy} round {round_index} rc={result.returncode}")
        print("\n".join(frames[-40:]))
    with open(os.path.join(os.environ.get("BC_RESULTS_DIR", "."), f"diag-{policy}-{round_index}.log"), "w") as f:
        f.write(result.stdout[-20000:] + "\n--- stderr ---\n" + result.stderr[-60000:])
