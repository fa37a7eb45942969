"""The GPU tests' judgement replayed on recorded H200 runs, on the CPU.

* Both GLM-5.3-Flash MTP k = 1 runs (``docs/results/gpu-glm-mtp-h200/``, before and with the row
  rule of contract 13) pass the checks of ``test_glm5_next_mtp_boundaries`` (exact counts, the
  resends' bounds calibrated per prompt length, the negative control, acceptance), and fail the
  negative control when the resends' bound keeps the producer pairs, which let corrupted resends
  through.
* The GLM-5.3-Flash DFlash2 k = 3 run (``docs/results/gpu-glm-dflash-h200/``) passes the checks of
  ``test_glm5_next_dflash2_on_the_pool_grid``, and fails the negative control under one bound for
  every prompt length: the 32768-token prompts' references set it above most short prompts'
  corrupted resends.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from engine_script import probe_rows
from mtp_checks import check_acceptance

from bc_tools.bench.probes import LengthBounds, calibrate, reference_pairs

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs/results/gpu-glm-mtp-h200"
# The run before the row rule, and the run with it (which records each prompt checkpoint).
RUNS = ("gpu-spec-glm5_next_mtp_planted-k1.json.gz", "row-rule-gpu-spec-glm5_next_mtp_planted-k1.json.gz")
DFLASH_RECORD = ROOT / "docs/results/gpu-glm-dflash-h200/gpu-dflash-glm-dflash2.json.gz"


def gpu_checks():
    """tests/gpu/test_gpu_spec_families.py as a module (its tests are not collected from here)."""
    spec = importlib.util.spec_from_file_location("gpu_spec_checks", ROOT / "tests/gpu/test_gpu_spec_families.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(path: Path) -> tuple[int, dict]:
    """(the record's ``k``, its three runs as the SCRIPT's RESULT object)."""
    record = json.loads(gzip.open(path).read())
    return record["k"], {run: record[run] for run in ("request_boundaries", "corrupt", "aligned")}


@pytest.fixture(scope="module", params=RUNS)
def recorded(request):
    k, info = load(RECORDS / request.param)
    checks = gpu_checks()
    # The first record predates the row rule: its prompt checkpoints sat at the pool boundary at or
    # below P - 1, which the SCRIPT now records.
    setup = info["request_boundaries"]["setup"]
    setup.setdefault(
        "grid_targets", {str(n): (n - 1) // checks.GLM_KPOOL * checks.GLM_KPOOL for n in info["aligned"]["lengths"]}
    )
    return checks, k, info, probe_rows(info)


@pytest.fixture(scope="module")
def dflash():
    k, info = load(DFLASH_RECORD)
    assert "grid_targets" in info["request_boundaries"]["setup"]  # recorded with the row rule
    return gpu_checks(), k, info, probe_rows(info)


def test_glm_mtp_record_passes_the_gpu_checks(recorded):
    checks, k, info, rows = recorded
    grid = checks.GLM_KPOOL
    bounds = checks.bounds_for(rows, k, grid)
    assert isinstance(bounds, LengthBounds)
    continuation = checks.continuation_bounds_for(rows, bounds, k, grid)
    # the resends' bounds leave the producers out: below the continuations' at every length
    assert max(b.first_token for b in bounds.by_length.values()) < continuation.first_token
    checks.check_plugin_run(info, rows, bounds, k, continuation, grid=grid)
    checks.check_corrupted_run(info, rows, bounds, speculative=True, grid=grid)
    check_acceptance(info, k)


def test_glm_mtp_record_with_producer_pairs_lets_corrupted_resends_through(recorded):
    checks, k, info, rows = recorded
    loose = checks.bounds_for(rows, k)  # the producers' pairs in the resends' bound
    with pytest.raises(AssertionError, match="passed the bound"):
        checks.check_corrupted_run(info, rows, loose, speculative=True, grid=checks.GLM_KPOOL)


def test_glm_dflash2_record_passes_the_gpu_checks(dflash):
    checks, k, info, rows = dflash
    grid = checks.GLM_KPOOL
    bounds = checks.bounds_for(rows, k, grid)
    assert isinstance(bounds, LengthBounds)
    assert bounds.at(200).first_token < bounds.at(32768).first_token  # the long prompt's rounding stays its own
    continuation = checks.continuation_bounds_for(rows, bounds, k, grid)
    checks.check_plugin_run(info, rows, bounds, k, continuation, grid=grid)
    checks.check_corrupted_run(info, rows, bounds, speculative=True, grid=grid)
    check_acceptance(info, k)


def test_glm_dflash2_record_with_one_bound_lets_corrupted_resends_through(dflash):
    checks, k, info, rows = dflash
    # The resends' references of every length in one bound, as calibrated before per-length bounds.
    pairs = reference_pairs(rows["request_boundaries"], rows["aligned"])
    single = calibrate(pairs, margin=checks.MARGIN, reference_floor=checks.SPEC_ROW_REFERENCE)
    with pytest.raises(AssertionError, match="passed the bound"):
        checks.check_corrupted_run(info, rows, single, speculative=True, grid=checks.GLM_KPOOL)
