"""The GPU tests' judgement replayed on recorded H200 runs, on the CPU.

* Both GLM-5.3-Flash MTP k = 1 runs (``docs/results/gpu-glm-mtp-h200/``, before and with the row
  rule of contract 13) pass the checks of ``test_glm5_next_mtp_boundaries`` (exact counts, the
  resends' bounds calibrated per prompt length, the negative control, acceptance), and fail the
  negative control when the resends' bound keeps the producer pairs, which let corrupted resends
  through.
* Both GLM-5.3-Flash DFlash2 k = 3 runs (``docs/results/gpu-glm-dflash-h200/``) pass the checks of
  ``test_glm5_next_dflash2_on_the_pool_grid``, and fail the negative control under one bound for
  every prompt length: the 32768-token prompts' references set it above most short prompts'
  corrupted resends.
* GLM-5.3-Flash under MTP k = 2 (``gpu-spec-glm5_next_mtp_planted-k2.json.gz``) passes them too,
  and fails the negative control under per-length bounds with ``MARGIN`` in place of one
  ``LOGIT_STEP`` above the references: two corrupted resends of 32768 tokens pass. So does its run
  under the bounds as they stand (``gpu-prompt-end-keyed-h200/bounds-*``), with the two MTP runs
  of ``prompt_capture: end`` there.
* Both Nemotron-H MTP runs (``docs/results/gpu-nemotron-mtp-h200/``, k = 1 and 3) pass the checks
  of ``test_nemotron_h_mtp_boundaries``, one bound for every length included.
* Both earlier runs of ``prompt_capture: end`` under MTP (``docs/results/gpu-spec-prompt-end-h200/``,
  k = 1 and 3) pass the exactness checks of ``test_prompt_checkpoint_at_p_under_mtp_on_the_gpu``;
  their negative control, copies held back one step, restored the exact state there (no restore
  further from its cold control than the reference pairs), which is why that control was replaced.
* Every run of the test as it stands (``judge``): under MTP k = 1 and 3 and on Kimi-Linear,
  Nemotron-H and GLM-5.3-Flash on an H200 (``docs/results/gpu-prompt-end-keyed-h200/``), and on
  the three families on an H100 (``docs/results/gpu-prompt-end-families-h100/``). Under one bound
  for every prompt length the k = 1 run's control lets a corrupted restore through (P = 130); under
  the MTP test's reference floor, Nemotron-H's corrupted restores pass the bound.
* The unit path's allowance (``lowered_hits``): a vLLM hit the plugin lowered to a block boundary
  passes only as often as the plugin counted one, on the k = 2 record with one resend made so.
* GLM-5.3-Flash under MTP k = 1, 2 and 3 at the unit the plugin sets (``docs/results/gpu-glm-mtp-unit-h100/``,
  and k = 3 under ``auto``, ``docs/results/gpu-glm-auto-h100/``) pass the checks of
  ``test_glm5_next_mtp_boundaries``; the corrupted run's rows as the plugin's, and a run that kept
  no bundle, fail them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import spec_families
import spec_prompt_end
from engine_script import probe_rows
from mtp_checks import check_acceptance
from script_modules import load_script

from bc_tools.bench.probes import (
    LengthBounds,
    calibrate,
    calibrate_by_length,
    first_token_deviation,
)
from bc_tools.bench.reference_pairs import pairs_by_length, reference_pairs
from bc_tools.fixtures.glm5_next_family import GLM_KPOOL

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs/results/gpu-glm-mtp-h200"
# The run before the row rule, and the run with it (which records each prompt checkpoint).
RUNS = ("gpu-spec-glm5_next_mtp_planted-k1.json.gz", "row-rule-gpu-spec-glm5_next_mtp_planted-k1.json.gz")
GLM_MTP_K2 = "gpu-spec-glm5_next_mtp_planted-k2.json.gz"
# The same test's run with the bounds one logit step above each length's references (``bounds``).
LIVE_GLM_MTP_K2 = "../gpu-prompt-end-keyed-h200/bounds-gpu-spec-glm5_next_mtp_planted-k2.json.gz"
# The run that set per-length bounds, and the run that passed the test as it now stands.
DFLASH_RECORDS = ("gpu-dflash-glm-dflash2.json.gz", "gpu-dflash-glm-dflash2-1de37f0.json.gz")


SPEC_END_RECORDS = ROOT / "docs/results/gpu-spec-prompt-end-h200"
FAMILY_END_RECORDS = ROOT / "docs/results/gpu-prompt-end-families-h100"
KEYED_END_RECORDS = ROOT / "docs/results/gpu-prompt-end-keyed-h200"
DRAFTER_END_RECORDS = ROOT / "docs/results/gpu-spec-prompt-end-drafters-h100"


def gpu_module(name: str):
    """``tests/gpu/{name}.py`` as a module (its tests are not collected from here)."""
    return load_script(f"tests/gpu/{name}.py", f"records_{name}")


def gpu_checks():
    """The GPU family tests' checks and constants (``tests/helpers/spec_families.py``)."""
    return spec_families


