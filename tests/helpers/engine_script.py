"""Run a ``vllm.LLM`` script in a fresh process and read back the one JSON line it prints.

The engine core and worker run inside that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
``vllm.LLM`` does with it), so a script can inspect the instances vLLM built. The script prints
``RESULT <json>``; the plugin's policy environment override is removed so the script's own
``additional_config`` decides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RESULT_PREFIX = "RESULT "
HELPERS_DIR = str(Path(__file__).resolve().parent)  # a script's argument: it puts tests/helpers/ on sys.path


def run_engine_script(script: str, *argv: str, timeout: float = 900) -> tuple[dict, str]:
    """(the script's RESULT object, its stdout + stderr); fails the test if it did not print one."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
    result = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]), result.stdout + result.stderr


def probe_rows(info: dict, runs: tuple[str, ...] | None = None) -> dict:
    """Each run's probe rows (``bench.probes.ProbeRow``) from a script's RESULT object whose runs
    carry ``"rows"``: ``runs`` names them, or every entry of ``info`` is one."""
    from bc_tools.bench.probes import ProbeRow

    runs = tuple(info) if runs is None else runs
    return {run: [ProbeRow.from_dict(row) for row in info[run]["rows"]] for run in runs}
