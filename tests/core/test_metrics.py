"""Unit tests of the metrics path: counters -> step payload -> vLLM's msgpack transport -> the
frontend stat logger's samples -> Prometheus text (``boundary_checkpoints/metrics.py``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from boundary_checkpoints.core.checkpoint import StoreCounters
from boundary_checkpoints.core.step_report import CARRIER_FIELD, StepCounterReporter, take_payload
from boundary_checkpoints.metrics import (
    COUNTER_HELP,
    GAUGE_HELP,
    BoundaryCheckpointPrometheus,
    BoundaryCheckpointStatLogger,
    Sample,
    to_samples,
)


def counters_dict() -> dict[str, int]:
    counters = StoreCounters(hits=3, misses=4, tokens_restored=1234, published=5, evictions=3,
                             evictions_budget=1, evictions_pressure=2, refused_oversize=1, captures_dropped=6,
                             responses_aborted=7, capture_steps=8, capture_copies=9, capture_copy_bytes=4096,
                             duplicates=2, superseded=1, prompt_stops=10, prompt_captures_in_step=11,
                             draft_next_token_fallbacks=12)  # fmt: skip
    counters.hits_by_kind.update(prompt=1, response=2)
    counters.misses_by_reason.update(no_checkpoint=2, diverged=1, cache_bypassed=1)
    stats = counters.as_dict()
    stats.update(checkpoints_retained=4, blocks_retained=40, bytes_retained=81920, captures_pending=0)
    return stats


def test_counters_convert_to_exact_metric_samples():
    samples = set(to_samples(counters_dict()))
    h = "vllm:boundary_checkpoint_"
    assert samples == {
        Sample(h + "hits", ("prompt",), 1, "counter"),
        Sample(h + "hits", ("response",), 2, "counter"),
        Sample(h + "misses", ("no_checkpoint",), 2, "counter"),
        Sample(h + "misses", ("diverged",), 1, "counter"),
        Sample(h + "misses", ("cache_bypassed",), 1, "counter"),
        Sample(h + "restored_tokens", (), 1234, "counter"),
        Sample(h + "evictions", ("budget",), 1, "counter"),
        Sample(h + "evictions", ("pressure",), 2, "counter"),
        Sample(h + "refused_oversize", (), 1, "counter"),
        Sample(h + "captures_published", (), 5, "counter"),
        Sample(h + "captures_dropped", (), 6, "counter"),
        Sample(h + "responses_aborted", (), 7, "counter"),
        Sample(h + "capture_steps", (), 8, "counter"),
        Sample(h + "capture_copies", (), 9, "counter"),
        Sample(h + "capture_copy_bytes", (), 4096, "counter"),
        Sample(h + "prompt_stops", (), 10, "counter"),
        Sample(h + "prompt_captures_in_step", (), 11, "counter"),
        Sample(h + "draft_next_token_fallbacks", (), 12, "counter"),
        Sample("vllm:boundary_checkpoints_retained", (), 4, "gauge"),
        Sample(h + "retained_blocks", (), 40, "gauge"),
        Sample(h + "retained_bytes", (), 81920, "gauge"),
        Sample(h + "captures_pending", (), 0, "gauge"),  # a gauge at 0 is still a value
    }
    # A new kind or reason needs no code: it becomes a label value.
    assert to_samples({"hit_instruction": 2}) == [Sample(h + "hits", ("instruction",), 2, "counter")]
    assert to_samples({"unknown_counter": 5, "tokens_restored": 0}) == []


def test_reporter_sends_counter_deltas_and_gauge_values():
    reporter = StepCounterReporter(enabled=True)
    first = reporter.payload({"hits": 2, "hit_prompt": 2, "checkpoints_retained": 3})
    assert first == {"hits": 2, "hit_prompt": 2, "checkpoints_retained": 3}
    second = reporter.payload({"hits": 2, "hit_prompt": 2, "miss_diverged": 1, "checkpoints_retained": 3})
    assert second == {"miss_diverged": 1, "checkpoints_retained": 3}


def test_payload_survives_vllm_transport_and_is_removed_before_vllm_loggers():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = SchedulerStats(num_kv_fetch_reqs_by_stage={"in_progress": 1})
    StepCounterReporter(enabled=True).attach(stats, counters_dict)
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    received = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
    payload = take_payload(received)
    assert payload == {k: v for k, v in counters_dict().items() if v or k == "captures_pending"}
    assert getattr(received, CARRIER_FIELD) == {"in_progress": 1}  # vLLM's own entries untouched


def scrape(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_prometheus_series_per_model_and_engine():
    registry = CollectorRegistry()
    prom = BoundaryCheckpointPrometheus("tiny", [0, 1], registry=registry)
    base = (("engine", "0"), ("model_name", "tiny"))
    before = scrape(registry)
    assert before[("vllm:boundary_checkpoint_hits_total", (*base[:1], ("kind", "response"), *base[1:]))] == 0
    assert before[("vllm:boundary_checkpoint_misses_total", (*base[:1], ("model_name", "tiny"),
                                                             ("reason", "block_grid_as_long")))] == 0  # fmt: skip
    prom.observe(counters_dict(), engine=1)
    prom.observe({"hit_prompt": 4, "checkpoints_retained": 2}, engine=1)
    after = scrape(registry)
    e1 = (("engine", "1"),)
    assert after[("vllm:boundary_checkpoint_hits_total", (*e1, ("kind", "prompt"), ("model_name", "tiny")))] == 5
    assert after[("vllm:boundary_checkpoint_restored_tokens_total", (*e1, ("model_name", "tiny")))] == 1234
    assert after[("vllm:boundary_checkpoint_evictions_total", (("cause", "pressure"), *e1,
                                                               ("model_name", "tiny")))] == 2  # fmt: skip
    assert after[("vllm:boundary_checkpoints_retained", (*e1, ("model_name", "tiny")))] == 2
    assert after[("vllm:boundary_checkpoint_retained_bytes", (*e1, ("model_name", "tiny")))] == 81920
    assert after[("vllm:boundary_checkpoint_hits_total", (*base[:1], ("kind", "prompt"), *base[1:]))] == 0
    names = {name.removesuffix("_total") for name, _ in after if "capture_copy_seconds" not in name}
    assert names == set(COUNTER_HELP) | set(GAUGE_HELP)


def test_capture_copy_times_travel_as_microseconds_into_a_histogram():
    from vllm.v1.metrics.stats import SchedulerStats

    from boundary_checkpoints.metrics import COPY_SECONDS

    stats = SchedulerStats(num_kv_fetch_reqs_by_stage={})
    StepCounterReporter(enabled=True).attach(stats, lambda: {}, [0.0003, 0.002])
    payload = take_payload(stats)
    assert payload == {"capture_copy_us.0": 300, "capture_copy_us.1": 2000}
    assert to_samples(payload) == [Sample(COPY_SECONDS, (), 300, "observation"),
                                   Sample(COPY_SECONDS, (), 2000, "observation")]  # fmt: skip
    registry = CollectorRegistry()
    BoundaryCheckpointPrometheus("tiny", [0], registry=registry).observe(payload, engine=0)
    series = (("engine", "0"), ("model_name", "tiny"))
    after = scrape(registry)
    assert after[(COPY_SECONDS + "_count", series)] == 2
    assert after[(COPY_SECONDS + "_sum", series)] == pytest.approx(0.0023)
    assert after[(COPY_SECONDS + "_bucket", (*series[:1], ("le", "0.0005"), *series[1:]))] == 1


def test_stat_logger_strips_payload_even_when_inactive():
    class Config:
        class model_config:  # noqa: N801
            served_model_name = "m"

        class scheduler_config:  # noqa: N801
            scheduler_cls = None

    from vllm.v1.metrics.stats import SchedulerStats

    stat_logger = BoundaryCheckpointStatLogger(Config, [0])
    assert not stat_logger.active
    stats = SchedulerStats()
    StepCounterReporter(enabled=True).attach(stats, lambda: {"hit_prompt": 1})
    stat_logger.record(stats, None)
    assert getattr(stats, CARRIER_FIELD) == {}
    assert stat_logger.prometheus is None


def test_pyproject_declares_the_stat_logger_entry_point():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    groups = pyproject["project"]["entry-points"]
    assert groups["vllm.stat_logger_plugins"] == {
        "boundary_checkpoints": "boundary_checkpoints.metrics:BoundaryCheckpointStatLogger"
    }
    # Same name as the general plugin, so VLLM_PLUGINS selects both or neither.
    assert set(groups["vllm.general_plugins"]) == set(groups["vllm.stat_logger_plugins"])


def test_tables_come_from_the_counter_fields_and_kinds():
    """Every exported ``StoreCounters`` field is a series and every ``ReportedGauges`` field a gauge
    (``core/store.py``: a counter is added there, with its help text); label values are
    ``core/kinds.py``'s, whose values the series' labels and the docs name."""
    from dataclasses import fields

    from boundary_checkpoints import metrics
    from boundary_checkpoints.core.checkpoint import ReportedGauges
    from boundary_checkpoints.core.kinds import CheckpointKind, MissReason

    exported = [f for f in fields(StoreCounters) if "help" in f.metadata]
    assert len(COUNTER_HELP) == len(exported) == 30
    assert all(help_text for help_text, _ in COUNTER_HELP.values())
    assert set(metrics.GAUGE_KEYS) == {f.name for f in fields(ReportedGauges)} and len(GAUGE_HELP) == 5
    assert [k.value for k in CheckpointKind] == ["prompt", "response", "instruction"] == list(metrics.KNOWN_KINDS)
    assert [r.value for r in MissReason] == [
        "no_checkpoint", "diverged", "evicted", "block_grid_as_long", "ineligible", "cache_bypassed",
        "draft_next_token", "short_row", "within_a_pool", "unknown",
    ]  # fmt: skip
    assert metrics.KNOWN_EVICTION_CAUSES == ("budget", "pressure", "borrowed", "cached")
    counters = StoreCounters()
    counters.hits_by_kind[CheckpointKind.INSTRUCTION] = 1
    counters.misses_by_reason[MissReason.DRAFT_NEXT_TOKEN] = 2
    assert set(to_samples(counters.as_dict())) == {
        Sample("vllm:boundary_checkpoint_hits", ("instruction",), 1, "counter"),
        Sample("vllm:boundary_checkpoint_misses", ("draft_next_token",), 2, "counter"),
    }


@pytest.mark.parametrize(("backend", "reaches"), [("uni", True), ("external_launcher", True), ("mp", False)])
def test_the_startup_line_says_whether_copy_times_reach_metrics(backend, reaches):
    from types import SimpleNamespace

    from boundary_checkpoints.core.step_copies import copy_times_reach_metrics

    said = copy_times_reach_metrics(
        SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))
    )
    assert said.startswith("on /metrics") == reaches
    assert reaches or "executor mp" in said


def test_a_step_that_changed_nothing_sends_no_payload(model_dir, monkeypatch):
    """The scheduler attaches its counters only to steps after which one of them changed: a decode
    step that captured, restored and evicted nothing costs no payload. Negative control: with the
    step state frozen, the resend's hit would never reach ``/metrics``."""
    import random

    from shadow_scheduler import Driver, build_scheduler, make_request, tokens

    scheduler, worker = build_scheduler(model_dir)
    scheduler._step_counter_reporter = StepCounterReporter(enabled=True)
    payloads = []  # per make_stats call (vLLM's update_from_output makes one per step)
    make_stats = scheduler.make_stats
    monkeypatch.setattr(scheduler, "make_stats", lambda *a, **k: payloads.append(take_payload(make_stats(*a, **k))))
    driver = Driver(scheduler, worker)
    prompt = tokens(random.Random(1), 40)
    driver.run([make_request(prompt, salt="s", max_tokens=24)])
    assert sum(p.get("published", 0) for p in payloads) > 0
    assert sum(1 for p in payloads if not p) >= 10  # the decode steps after the prompt's capture
    payloads.clear()
    driver.run([make_request(prompt, salt="s")])  # a resend: a hit
    assert sum(p.get("hits", 0) for p in payloads) == 1
    monkeypatch.setattr(scheduler, "_stats_state", lambda: ())
    make_stats()
    payloads.clear()
    driver.run([make_request(prompt, salt="s")])
    assert sum(p.get("hits", 0) for p in payloads) == 0
