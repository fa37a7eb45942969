"""Where ``scripts/install.sh`` takes torch 2.13.0+cpu from: a local find-links folder that holds its
wheel, else PyTorch's CPU index. ``--print-plan`` prints the choice and the uv arguments and
installs nothing; pip's own configuration is switched off so only the fake folder counts."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install.sh"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
PY_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def plan(find_links: str, tmp_path: Path) -> tuple[dict[str, str], str]:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PIP_CONFIG_FILE": os.devnull,  # no pip.conf: the script falls back to PIP_FIND_LINKS
        "PIP_FIND_LINKS": find_links,
        "BC_VENV": str(tmp_path / "venv"),  # never the project's venv, and never created
        "BC_UV_TOOL_VENV": str(tmp_path / "uv-tool"),
    }
    env.pop("BC_TORCH_INDEX", None)
    result = subprocess.run(["bash", str(SCRIPT), "--print-plan"], env=env, capture_output=True, text=True,
                            timeout=30, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "venv").exists() and not (tmp_path / "uv-tool").exists()
    fields = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return fields, result.stderr


def source_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[install] torch 2.13.0+cpu from ")]


def test_local_folder_with_the_torch_wheel_is_used_alone(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / f"torch-2.13.0+cpu-{PY_TAG}-{PY_TAG}-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not a real wheel")
    fields, stderr = plan(str(wheels), tmp_path)
    assert fields["torch_source"] == "local"
    assert shlex.split(fields["uv_args"]) == ["--find-links", str(wheels)]
    assert source_lines(stderr) == [f"[install] torch 2.13.0+cpu from the local wheel folder: {wheel}"]


OTHER_WHEELS = ["torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",  # another torch
                "torch-2.13.0+cpu-cp30-cp30-manylinux_2_28_x86_64.whl"]  # another Python  # fmt: skip


@pytest.mark.parametrize("names", [[], OTHER_WHEELS], ids=["empty", "other-wheels"])
def test_local_folder_without_the_torch_wheel_falls_back_to_pytorch_cpu_index(names, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in names:
        (wheels / name).write_bytes(b"")
    fields, stderr = plan(str(wheels), tmp_path)
    assert fields["torch_source"] == "index"
    assert shlex.split(fields["uv_args"]) == [
        "--find-links", str(wheels),
        "--extra-index-url", TORCH_INDEX,
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip
    [line] = source_lines(stderr)
    assert f"from PyTorch's CPU index {TORCH_INDEX}" in line


def test_missing_folder_falls_back_to_pytorch_cpu_index(tmp_path):
    fields, stderr = plan(str(tmp_path / "no-such-folder"), tmp_path)
    assert fields["torch_source"] == "index"
    assert shlex.split(fields["uv_args"]) == ["--extra-index-url", TORCH_INDEX, "--index-strategy", "unsafe-best-match"]
    assert len(source_lines(stderr)) == 1
