"""The GPU tests' judgement replayed on recorded H200 runs, on the CPU: both GLM-5.3-Flash MTP k = 1
runs (``docs/results/gpu-glm-mtp-h200/``, before and with the row rule of contract 13) pass the
checks of ``test_glm5_next_mtp_boundaries`` (exact counts, the calibrated bounds, the negative
control, acceptance), and fail the negative control when the resends' bound keeps the producer
pairs, which let corrupted resends through."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from engine_script import probe_rows
from mtp_checks import check_acceptance

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs/results/gpu-glm-mtp-h200"
# The run before the row rule, and the run with it (which records each prompt checkpoint).
RUNS = ("gpu-spec-glm5_next_mtp_planted-k1.json.gz", "row-rule-gpu-spec-glm5_next_mtp_planted-k1.json.gz")


def gpu_checks():
    """tests/gpu/test_gpu_spec_families.py as a module (its tests are not collected from here)."""
    spec = importlib.util.spec_from_file_location("gpu_spec_checks", ROOT / "tests/gpu/test_gpu_spec_families.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=RUNS)
def recorded(request):
    record = json.loads(gzip.open(RECORDS / request.param).read())
    info = {run: record[run] for run in ("request_boundaries", "corrupt", "aligned")}
    checks = gpu_checks()
    # The first record predates the row rule: its prompt checkpoints sat at the pool boundary at or
    # below P - 1, which the SCRIPT now records.
    setup = info["request_boundaries"]["setup"]
    setup.setdefault(
        "grid_targets", {str(n): (n - 1) // checks.GLM_KPOOL * checks.GLM_KPOOL for n in record["aligned"]["lengths"]}
    )
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
