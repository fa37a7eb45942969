"""The engine core's half of the plugin's metrics: each step's counter deltas and gauge values,
carried to the frontend inside vLLM's ``SchedulerStats``, and taken out there again.

Contract: :class:`StepCounterReporter` adds ``boundary_checkpoints:<counter>`` entries (deltas;
gauges as they are) to the one ``dict[str, int]`` field of ``SchedulerStats`` whose stock readers
look up only their own keys (:data:`CARRIER_FIELD`), and only when the frontend's stat logger is
active (:func:`frontend_collects`); :func:`take_payload` removes them before vLLM's loggers read
the field. ``metrics.py`` turns them into Prometheus series. Capture-copy times travel as one
entry per observation, ``boundary_checkpoints:capture_copy_us.<i>`` (microseconds, an ``int``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from vllm.logger import init_logger

from boundary_checkpoints.compat import STATS_CARRIER_FIELD
from boundary_checkpoints.core.checkpoint import ReportedGauges

logger = init_logger(f"vllm.{__name__}")

STAT_LOGGER_NAME = "boundary_checkpoints"  # entry point name; same as the general plugin's
STAT_LOGGER_GROUP = "vllm.stat_logger_plugins"
CARRIER_FIELD = STATS_CARRIER_FIELD
PAYLOAD_PREFIX = "boundary_checkpoints:"
COPY_TIME_KEY = "capture_copy_us."  # + the observation's index in its step
REPORTED_GAUGES = frozenset(spec.name for spec in fields(ReportedGauges))  # sent as they are, not as deltas

_frontend_collects: bool | None = None


def frontend_collects() -> bool:
    """Whether the frontend runs :class:`BoundaryCheckpointStatLogger` (its entry point is
    installed and ``VLLM_PLUGINS`` does not leave it out); both processes share the environment.
    Checked once per process."""
    global _frontend_collects
    if _frontend_collects is None:
        from importlib.metadata import entry_points

        from boundary_checkpoints.compat import allowed_vllm_plugins

        allowed = allowed_vllm_plugins()
        names = {ep.name for ep in entry_points(group=STAT_LOGGER_GROUP)}
        _frontend_collects = STAT_LOGGER_NAME in names and (allowed is None or STAT_LOGGER_NAME in allowed)
        if not _frontend_collects:
            logger.info(
                "boundary_checkpoints: stat logger entry point %s:%s not active; no /metrics series "
                "(reinstall the package to register it)",
                STAT_LOGGER_GROUP,
                STAT_LOGGER_NAME,
            )
    return _frontend_collects


class StepCounterReporter:
    """Engine-core side: puts the counters' change since the last report (and the gauges'
    current values) into a step's ``SchedulerStats``."""

    def __init__(self, enabled: bool | None = None) -> None:
        """``enabled`` None: whether the frontend collects (:func:`frontend_collects`), looked up
        here, at the scheduler's start, rather than in a serving step (it scans entry points)."""
        self._reported: dict[str, int] = {}
        self._enabled = frontend_collects() if enabled is None else enabled

    def payload(self, current: Mapping[str, int]) -> dict[str, int]:
        """Gauges as they are, counters as deltas; unchanged counters are left out."""
        out: dict[str, int] = {}
        for name, value in current.items():
            if name in REPORTED_GAUGES:
                out[name] = value
                continue
            delta = value - self._reported.get(name, 0)
            self._reported[name] = value
            if delta > 0:
                out[name] = delta
        return out

    def attach(self, stats: Any, current: Callable[[], Mapping[str, int]], copy_seconds: Sequence[float] = ()) -> None:
        """Add ``current()`` (read only when the frontend collects it) and the capture-copy times
        ``copy_seconds`` to ``stats``."""
        if not self._enabled:
            return
        carrier = getattr(stats, CARRIER_FIELD, None)
        if not isinstance(carrier, dict):
            return
        carrier.update({PAYLOAD_PREFIX + name: value for name, value in self.payload(current()).items()})
        for index, seconds in enumerate(copy_seconds):
            carrier[f"{PAYLOAD_PREFIX}{COPY_TIME_KEY}{index}"] = round(seconds * 1e6)


def take_payload(scheduler_stats: Any) -> dict[str, int]:
    """Remove the plugin's entries from ``scheduler_stats`` (so vLLM's loggers never see them)
    and return them by counter name."""
    carrier = getattr(scheduler_stats, CARRIER_FIELD, None)
    if not isinstance(carrier, dict):
        return {}
    keys = [key for key in carrier if isinstance(key, str) and key.startswith(PAYLOAD_PREFIX)]
    return {key[len(PAYLOAD_PREFIX) :]: carrier.pop(key) for key in keys}
