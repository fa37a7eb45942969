"""Servers that ``bc-bench --launch --sleep-others --keep-servers FILE`` leaves running for the next
run with the same launch, so that a GPU host starts each server once per session.

Contract: ``launch_key`` names what a launch starts (model, served name, address, every label's
``boundary_checkpoints`` section and flags, the environment but its logging-config path).
``save`` writes the servers that run, under that key, to FILE (pid, host, port, log, command per
label) and takes them off the interpreter's stop-at-exit list. ``adopt`` returns, for a FILE
written under the same key, each listed server whose process group is alive, as a
``ServerProcess`` over a ``DetachedProcess``; for another key or an unreadable FILE it stops
every listed server that is alive (``stop``: SIGTERM to its group, SIGKILL after a grace) and
returns none. ``python -m bc_tools.bench.kept_servers --stop FILE`` stops them from a shell.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from bc_tools.bench import server as server_mod

LOGGING_CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"  # a fresh temporary path per run: not part of the key


def launch_key(description: dict[str, Any]) -> str:
    """A digest of ``description`` (JSON-serialisable) without its environment's logging-config path."""
    env = {k: v for k, v in description.get("env", {}).items() if k != LOGGING_CONFIG_ENV}
    text = json.dumps({**description, "env": env}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save(path: Path, key: str, running: dict[str, server_mod.ServerProcess]) -> None:
    """Record ``running`` under ``key`` in ``path``; they outlive this process."""
    entries = {label: {"pid": s.pid, "host": s.host, "port": s.port, "log_path": str(s.log_path),
                       "command": list(s.command)} for label, s in running.items()}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "servers": entries}, indent=2) + "\n")
    for s in running.values():
        server_mod.detach(s)


def _entries(path: Path) -> tuple[str | None, dict[str, dict]]:
    try:
        data = json.loads(path.read_text())
        return data.get("key"), dict(data.get("servers") or {})
    except (OSError, ValueError, AttributeError):
        return None, {}


def _server(entry: dict) -> server_mod.ServerProcess:
    return server_mod.ServerProcess(
        process=server_mod.DetachedProcess(int(entry["pid"])), host=entry["host"], port=int(entry["port"]),
        log_path=Path(entry["log_path"]), command=list(entry["command"]),
    )  # fmt: skip


def stop(path: Path) -> list[str]:
    """Stop every server ``path`` lists that is alive and remove the file; the labels stopped."""
    _, entries = _entries(path)
    stopped = []
    for label, entry in entries.items():
        server = _server(entry)
        if server.running():
            server_mod.stop_server(server, grace=20.0)
            stopped.append(label)
    path.unlink(missing_ok=True)
    return stopped


def adopt(path: Path, key: str) -> dict[str, server_mod.ServerProcess]:
    """The live servers ``path`` keeps under ``key``, by label (see the module docstring)."""
    if not path.exists():
        return {}
    kept_key, entries = _entries(path)
    if kept_key != key:
        stop(path)
        return {}
    servers = {label: _server(entry) for label, entry in entries.items()}
    return {label: s for label, s in servers.items() if s.running()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bc_tools.bench.kept_servers", description=__doc__)
    parser.add_argument("--stop", metavar="FILE", required=True, help="stop the servers FILE keeps")
    args = parser.parse_args(argv)
    stopped = stop(Path(args.stop))
    print(f"kept servers stopped: {', '.join(stopped) or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
