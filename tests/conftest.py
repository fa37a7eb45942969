"""Shared pytest set-up: offline, CPU-engine environment, the tiny hybrid model and the fixtures
more than one test module uses. The test modules sit in folders that mirror the package (``core/``,
``worker/``, ``config/``, ``e2e/``, ``gpu/``, ``tools/``); helpers that are plain functions live in
``helpers/``, on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml) and imported
by bare name (``servers``: the server-fixture factory; ``prompts``: prompts for the tiny
vocabulary; ``shadow_engine``, ``engine_script``, ``http_stub``, ...). Engine scripts and servers
that import a helper in a child process put ``helpers/`` on their path themselves
(``engine_script.HELPERS_DIR``).

The environment is set at import time, before any test module imports vLLM, so that in-process
engines and the servers the tests start (they inherit ``os.environ``) never reach the Hugging Face
hub and take 1 GiB of CPU KV cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen3-Next (seed 0), built once into the user cache and reused across runs.

    ``BC_TINY_MODEL_DIR`` points the tests at another directory (built there if missing).
    """
    from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

    target = os.environ.get("BC_TINY_MODEL_DIR") or default_model_dir("qwen3_next", 0)
    return make_tiny_model(target, family="qwen3_next", seed=0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is available (the GPU host); skipped elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A config-only hybrid model directory for the scheduler tests on the shadow engine."""
    from shadow_scheduler import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("hybrid_cfg"))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (word-level, with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def weights(dirs):
    """The ``model.safetensors`` tensors of each model directory of the module's own ``dirs``
    fixture (name -> directory)."""
    from safetensors.torch import load_file

    return {name: load_file(str(path / "model.safetensors")) for name, path in dirs.items()}


@pytest.fixture
def quiet_vllm(monkeypatch):
    """vLLM logs every scheduler it builds at INFO; hundreds of examples would drown the output.

    Every ``VllmConfig`` re-applies vLLM's logging configuration from the environment. Modules
    that build schedulers by the hundred use it: ``pytestmark = pytest.mark.usefixtures("quiet_vllm")``.
    """
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
