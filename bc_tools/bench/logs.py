"""What the multi-turn benchmark reads from a vLLM server's log and command line.

Contract (pure functions except ``read_text``):

- ``parse_boundary_stats``: the counters of the last ``boundary_checkpoints: name=value, ...``
  stats line the plugin logs every ``stats_log_interval_s``; ``peak_bytes_retained``: the largest
  ``bytes_retained`` of every such line in a piece of log (None when there is none).
- ``kv_pool_bytes``: the KV cache pool vLLM allotted ("Available KV cache memory: X GiB"), the
  denominator of the retained share the report gives.
- ``graph_capture``: what vLLM's CUDA graph capture took at startup ("Graph capturing finished in
  S secs, took G GiB"), the startup and memory cost of the graphs a server captures.
- ``parse_block_size``: the attention block size vLLM chose for a hybrid ("Setting attention block
  size to N tokens"); ``resolve_block_size`` picks the block size from the command line, that log
  line or a ``--block-size`` server flag, in that order, and says where it came from.
- ``plugin_logging_config``: a ``VLLM_LOGGING_CONFIG_PATH`` config that routes vLLM's and the
  plugin's INFO lines to stdout (plugin revisions before 0cd112e logged outside vLLM's ``vllm``
  logger tree, so vLLM's default config dropped their stats lines).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

_STATS_RE = re.compile(r"boundary_checkpoints: ((?:\w+=-?\d+(?:, )?)+)\s*$")
_BYTES_RE = re.compile(r"boundary_checkpoints:.*\bbytes_retained=(\d+)")
_BLOCK_SIZE_RE = re.compile(r"Setting attention block size to (\d+) tokens")
_KV_POOL_RE = re.compile(r"Available KV cache memory: ([0-9.]+) GiB")
_GRAPH_CAPTURE_RE = re.compile(r"Graph capturing finished in ([0-9.]+) secs, took (-?[0-9.]+) GiB")


def parse_boundary_stats(log_text: str) -> dict[str, int] | None:
    """The counters of the last ``boundary_checkpoints: name=value, ...`` line, or None."""
    last = None
    for line in log_text.splitlines():
        if "boundary_checkpoints: " in line and "=" in line:
            m = _STATS_RE.search(line.rstrip())
            if m:
                last = m.group(1)
    if last is None:
        return None
    stats = {}
    for item in last.split(","):
        name, _, value = item.strip().partition("=")
        if name:
            stats[name] = int(value)
    return stats


def peak_bytes_retained(log_text: str) -> int | None:
    """The largest ``bytes_retained=N`` of the plugin's stats lines in ``log_text``, or None."""
    found = _BYTES_RE.findall(log_text)
    return max(int(v) for v in found) if found else None


def kv_pool_bytes(log_text: str) -> int | None:
    """The KV cache memory vLLM allotted (the last such line of the log), in bytes, or None."""
    found = _KV_POOL_RE.findall(log_text)
    return int(float(found[-1]) * 2**30) if found else None


def graph_capture(log_text: str) -> dict[str, float] | None:
    """The last CUDA graph capture vLLM logged: ``{"seconds": S, "gib": G}``, or None."""
    found = _GRAPH_CAPTURE_RE.findall(log_text)
    if not found:
        return None
    seconds, gib = found[-1]
    return {"seconds": float(seconds), "gib": float(gib)}


def parse_block_size(log_text: str) -> int | None:
    """The attention block size vLLM chose (the last such line of the log), or None."""
    found = _BLOCK_SIZE_RE.findall(log_text)
    return int(found[-1]) if found else None


def server_arg_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` / ``flag=VALUE`` in an argv (argparse: last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def resolve_block_size(cli_value: int | None, log_text: str, server_args: Sequence[str]) -> tuple[int | None, str]:
    """(B, where it came from): --block-size, else the server log line, else a --block-size in the
    server args, else (None, 'unknown')."""
    if cli_value:
        return cli_value, "--block-size"
    parsed = parse_block_size(log_text)
    if parsed:
        return parsed, "server log ('Setting attention block size to N tokens')"
    arg = server_arg_value(server_args, "--block-size")
    if arg and arg.isdigit():
        return int(arg), "--server-arg --block-size"
    return None, "unknown"


def read_text(path: str | os.PathLike | None, offset: int = 0) -> str:
    """The text of ``path`` from byte ``offset`` ('' if there is no path or it cannot be read)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def log_size(path: str | os.PathLike | None) -> int:
    """The current size of ``path`` in bytes (0 if unknown): where the next slot's log starts."""
    try:
        return Path(path).stat().st_size if path else 0
    except OSError:
        return 0


def plugin_logging_config() -> dict:
    """A ``VLLM_LOGGING_CONFIG_PATH`` config: vLLM's loggers plus the plugin's, at INFO, on stdout."""
    handler = {"handlers": ["bench"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "bench": {
                "format": "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
                          "[%(filename)s:%(lineno)d] %(message)s",
                "datefmt": "%m-%d %H:%M:%S",
            }
        },
        "handlers": {
            "bench": {"class": "logging.StreamHandler", "formatter": "bench", "level": "INFO",
                      "stream": "ext://sys.stdout"},
        },
        "loggers": {"vllm": dict(handler), "boundary_checkpoints": dict(handler)},
    }  # fmt: skip
