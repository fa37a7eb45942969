"""Run a ``vllm.LLM`` script in a fresh process and read back the one JSON line it prints.

The engine core and worker run inside that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
``vllm.LLM`` does with it), so a script can inspect the instances vLLM built. The script prints
``RESULT <json>``; the plugin's policy environment override is removed so the script's own
``additional_config`` decides.

:func:`engine_fixture` is the engine tests' fixture factory (as ``servers.server_fixture`` is the
server tests'): a module-scoped fixture that runs a probe script once on a model and hands its
probe rows to the module, e.g. ``runs = engine_fixture(SCRIPT, then=calibrated("cpu-engine-probes.json"))``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RESULT_PREFIX = "RESULT "
HELPERS_DIR = str(Path(__file__).resolve().parent)  # a script's argument: it puts tests/helpers/ on sys.path

# The opening of a script that builds a drafter on the CPU (argv[1]: HELPERS_DIR; ``--cpu-shims``
# for a GLM target): the Triton stand-in, vLLM's V2 model runner, and the imports every such
# script uses.
DRAFTER_SCRIPT_OPENING = r"""
import json, math, os, sys, tempfile
sys.path.insert(0, sys.argv[1])  # tests/helpers/: the Triton stand-in
# one process's distributed group, on a file store in a fresh directory: no port another run holds
DIST_INIT = "file://" + os.path.join(tempfile.mkdtemp(prefix="bc-dist-"), "store")
import fake_triton_cpu
fake_triton_cpu.install()
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # after install(), which selects V1
if "--cpu-shims" in sys.argv:  # a GLM target: vLLM inspects Glm5Next on CPU only behind these
    import family_weights
    shims = family_weights.cpu_shims()
    shims.__enter__()  # for the whole process (the reference keeps the context open)
import torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
"""


def run_engine_script(script: str, *argv: str, timeout: float = 900) -> tuple[dict, str]:
    """(the script's RESULT object, its stdout + stderr); fails the test if it did not print one."""
    info, log = try_engine_script(script, *argv, timeout=timeout)
    assert info is not None, log[-6000:]
    return info, log


def try_engine_script(script: str, *argv: str, timeout: float = 900) -> tuple[dict | None, str]:
    """(the script's RESULT object, or None if it exited non-zero or printed none; its stdout + stderr)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
    result = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    info = json.loads(lines[-1][len(RESULT_PREFIX) :]) if result.returncode == 0 and lines else None
    return info, result.stdout + result.stderr


def probe_rows(info: dict, runs: tuple[str, ...] | None = None) -> dict:
    """Each run's probe rows (``bench.probes.ProbeRow``) from a script's RESULT object whose runs
    carry ``"rows"``: ``runs`` names them, or every entry of ``info`` is one."""
    from bc_tools.bench.probes import ProbeRow

    runs = tuple(info) if runs is None else runs
    return {run: [ProbeRow.from_dict(row) for row in info[run]["rows"]] for run in runs}


def run_probe_script(
    script: str, model_dir, *argv: str, runs: tuple[str, ...] | None = None, timeout: float = 900
) -> tuple[dict, dict]:
    """Run a probe script as ``script MODEL_DIR HELPERS_DIR ARGV...`` (the script puts the helpers
    on its ``sys.path`` from its second argument): (its RESULT object, each run's probe rows)."""
    info, _ = run_engine_script(script, str(model_dir), HELPERS_DIR, *argv, timeout=timeout)
    return info, probe_rows(info, runs)


def engine_fixture(
    script: str,
    *argv: str,
    runs: tuple[str, ...] | None = None,
    timeout: float = 900,
    model: Callable[[pytest.TempPathFactory], Path] | None = None,
    then: Callable[[dict, dict], object] | None = None,
    name: str = "runs",
):
    """A module-scoped fixture ``name`` that runs ``script`` once (:func:`run_probe_script`) on the
    tiny model (``tiny_model_dir``), or on the directory ``model(tmp_path_factory)`` builds; its
    value is ``then(info, rows)``, or ``(info, rows)`` without ``then``. Assign it to a module
    attribute (the fixture's name is ``name`` whatever the attribute is called)."""

    @pytest.fixture(scope="module", name=name)
    def _runs(request, tmp_path_factory):
        model_dir = request.getfixturevalue("tiny_model_dir") if model is None else model(tmp_path_factory)
        info, rows = run_probe_script(script, model_dir, *argv, runs=runs, timeout=timeout)
        return (info, rows) if then is None else then(info, rows)

    return _runs


def calibrated(results_name: str) -> Callable[[dict, dict], tuple[dict, dict, object]]:
    """``then`` for :func:`engine_fixture`: bounds calibrated on the run's stock block-grid hits
    and cold-vs-cold pairs (``request_boundaries`` against ``aligned``), saved with the RESULT object
    as ``$BC_RESULTS_DIR/results_name``; the fixture's value is ``(info, rows, bounds)``."""

    def then(info: dict, rows: dict) -> tuple[dict, dict, object]:
        from results_out import save_json

        from bc_tools.bench.probes import calibrate
        from bc_tools.bench.reference_pairs import reference_pairs

        bounds = calibrate(reference_pairs(rows["request_boundaries"], rows["aligned"]))
        save_json(results_name, {"bounds": bounds.as_dict(), **info})
        return info, rows, bounds

    return then
