"""``step_attribution`` of ``benchmarks/step_profile.py`` on a small hand-written chrome trace.

Exact numbers for the nesting rules: a core's direct children only (a child inside a child is not
counted twice, a core inside a core is a child, not a second core), events on another thread not
counted, steps without a core skipped, device windows merged per External id and matched to the
kept host steps; gzipped or not; the ``--attribute`` command line. No engine.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from script_modules import load_script

QWEN, CPU = "vllm::qwen_gdn_attention_core", "vllm::cpu_gdn_attention_core"


@pytest.fixture(scope="module")
def sp():
    return load_script("benchmarks/step_profile.py", "step_profile_under_test")


def op(name, ts, dur, cat="cpu_op", tid=1, pid=1, ext=None):
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if ext is not None:
        event["args"] = {"External id": ext}
    return event


def step(kind, ts, dur, ext):
    return op(f"bc_execute_model[{kind}]", ts, dur, cat="user_annotation", ext=ext)


def device(name, ts, dur, cat="kernel", stream=7, ext=None):
    return op(name, ts, dur, cat=cat, tid=stream, pid=0, ext=ext)


def window(kind, ts, dur, ext, stream=7):
    return device(f"bc_execute_model[{kind}]", ts, dur, cat="gpu_user_annotation", stream=stream, ext=ext)


HOST = [
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
    op("PyTorch Profiler (0)", 0, 10_000, cat="Trace", tid="PyTorch Profiler"),  # a string tid
    step("capture", 0, 1000, ext=10),
    op(QWEN, 100, 300),  # core 1: children A (100, holding B) and C (50); gaps 150
    op("aten::index", 110, 100),  # A
    op("aten::copy_", 120, 50),  # B: inside A, not a direct child
    op("aten::copy_", 250, 50),  # C
    op(QWEN, 500, 200),  # core 2: children D (40) and a nested core (70); gaps 90
    op("aten::index", 520, 40),  # D
    op(CPU, 600, 70),  # a core inside a core: a child, not a third core
    op("aten::mm", 150, 100, tid=2),  # inside core 1's time on another thread: not counted
    op(QWEN, 800, 100, tid=2),  # a core on another thread: not this step's
    {"ph": "s", "cat": "ac2g", "name": "launch", "pid": 1, "tid": 1, "ts": 130, "id": 1},
    step("plain", 2000, 500, ext=11),  # no core: skipped
    step("plain", 3000, 1000, ext=12),
    op(CPU, 3100, 400),
    op("aten::mm", 3200, 100),
    step("plain", 5000, 600, ext=13),
    op(CPU, 5100, 200),
]
DEVICE = [
    window("capture", 1100, 800, ext=10),
    window("capture", 1150, 900, ext=10, stream=8),  # the same step on a second stream: merged
    device("gemm", 1200, 300),
    device("gemm", 1500, 200, stream=8),
    device("Memcpy HtoD", 2000, 10, cat="gpu_memcpy"),  # starts at the merged window's end - 50
    device("gemm", 2100, 30),  # after the window
    window("plain", 2600, 100, ext=11),  # the skipped host step's window
    device("conv", 2610, 50),
    window("plain", 3300, 2000, ext=12),
    device("conv", 3400, 1000),
    window("plain", 5500, 1000, ext=13),
    device("conv", 5600, 200),
    device("Memset", 5700, 4, cat="gpu_memset"),
]


def write(path: Path, events: list[dict]) -> Path:
    text = json.dumps({"traceEvents": events})
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_host_nesting_is_exact(sp, tmp_path):
    a = sp.step_attribution(write(tmp_path / "t.json", HOST))
    assert a["skipped_steps"] == {"capture": 0, "plain": 1}
    capture = a["kinds"]["capture"]
    keys = ("steps", "host_ms", "cores_per_step", "core_ms", "children_ms", "gaps_ms")
    assert {k: capture[k] for k in keys} == {"steps": 1, "host_ms": 1.0, "cores_per_step": 2, "core_ms": 0.5,
                                             "children_ms": 0.26, "gaps_ms": 0.24}  # fmt: skip
    assert capture["children"] == [{"name": "aten::index", "ms": 0.14, "calls": 2},
                                   {"name": CPU, "ms": 0.07, "calls": 1},
                                   {"name": "aten::copy_", "ms": 0.05, "calls": 1}]  # fmt: skip
    assert capture["layer_core_ms"] == [0.3, 0.2]
    plain = a["kinds"]["plain"]
    assert (plain["steps"], plain["host_ms"], plain["core_ms"], plain["gaps_ms"]) == (2, 0.8, 0.3, 0.25)
    assert plain["children"] == [{"name": "aten::mm", "ms": 0.05, "calls": 0.5}]
    assert plain["layer_core_ms"] == [0.4]  # the first plain step with a core
    assert "device" not in capture and "device" not in plain  # a CPU trace


def test_device_windows_match_kept_steps(sp, tmp_path):
    for name in ("t.json", "t.json.gz"):
        kinds = sp.step_attribution(write(tmp_path / name, HOST + DEVICE))["kinds"]
        capture, plain = kinds["capture"]["device"], kinds["plain"]["device"]
        assert capture == {"steps": 1, "matched_by": "External id", "span_ms": 0.95, "busy_ms": 0.51,
                           "top_kernels": [{"name": "gemm", "ms": 0.5, "calls": 2},
                                           {"name": "Memcpy HtoD", "ms": 0.01, "calls": 1}]}  # fmt: skip
        assert (plain["steps"], plain["span_ms"], plain["busy_ms"]) == (2, 1.5, 0.602)  # not the skipped one's
        assert plain["top_kernels"][0] == {"name": "conv", "ms": 0.6, "calls": 1}
    anonymous = [{k: v for k, v in e.items() if k != "args"} if e["cat"] == "gpu_user_annotation" else e
                 for e in DEVICE]  # fmt: skip
    plain = sp.step_attribution(write(tmp_path / "anon.json", HOST + anonymous))["kinds"]["plain"]["device"]
    assert (plain["matched_by"], plain["steps"]) == ("device work", 3)  # no ids: every window with work


def test_absent_steps_and_command_line(sp, tmp_path, capsys):
    only_plain = [e for e in HOST if "capture" not in e.get("name", "")]
    a = sp.step_attribution(write(tmp_path / "plain.json", only_plain))
    assert list(a["kinds"]) == ["plain"] and a["skipped_steps"]["capture"] == 0
    empty = sp.step_attribution(write(tmp_path / "empty.json", [e for e in HOST if e.get("cat") != "user_annotation"]))
    assert empty["kinds"] == {} and sp.attribution_lines(empty)[0].startswith("no step with a recurrent core")
    assert sp.main(["--attribute", str(write(tmp_path / "t.json.gz", HOST + DEVICE))]) == 0
    out = capsys.readouterr().out
    assert "capture x1: host 1.0 ms/step, cores 0.5 ms (2 per step; gaps 0.2 ms)" in out
    assert "GPU span 0.9 ms, busy 0.5 ms" in out and "layer cores ms: 0.30 0.20" in out