def load(path: Path) -> tuple[int, dict]:
    """(the record's ``k``, its three runs as the SCRIPT's RESULT object)."""
    record = json.loads(gzip.open(path).read())
    return record["k"], {run: record[run] for run in ("request_boundaries", "corrupt", "aligned")}


@pytest.fixture(scope="module", params=(*RUNS, GLM_MTP_K2, LIVE_GLM_MTP_K2))
def recorded(request):
    k, info = load(RECORDS / request.param)
    checks = gpu_checks()
    # The first record predates the row rule: its prompt checkpoints sat at the pool boundary at or
    # below P - 1, which the SCRIPT now records.
    setup = info["request_boundaries"]["setup"]
    setup.setdefault("grid_targets", {str(n): (n - 1) // GLM_KPOOL * GLM_KPOOL for n in info["aligned"]["lengths"]})
    return checks, k, info, probe_rows(info)


@pytest.fixture(scope="module", params=DFLASH_RECORDS)
def dflash(request):
    k, info = load(ROOT / "docs/results/gpu-glm-dflash-h200" / request.param)
    assert "grid_targets" in info["request_boundaries"]["setup"]  # recorded with the row rule
    return gpu_checks(), k, info, probe_rows(info)


def test_glm_mtp_record_passes_the_gpu_checks(recorded):
    checks, k, info, rows = recorded
    grid = GLM_KPOOL
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
        checks.check_corrupted_run(info, rows, loose, speculative=True, grid=GLM_KPOOL)


def test_glm_dflash2_record_passes_the_gpu_checks(dflash):
    checks, k, info, rows = dflash
    grid = GLM_KPOOL
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
        checks.check_corrupted_run(info, rows, single, speculative=True, grid=GLM_KPOOL)


@pytest.mark.parametrize("k", [1, 3])
def test_nemotron_mtp_records_pass_the_gpu_checks(k):
    """Off the pool grid one bound serves every length (``bounds_for``); every corrupted resend a
    reference pair tells apart still fails it."""
    k, info = load(ROOT / f"docs/results/gpu-nemotron-mtp-h200/gpu-spec-nemotron_h_mtp_planted-k{k}.json.gz")
    checks, rows = gpu_checks(), probe_rows(info)
    bounds = checks.bounds_for(rows, k)
    checks.check_plugin_run(info, rows, bounds, k)
    checks.check_corrupted_run(info, rows, bounds, speculative=True)
    check_acceptance(info, k)


def test_glm_mtp_k2_record_with_a_margin_lets_corrupted_resends_through():
    k, info = load(RECORDS / GLM_MTP_K2)
    checks, rows = gpu_checks(), probe_rows(info)
    with_margin = calibrate_by_length(
        pairs_by_length(rows["request_boundaries"], rows["aligned"]),
        margin=checks.MARGIN,
        reference_floor=checks.SPEC_ROW_REFERENCE,
    )
    with pytest.raises(AssertionError, match=r"passed the bound: P = \[32768, 32768\]"):
        checks.check_corrupted_run(info, rows, with_margin, speculative=True, grid=GLM_KPOOL)


@pytest.mark.parametrize("k", [1, 3])
def test_spec_prompt_end_first_records_pass_the_exactness_checks(k):
    checks = gpu_checks()
    lengths = gpu_module("test_gpu_spec_prompt_end").LENGTHS
    record = json.loads(gzip.open(SPEC_END_RECORDS / f"gpu-spec-prompt-end-k{k}.json.gz").read())
    record.pop("bounds")  # calibrated again from the record's own pairs
    info, phases, bounds = spec_prompt_end.end_result(
        record, lengths, reference_floor=checks.SPEC_ROW_REFERENCE, margin=checks.MARGIN
    )
    spec_prompt_end.check_end_run(info, phases, bounds.one_step_above(checks.LOGIT_STEP), lengths)
    # The control of that run held the copies back one step: each restored the state at P exactly.
    held = {name: spec_prompt_end.answers(phase) for name, phase in info["corrupt"].items()}
    runs = zip(lengths, held["extended"], held["cold"], strict=True)
    beyond = [p for p, run, cold in runs if first_token_deviation(run, cold) > bounds.at(p).reference_first_token]
    assert [run.cached for run in held["extended"]] == list(lengths)
    assert beyond == [], (beyond, bounds)


def end_record(directory: Path, name: str) -> dict:
    record = json.loads(gzip.open(directory / f"{name}.json.gz").read())
    record.pop("bounds", None)  # calibrated again from the record's own pairs
    return record


# (directory, record, k, the GPU test's lengths attribute, more lengths)
END_RUNS = [
    (KEYED_END_RECORDS, "gpu-spec-prompt-end-k1", 1, "LENGTHS", ()),
    (KEYED_END_RECORDS, "gpu-spec-prompt-end-k3", 3, "LENGTHS", ()),
    (KEYED_END_RECORDS, "bounds-gpu-spec-prompt-end-k1", 1, "LENGTHS", ()),  # the judgement live (stage bounds)
    (KEYED_END_RECORDS, "bounds-gpu-spec-prompt-end-k3", 3, "LENGTHS", ()),
    (KEYED_END_RECORDS, "gpu-prompt-end-kimi_linear", 0, "FAMILY_LENGTHS", ()),
    (KEYED_END_RECORDS, "gpu-prompt-end-nemotron_h", 0, "FAMILY_LENGTHS", ()),
    (KEYED_END_RECORDS, "gpu-prompt-end-glm5_next", 0, "FAMILY_LENGTHS", (2103,)),
    (FAMILY_END_RECORDS, "gpu-prompt-end-kimi_linear", 0, "FAMILY_LENGTHS", ()),
    (FAMILY_END_RECORDS, "gpu-prompt-end-nemotron_h", 0, "FAMILY_LENGTHS", ()),
    (FAMILY_END_RECORDS, "gpu-prompt-end-glm5_next", 0, "FAMILY_LENGTHS", ()),
]


@pytest.mark.parametrize(("directory", "name", "k", "lengths", "more"), END_RUNS)
def test_prompt_end_records_pass_the_gpu_test(directory, name, k, lengths, more):
    module = gpu_module("test_gpu_spec_prompt_end")
    module.judge(end_record(directory, name), k, getattr(module, lengths) + more)


# (record, k, the GPU test's lengths attribute, the next-token guard): the drafters' run on an H100
DRAFTER_END_RUNS = [
    ("gpu-spec-prompt-end-nemotron-k1", 1, "FAMILY_LENGTHS", True),
    ("gpu-spec-prompt-end-dflash", 3, "LENGTHS", False),
    ("gpu-spec-prompt-end-dflash2", 3, "LENGTHS", False),
]


@pytest.mark.parametrize(("name", "k", "lengths", "guard"), DRAFTER_END_RUNS)
def test_drafter_prompt_end_records_pass_the_gpu_test(name, k, lengths, guard):
    module = gpu_module("test_gpu_spec_prompt_end")
    module.judge(end_record(DRAFTER_END_RECORDS, name), k, getattr(module, lengths), guard=guard)


def test_nemotron_mtp_k3_prompt_end_record_cannot_tell_a_corrupted_restore():
    """Nemotron-H under MTP k = 3: exact counts and bounds pass, but with the k + 2 tokens after P
    that keep the restored row a prefill row, the fixture forgets a one-token-off state: no
    corrupted restore deviates from its cold control beyond a reference pair, so the run proves
    nothing about the state and ``auto`` keeps the P - 1 stop there."""
    checks = gpu_checks()
    module = gpu_module("test_gpu_spec_prompt_end")
    info = end_record(DRAFTER_END_RECORDS, "gpu-spec-prompt-end-nemotron-k3")
    lengths = module.FAMILY_LENGTHS
    floor, margin = checks.SPEC_ROW_REFERENCE, checks.MARGIN
    _, phases, bounds = spec_prompt_end.end_result(info, lengths, reference_floor=floor, margin=margin)
    bounds = bounds.one_step_above(checks.LOGIT_STEP)
    spec_prompt_end.check_end_run(info, phases, bounds, lengths, next_token_guard=True)
    assert spec_prompt_end.tellable_prompts(info, bounds, lengths, checks.LOGIT_STEP) == []
    with pytest.raises(AssertionError):
        module.judge(end_record(DRAFTER_END_RECORDS, "gpu-spec-prompt-end-nemotron-k3"), 3, lengths)


def test_prompt_end_k1_record_under_one_bound_lets_a_corrupted_restore_through():
    """The judgement the run met on the GPU: one bound for every length, ``MARGIN`` above the
    largest reference (a split cold run of 23 tokens, 0.234)."""
    checks = gpu_checks()
    lengths = gpu_module("test_gpu_spec_prompt_end").LENGTHS
    info = end_record(KEYED_END_RECORDS, "gpu-spec-prompt-end-k1")
    phases = {name: spec_prompt_end.answers(phase) for name, phase in info["plugin"].items()}
    pairs = [*zip(phases["cold_again"], phases["cold"]), *zip(phases["split_cold"], phases["cold"])]
    pairs += zip(phases["resend"], phases["producer"])
    single = calibrate(pairs, margin=checks.MARGIN, reference_floor=checks.SPEC_ROW_REFERENCE)
    one_for_all = LengthBounds(dict.fromkeys(lengths, single))
    caught, corrupted = spec_prompt_end.check_corrupted_prompts(info, one_for_all, lengths)
    assert set(corrupted) - set(caught) == {130}, (caught, corrupted)
    assert 130 in spec_prompt_end.tellable_prompts(info, one_for_all, lengths, checks.LOGIT_STEP)


def test_family_prompt_end_record_under_the_mtp_floor_lets_corrupted_restores_through():
    checks = gpu_checks()
    lengths = gpu_module("test_gpu_spec_prompt_end").FAMILY_LENGTHS
    info = end_record(FAMILY_END_RECORDS, "gpu-prompt-end-nemotron_h")
    _, _, bounds = spec_prompt_end.end_result(info, lengths, reference_floor=checks.SPEC_ROW_REFERENCE)
    bounds = bounds.one_step_above(checks.LOGIT_STEP)
    caught, corrupted = spec_prompt_end.check_corrupted_prompts(info, bounds, lengths)
    assert set(caught) < set(corrupted), (caught, corrupted, bounds)


def test_a_vllm_hit_lowered_to_the_block_grid_is_accepted_only_as_often_as_the_plugin_counted():
    """``lowered_hits`` (the unit path of ``test_glm5_next_mtp_boundaries``) on the k = 2 record with
    one resend made a lowered hit: stock restored vLLM's state at 2,096 tokens (inside a 256-token
    block), the plugin the block boundary at 1,792. Accepted with ``vllm_hits_lowered`` = 1; the
    negative control, the same rows with the counter at 0, fails; a count below stock's off the
    block grid (another conversation of that length) is never taken for a lowered hit."""
    k, info = load(RECORDS / LIVE_GLM_MTP_K2)
    checks, rows = gpu_checks(), probe_rows(info)
    index = next(i for i, row in enumerate(rows["aligned"]) if row.prompt_len == 2103)
    rows["aligned"][index].resend.cached = 2096
    rows["request_boundaries"][index].resend.cached = 1792
    # another conversation of the same length below stock's, off the block grid: never a lowered hit
    other = next(i for i, row in enumerate(rows["aligned"]) if row.prompt_len == 2103 and i != index)
    rows["aligned"][other].resend.cached = 2096
    rows["request_boundaries"][other].resend.cached = 2080
    stats = info["request_boundaries"]["setup"]["boundary_stats"]
    stats["vllm_hits_lowered"] = 1
    assert checks.lowered_hits(info, rows) == {(index, "resend"): 1792}  # that row only, not its length
    stats["vllm_hits_lowered"] = 0
    with pytest.raises(AssertionError):
        checks.lowered_hits(info, rows)


UNIT_RECORDS = [
    *(f"gpu-glm-mtp-unit-h100/gpu-spec-glm5_next_mtp_planted-k{k}-vllm_unit.json.gz" for k in (1, 2, 3)),
    "gpu-glm-auto-h100/gpu-spec-glm5_next_mtp_planted-k3-auto.json.gz",  # the plugin under ``auto``
]


@pytest.fixture(params=UNIT_RECORDS)
def unit_record(request):
    k, info = load(ROOT / "docs/results" / request.param)
    return gpu_checks(), k, info, probe_rows(info)


def test_glm_mtp_unit_records_pass_the_gpu_checks(unit_record):
    """GLM-5.3-Flash under MTP k = 1, 2 and 3 at the prefix match unit the plugin set (16 tokens), on
    an H100 (k = 3 also with the plugin at its defaults): no prompt checkpoint and no capture copy
    of the plugin's (its bundles keep their responses' own blocks), and every check of
    ``test_glm5_next_mtp_boundaries`` passes."""
    checks, k, info, rows = unit_record
    setup = info["request_boundaries"]["setup"]
    assert setup["prefix_match_unit"] == 16 and setup["copies"][0] == 0 and setup["copies"][1] > 0
    assert checks.vllm_keeps_prompts(info)
    grid = GLM_KPOOL
    bounds = checks.bounds_for(rows, k, grid)
    checks.check_plugin_run(info, rows, bounds, k, checks.continuation_bounds_for(rows, bounds, k, grid), grid=grid)
    checks.check_corrupted_run(info, rows, bounds, speculative=True, grid=grid)
    check_acceptance(info, k)


def test_glm_mtp_unit_record_fails_the_checks_with_corrupted_restores_or_no_bundle(unit_record):
    """Negative controls on the same records: the corrupted run's rows (response bundles keyed one
    token short) as the plugin's fail the counts, and a run that kept no bundle fails."""
    checks, k, info, rows = unit_record
    grid = GLM_KPOOL
    bounds = checks.bounds_for(rows, k, grid)
    continuation = checks.continuation_bounds_for(rows, bounds, k, grid)
    corrupted = {**rows, "request_boundaries": rows["corrupt"]}
    with pytest.raises(AssertionError):
        checks.check_plugin_run(info, corrupted, bounds, k, continuation, grid=grid)
    info["request_boundaries"]["setup"]["boundary_stats"]["published"] = 0
    with pytest.raises(AssertionError):
        checks.check_plugin_run(info, rows, bounds, k, continuation, grid=grid)
