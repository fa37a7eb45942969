"""``benchmarks/step_profile.py`` end to end on the CPU engine with the tiny Qwen3-Next.

One run of the script (three engines one after the other in a fresh process: ``aligned``,
``in_step``, ``stop``; 300-token prompts at batch 1 and 2, two rounds, ``--torch-profile``) and
checks of what it wrote: every configuration, batch and mode measured the planned number of times
with positive times and nothing cached; the step counts vLLM takes (at P = 300 and block 256 stock
runs the block-aligned chunk of 256 tokens, then 44; the ``P - 1`` stop one more step; the in-step
split none); the steps that carry in-step capture pairs found in ``in_step`` calls only, with the
plugin's decision to match; the profile's tables and rows naming ops, and its traces written; the
step attribution of each trace (capture steps with recurrent cores in ``in_step`` only, times that
add up), printed in the report and by ``--attribute``.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_profile.py"
CONFIGS = ("aligned", "in_step", "stop")
BATCHES = (1, 2)
REPEAT = 2
MODES = ("async", "synced")
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory) -> tuple[dict, str, Path]:
    """(the JSON, the printed output, the profile directory) of one run of the script."""
    tmp = tmp_path_factory.mktemp("step_profile")
    out, profile_dir = tmp / "profile.json", tmp / "profile"
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--configs", ",".join(CONFIGS),
           "--batch", ",".join(map(str, BATCHES)), "--repeat", str(REPEAT), "--prompt-len", "300",
           "--warmup", "0", "--profile-batch", "1", "--out", str(out), "--torch-profile", str(profile_dir)]  # fmt: skip
    env = dict(os.environ)
    env.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text()), done.stdout, profile_dir


def calls(data: dict, config: str, batch: int) -> list[dict]:
    return [c for c in data["configs"][config]["calls"] if c["batch"] == batch]


def model_steps(call: dict) -> list[dict]:
    return [s for s in call["steps"] if s["tokens"] > 0]


def test_every_configuration_batch_and_mode_is_measured(run):
    data, stdout, _ = run
    assert list(data["configs"]) == list(CONFIGS)
    assert data["meta"]["machine"]["vllm"] and "--torch-profile" in data["meta"]["command"]
    for config in CONFIGS:
        assert set(data["summary"][config]) == {str(b) for b in BATCHES}
        for batch in BATCHES:
            measured = calls(data, config, batch)
            assert sorted((c["rep"], c["mode"]) for c in measured) == sorted(
                (rep, mode) for rep in range(REPEAT) for mode in MODES
            )
            for call in measured:
                assert call["generate_s"] > 0 and call["cached_tokens"] == 0 and call["output_tokens"] == batch
                assert sum(s["tokens"] for s in call["steps"]) == batch * 300
                assert all(s["execute_s"] > 0 and s["schedule_s"] > 0 for s in model_steps(call))
            summary = data["summary"][config][str(batch)]
            assert summary["generate_ms_async"]["median"] > 0 and summary["generate_ms_synced"]["n"] == REPEAT
    for batch in BATCHES:
        assert f"batch {batch} (median [p25..p75]" in stdout
    assert all(line in stdout for line in (f"{config}: batch 2: capture steps" for config in CONFIGS))


def test_step_counts_match_what_vllm_schedules(run):
    data, _, _ = run
    for batch in BATCHES:
        steps = {config: {len(model_steps(c)) for c in calls(data, config, batch)} for config in CONFIGS}
        assert len(steps["aligned"]) == 1, steps  # the same chunking every call
        assert steps["in_step"] == steps["aligned"], steps  # the split adds no step
        assert steps["stop"] == {n + 1 for n in steps["aligned"]}, steps  # the stop at P - 1 adds one
    first = calls(data, "aligned", 1)[0]
    assert [s["tokens"] for s in model_steps(first)] == [256, 44]  # vLLM's block-aligned chunk (block 256)


def test_capture_steps_are_detected_in_in_step_calls_only(run):
    data, _, _ = run
    assert data["configs"]["in_step"]["engine"]["prompt_capture"]["mode"] == "in_step"
    assert data["configs"]["stop"]["engine"]["prompt_capture"]["mode"] == "stop"
    for batch in BATCHES:
        for call in calls(data, "in_step", batch):
            capture = [s for s in model_steps(call) if s["carries_captures"]]
            assert len(capture) == 1 and capture[0]["in_step_pairs"] > 0, call["steps"]
        for config in ("aligned", "stop"):
            assert not any(s["carries_captures"] for c in calls(data, config, batch) for s in c["steps"])
        assert data["summary"]["in_step"][str(batch)]["capture_steps"]["ms"]["median"] > 0
        assert data["summary"]["aligned"][str(batch)]["capture_steps"]["ms"]["n"] == 0
    stop_copies = [s["capture_copies"] for c in calls(data, "stop", 1) for s in c["steps"]]
    assert sum(stop_copies) > 0  # the stop copies the state after P - 1 in the next step


def test_profile_tables_and_traces_name_ops(run):
    data, _, profile_dir = run
    tables = (profile_dir / "profile-tables.txt").read_text()
    for config in CONFIGS:
        profile = data["configs"][config]["profile"]
        assert "error" not in profile and profile["batch"] == 1 and profile["steps"] >= 2
        assert f"== {config}: top 30 by self_cpu ==" in tables
        names = [row["name"] for row in profile["top"]["self_cpu"]]
        assert any(name.startswith("aten::") for name in names), names
        assert profile["sync_counts"]["aten::item"] > 0  # host reads of CPU tensors count too
        trace = json.loads(gzip.decompress(Path(profile["trace"]).read_bytes()))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "bc_schedule" in names and ("bc_execute_model[capture]" in names) == (config == "in_step"), config
    # The model's matmuls: vLLM's CPU linear layers run oneDNN's (``_C::onednn_mm``) on some CPUs
    # (e.g. AMD EPYC), aten's on others and the AMX-packed ``_C::weight_packed_linear`` on Xeons
    # with AMX tiles.
    matmuls = ("aten::mm", "aten::addmm", "_C::onednn_mm", "_C::weight_packed_linear")
    assert any(op in tables for op in matmuls), tables[:2000]


def test_step_attribution_of_each_trace(run):
    data, stdout, _ = run
    for config in CONFIGS:
        attribution = data["configs"][config]["profile"]["attribution"]
        assert "error" not in attribution, attribution
        kinds = attribution["kinds"]
        assert ("capture" in kinds) == (config == "in_step") and "plain" in kinds, (config, attribution)
        for kind, a in kinds.items():
            assert a["steps"] >= 1 and a["cores_per_step"] >= 1 and len(a["layer_core_ms"]) >= 1, (config, kind)
            assert 0 < a["core_ms"] <= a["host_ms"], (config, kind, a)
            assert a["children_ms"] + a["gaps_ms"] == pytest.approx(a["core_ms"], abs=0.01), (config, kind, a)
            assert 0 <= a["gaps_ms"] and sum(c["ms"] for c in a["children"]) <= a["children_ms"] + 0.01
            assert "device" not in a  # a CPU trace has no device events
            assert f"steps: {kind} x{a['steps']}: host {a['host_ms']:.1f} ms/step" in stdout
    capture = data["configs"]["in_step"]["profile"]["attribution"]["kinds"]["capture"]
    trace = data["configs"]["in_step"]["profile"]["trace"]
    done = subprocess.run([sys.executable, str(SCRIPT), "--attribute", trace], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"capture x{capture['steps']}: host {capture['host_ms']:.1f} ms/step" in done.stdout
    assert "layer cores ms: " in done.stdout
