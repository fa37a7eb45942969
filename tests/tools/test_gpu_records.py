"""The GPU tests' judgement replayed on a recorded H200 run, on the CPU: the GLM-5.3-Flash MTP k = 1
run (``docs/results/gpu-glm-mtp-h200/``) passes the checks of ``test_glm5_next_mtp_boundaries``
(exact counts, the calibrated bounds, the negative control, acceptance), and fails the negative
control when the resends' bound keeps the producer pairs, which let corrupted resends through."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from engine_script import probe_rows
from mtp_checks import check_acceptance

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs/results/gpu-glm-mtp-h200/gpu-spec-glm5_next_mtp_planted-k1.json.gz"


def gpu_checks():
    """tests/gpu/test_gpu_spec_families.py as a module (its tests are not collected from here)."""
    spec = importlib.util.spec_from_file_location("gpu_spec_checks", ROOT / "tests/gpu/test_gpu_spec_families.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recorded():
    record = json.loads(gzip.open(RECORD).read())
    info = {run: record[run] for run in ("request_boundaries", "corrupt", "aligned")}
    checks = gpu_checks()
    # The record predates the rule that keeps the plugin's rows longer than a verify row: its
    # prompt checkpoints sat at the pool boundary at or below P - 1, which the SCRIPT now records.
    setup = info["request_boundaries"]["setup"]
    setup["grid_targets"] = {
        str(n): (n - 1) // checks.GLM_KPOOL * checks.GLM_KPOOL for n in record["aligned"]["lengths"]
    }
    return checks, record["k"], info, probe_rows(info)


def test_glm_mtp_record_passes_the_gpu_checks(recorded):
    checks, k, info, rows = recorded
    grid = checks.GLM_KPOOL
    bounds = checks.bounds_for(rows, k, grid)
    continuation = checks.continuation_bounds_for(rows, bounds, k, grid)
    assert bounds.first_token < continuation.first_token  # the resends' bound leaves the producers out
    checks.check_plugin_run(info, rows, bounds, k, continuation, grid=grid)
    checks.check_corrupted_run(info, rows, bounds, speculative=True, grid=grid)
    check_acceptance(info, k)


def test_glm_mtp_record_with_producer_pairs_lets_corrupted_resends_through(recorded):
    checks, k, info, rows = recorded
    loose = checks.bounds_for(rows, k)  # the producers' pairs in the resends' bound
    with pytest.raises(AssertionError, match="passed the bound"):
        checks.check_corrupted_run(info, rows, loose, speculative=True, grid=checks.GLM_KPOOL)
