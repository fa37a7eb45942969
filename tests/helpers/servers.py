"""The one way the tests start a real vLLM OpenAI server (CPU engine, the tiny model), and the
small client helpers the server tests share.

* :func:`tiny_server`: a context manager that starts a server on the tiny model with the given
  ``--additional-config`` / environment / extra arguments, yields its handle
  (``bench.server.ServerProcess``) once healthy and stops it on exit. For tests that start servers
  themselves (several settings one after the other).
* :func:`server_fixture`: a module-scoped fixture built on it, for modules with one server:
  ``server = server_fixture("server_e2e", additional_config=policy_config("request_boundaries"))``.
  The server is started once per module, on first use, and stopped after the module's last test.
* :func:`corrupt_scheduler_args`: the arguments of a server whose engine core runs the corrupting
  scheduler of ``corrupt_restore`` (the negative control of the probe tests).

Engine tests (``vllm.LLM`` in a fresh process) have the same kind of factory:
``engine_script.engine_fixture``.

Each server logs to ``<tmp>/server<N>/<log_name>.log`` (``ServerProcess.log_path``).
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from engine_script import HELPERS_DIR

from bc_tools.bench.client import chat
from bc_tools.bench.server import RunningServer, ServerProcess

BLOCK = 256  # the CPU engine's block size for the tiny model (attention and recurrent groups)
TIMEOUT_S = 300  # startup: 20-45 s on a 2-core machine, far more when the machine is busy


@contextmanager
def tiny_server(
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    log_name: str,
    *,
    additional_config: dict | None = None,
    env: dict[str, str] | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    **start_kwargs,
) -> Iterator[ServerProcess]:
    """Start a server on ``model_dir``, yield it once healthy, stop it on exit (also on errors).

    ``start_kwargs`` go to ``bench.server.start_server`` as they are (``unset_env``,
    ``served_model_name``, ...)."""
    log_path = tmp_path_factory.mktemp("server") / f"{log_name}.log"
    with RunningServer(model_dir, log_path, timeout=TIMEOUT_S, additional_config=additional_config, env=env,
                       extra_args=list(extra_args), **start_kwargs) as running:  # fmt: skip
        yield running


def server_fixture(log_name: str, *, name: str = "server", **server_kwargs):
    """A module-scoped fixture ``name`` that runs :func:`tiny_server` on the tiny model
    (``tiny_model_dir``) with ``server_kwargs`` for the whole module; assign it to a module
    attribute (the fixture's name is ``name`` whatever the attribute is called)."""

    @pytest.fixture(scope="module", name=name)
    def _server(tiny_model_dir, tmp_path_factory):
        with tiny_server(tiny_model_dir, tmp_path_factory, log_name, **server_kwargs) as running:
            yield running

    return _server


def corrupt_scheduler_args() -> tuple[list[str], dict[str, str]]:
    """``extra_args`` and ``env`` of a server whose engine core runs
    ``corrupt_restore.CorruptScheduler`` (the negative control that restores one token of state
    off; CPU: no async scheduling). The engine-core process imports it from tests/helpers/, which
    ``PYTHONPATH`` puts first."""
    extra_args = ["--scheduler-cls", "corrupt_restore.CorruptScheduler"]
    return extra_args, {"PYTHONPATH": os.pathsep.join(filter(None, [HELPERS_DIR, os.environ.get("PYTHONPATH")]))}


def resend_config(policy: str, **settings) -> dict:
    """``--additional-config`` for ``policy`` with every prompt keeping ``P - 1`` (``prompt_capture:
    in_step``) and kept (``prompt_admission: all``): the servers whose tests check that a first
    resend restores all but its last token. The default keeps the prompt checkpoint at ``P``
    (``tests/e2e/test_server_prompt_end.py``), and by default admission stops keeping fresh
    prompts' checkpoints after enough prompts with no reuse, a count that depends on how much
    traffic a test's threads sent before (``tests/core/test_scheduler_admission.py`` tests it)."""
    section = {"policy": policy, "prompt_capture": "in_step", "prompt_admission": "all"}
    return {"boundary_checkpoints": {**section, **settings}}


# ---- client helpers ------------------------------------------------------------------------------


def new_salt() -> str:
    """A fresh ``cache_salt``: nothing retained under it yet."""
    return uuid.uuid4().hex


def cached_tokens(payload: dict) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a raw completions / chat response."""
    return payload["usage"]["prompt_tokens_details"]["cached_tokens"]


def get_json(base_url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{base_url}{path}", timeout=30) as resp:
        return json.load(resp)


def first_turns(base_url: str, system: str, users: list[str], salt: str) -> list[tuple[int, int | None]]:
    """(prompt tokens, cached tokens) of each conversation's first turn, one after the other."""
    results = []
    for user in users:
        out = chat(base_url, [{"role": "system", "content": system}, {"role": "user", "content": user}],
                   max_tokens=4, cache_salt=salt)  # fmt: skip
        results.append((out.prompt_tokens, out.cached_tokens))
    return results
