"""``benchmarks/gpu/compile_cache.sh`` on the CPU: ``save`` packs vLLM's and Triton's caches into
parts (xz or gzip), ``restore`` unpacks parts carried in ``.gpu-cache/`` to the same paths once per
host, whichever packed them, and a cache over the part limit is not saved (each stage must go on
whatever happens)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "compile_cache.sh"


def caches(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    home, triton = tmp_path / "home", tmp_path / "triton"
    graph = home / ".cache" / "vllm" / "torch_compile_cache" / "rank_0" / "graph.py"
    graph.parent.mkdir(parents=True)
    graph.write_bytes(os.urandom(4096))
    (triton / "k").mkdir(parents=True)
    (triton / "k" / "kernel.cubin").write_bytes(b"cubin")
    (tmp_path / "work").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CACHE_ROOT"}
    env.update(HOME=str(home), TRITON_CACHE_DIR=str(triton), CC_WORK=str(tmp_path / "work"))
    return env, graph, triton / "k" / "kernel.cubin"


def run(cwd: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return done.stdout


@pytest.mark.parametrize("compressor", ["xz", "gzip"])
def test_save_then_restore_puts_both_caches_back_once(tmp_path, compressor):
    env, graph, cubin = caches(tmp_path)
    env["CC_COMPRESSOR"] = compressor
    saved = graph.read_bytes()
    out, repo = tmp_path / "out", tmp_path / "repo"
    out.mkdir()
    assert f"({compressor})" in run(tmp_path, env, "save", str(out))
    parts = sorted(out.glob("cc-part-*"))
    assert parts
    shutil.rmtree(tmp_path / "home")
    shutil.rmtree(tmp_path / "triton")
    (repo / ".gpu-cache").mkdir(parents=True)
    for part in parts:
        shutil.copy(part, repo / ".gpu-cache")
    assert "restored" in run(repo, env, "restore")
    assert graph.read_bytes() == saved and cubin.read_bytes() == b"cubin"
    assert "nothing to restore" in run(repo, env, "restore")


def test_a_cache_over_the_part_limit_is_not_saved(tmp_path):
    env, _, _ = caches(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    assert "not saved" in run(tmp_path, {**env, "CC_MAX_PARTS": "0"}, "save", str(out))
    assert not list(out.iterdir())
