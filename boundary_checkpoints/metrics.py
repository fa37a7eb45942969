"""Prometheus metrics for boundary checkpoints, on the server's own ``/metrics`` endpoint.

Path of the numbers (vLLM 0.32, no second endpoint, no vLLM function patched):

1. Engine core. The plugin's scheduler counts into ``CheckpointStore.counters`` (``StoreCounters``)
   and, once per step, vLLM calls ``Scheduler.make_stats`` for the ``SchedulerStats`` it sends
   to the frontend. The plugin's override (``BoundaryCheckpointMixin.make_stats``) adds this
   step's counter *deltas* (and the current gauge values) through ``core/step_report.py``.
2. Transport. ``SchedulerStats`` rides ``EngineCoreOutputs`` through vLLM's msgpack channel,
   whose decoder is typed: it rebuilds a plain ``SchedulerStats`` and drops any field a subclass
   adds, and ``SchedulerStats`` has no field reserved for plugins (``kv_connector_stats`` and
   ``ec_connector_stats`` are handed to the configured connector's stats class, which a server
   without a connector does not have). So the payload rides the one ``dict[str, int]`` field
   whose stock readers look up only their own keys, ``num_kv_fetch_reqs_by_stage``, as
   ``boundary_checkpoints:<counter>`` entries (``core/step_report.py``).
   The engine core adds them only when the frontend will take them out again (the stat logger
   below is installed and not filtered by ``VLLM_PLUGINS``).
3. Frontend. ``vllm.stat_logger_plugins`` entry point ``boundary_checkpoints`` ->
   :class:`BoundaryCheckpointStatLogger`. vLLM builds plugin stat loggers before its own logging
   and Prometheus loggers and records every step into them in that order, so this logger pops
   the ``boundary_checkpoints:`` entries (``take_payload``) before vLLM's loggers read the
   dict, turns them into samples (:func:`to_samples`) and applies them to ``prometheus_client``
   counters and gauges in the default registry, which vLLM's ``/metrics`` serves (also in
   multi-process mode: the gauges are ``mostrecent`` like vLLM's). Labels ``model_name`` (the
   served model name) and ``engine`` (the engine index), as on vLLM's own metrics.

Deltas, not totals, travel: with several API servers each step's stats reach exactly one of them,
so a delta is counted once wherever it lands. The metrics are registered in
``log_engine_initialized`` because vLLM's Prometheus logger, built after this one, unregisters
every collector whose name starts with ``vllm:``.

Metric names: see :data:`COUNTER_HELP`, :data:`GAUGE_HELP` (and README "Metrics"), built from the
fields of ``StoreCounters`` and ``ReportedGauges`` (``core/checkpoint.py``), where each series' name and
help text are kept; label values are ``core/kinds.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import Field, dataclass, fields
from typing import Any

from vllm.logger import init_logger

from boundary_checkpoints.compat import AggregateStatLoggerBase
from boundary_checkpoints.core.checkpoint import ReportedGauges, StoreCounters
from boundary_checkpoints.core.kinds import CheckpointKind, MissReason
from boundary_checkpoints.core.step_report import COPY_TIME_KEY, take_payload

logger = init_logger(f"vllm.{__name__}")


# ---- the tables, built from the fields of StoreCounters and ReportedGauges (core/store.py) ---------
METRIC_PREFIX = "vllm:boundary_checkpoint_"


def _metric(spec: Field) -> str:
    return spec.metadata["metric"] or METRIC_PREFIX + spec.name


_EXPORTED = {spec.name: spec for spec in fields(StoreCounters) if "help" in spec.metadata}
_LABEL_PARTS = [spec for spec in fields(StoreCounters) if "of" in spec.metadata]

# Prometheus counter -> (help, its label names after model_name and engine).
COUNTER_HELP: dict[str, tuple[str, tuple[str, ...]]] = {
    _metric(spec): (spec.metadata["help"], (spec.metadata["label"],) if spec.metadata["label"] else ())
    for spec in _EXPORTED.values()
}
# Payload key -> (metric, label values) for the counters with one fixed series.
_COUNTER_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{name: (_metric(spec), ()) for name, spec in _EXPORTED.items() if not spec.metadata["label"]},
    **{spec.name: (_metric(_EXPORTED[spec.metadata["of"]]), (spec.metadata["value"],))
       for spec in _LABEL_PARTS if "value" in spec.metadata},
}  # fmt: skip
# Payload key prefix -> the labelled counter whose label value follows it (``hit_<kind>``, ...).
_LABELLED_PREFIXES: dict[str, str] = {
    spec.metadata["prefix"]: _metric(_EXPORTED[spec.metadata["of"]])
    for spec in _LABEL_PARTS
    if "prefix" in spec.metadata
}
GAUGE_HELP: dict[str, str] = {_metric(spec): spec.metadata["help"] for spec in fields(ReportedGauges)}
# Payload key -> gauge. Values sent as they are (gauges); every other counter travels as a delta.
_GAUGE_KEYS: dict[str, str] = {spec.name: _metric(spec) for spec in fields(ReportedGauges)}
GAUGE_KEYS = tuple(_GAUGE_KEYS)

# One observation per launch of capture copies (the worker's time for them; only where the worker
# shares the engine core's process, see core/step_copies.py).
COPY_SECONDS = METRIC_PREFIX + "capture_copy_seconds"
COPY_SECONDS_HELP = "Time of one launch of boundary capture copies (a step's copies before or after its forward)."
COPY_SECONDS_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

HITS = _metric(_EXPORTED["hits"])
MISSES = _metric(_EXPORTED["misses"])
EVICTIONS = _metric(_EXPORTED["evictions"])

# Series shown (at 0) from startup; other kinds and reasons appear when first counted
# (draft_next_token and short_row under speculative decoding only, unknown never expected).
KNOWN_KINDS = tuple(kind.value for kind in CheckpointKind)
KNOWN_MISS_REASONS = tuple(
    reason.value
    for reason in MissReason
    if reason not in (MissReason.DRAFT_NEXT_TOKEN, MissReason.SHORT_ROW, MissReason.UNKNOWN)
)
KNOWN_EVICTION_CAUSES = tuple(labels[0] for metric, labels in _COUNTER_KEYS.values() if metric == EVICTIONS)


@dataclass(frozen=True)
class Sample:
    """One update: ``counter`` samples are increments, ``gauge`` samples are values."""

    metric: str
    labels: tuple[str, ...]  # values of the metric's own label names (after model_name, engine)
    value: int
    type: str  # "counter", "gauge" or "observation" (microseconds, into a histogram of seconds)


def to_samples(payload: Mapping[str, int]) -> list[Sample]:
    """Metric samples for one step's payload (counter deltas and gauge values by counter name,
    as in ``BoundaryCheckpointMixin.boundary_stats``). ``hit_<kind>`` and ``miss_<reason>`` map
    to a labelled series each; counters with a zero delta and unknown names give no sample."""
    samples: list[Sample] = []
    for name, value in payload.items():
        if name.startswith(COPY_TIME_KEY):
            samples.append(Sample(COPY_SECONDS, (), value, "observation"))
        elif name in _GAUGE_KEYS:
            samples.append(Sample(_GAUGE_KEYS[name], (), value, "gauge"))
        elif value <= 0:
            continue
        elif name in _COUNTER_KEYS:
            metric, labels = _COUNTER_KEYS[name]
            samples.append(Sample(metric, labels, value, "counter"))
        else:
            for prefix, metric in _LABELLED_PREFIXES.items():
                if name.startswith(prefix):
                    samples.append(Sample(metric, (name[len(prefix) :],), value, "counter"))
                    break
    return samples


_registered: list[Any] = []  # this process's collectors, unregistered before registering anew


class BoundaryCheckpointPrometheus:
    """The ``prometheus_client`` counters and gauges, one series per engine (and label)."""

    def __init__(self, model_name: str, engine_indexes: Iterable[int], registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        self.registry = REGISTRY if registry is None else registry
        for collector in _registered:
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass  # already unregistered (vLLM's Prometheus logger)
        _registered.clear()
        self.model_name = model_name
        base = ["model_name", "engine"]
        self.metrics: dict[str, Any] = {}
        for name, (documentation, labels) in COUNTER_HELP.items():
            self.metrics[name] = Counter(name, documentation, [*base, *labels], registry=self.registry)
        for name, documentation in GAUGE_HELP.items():
            self.metrics[name] = Gauge(
                name, documentation, base, registry=self.registry, multiprocess_mode="mostrecent"
            )
        self.metrics[COPY_SECONDS] = Histogram(
            COPY_SECONDS, COPY_SECONDS_HELP, base, buckets=COPY_SECONDS_BUCKETS, registry=self.registry
        )
        _registered.extend(self.metrics.values())
        known = {HITS: KNOWN_KINDS, MISSES: KNOWN_MISS_REASONS, EVICTIONS: KNOWN_EVICTION_CAUSES}
        for engine in engine_indexes:  # every known series from the start, at 0
            for name, (_, labels) in COUNTER_HELP.items():
                for value in known[name] if labels else [None]:
                    self._series(name, engine, () if value is None else (value,))
            for name in (*GAUGE_HELP, COPY_SECONDS):
                self._series(name, engine, ())

    def _series(self, metric: str, engine: int, labels: tuple[str, ...]):
        return self.metrics[metric].labels(self.model_name, str(engine), *labels)

    def observe(self, payload: Mapping[str, int], engine: int) -> None:
        for sample in to_samples(payload):
            series = self._series(sample.metric, engine, sample.labels)
            if sample.type == "gauge":
                series.set(sample.value)
            elif sample.type == "observation":
                series.observe(sample.value / 1e6)
            else:
                series.inc(sample.value)


class BoundaryCheckpointStatLogger(AggregateStatLoggerBase):
    """vLLM stat logger plugin (``vllm.stat_logger_plugins``): boundary checkpoint counters from
    every engine core's ``SchedulerStats`` to Prometheus. Inactive (it only strips its entries)
    when the configured scheduler is not the plugin's."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        from boundary_checkpoints.wiring import extends_boundary_scheduler

        self.engine_indexes = list(engine_indexes or [0])
        self.model_name = vllm_config.model_config.served_model_name
        scheduler_cls = vllm_config.scheduler_config.scheduler_cls
        self.active = scheduler_cls is not None and extends_boundary_scheduler(scheduler_cls)
        self.prometheus: BoundaryCheckpointPrometheus | None = None

    def _ensure_prometheus(self) -> BoundaryCheckpointPrometheus:
        if self.prometheus is None:
            self.prometheus = BoundaryCheckpointPrometheus(self.model_name, self.engine_indexes)
        return self.prometheus

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        payload = take_payload(scheduler_stats)
        if payload and self.active:
            self._ensure_prometheus().observe(payload, engine_idx)

    def log_engine_initialized(self) -> None:
        # After vLLM's Prometheus logger was built (it unregisters "vllm:" collectors).
        if self.active:
            self._ensure_prometheus()
