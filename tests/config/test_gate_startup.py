"""The gate at engine startup: the decision logged once per process (``log_decision_once``), the
plugin applying the policy to a config (``plugin.apply_policy``, custom scheduler classes), the
check of the installed vLLM against the pinned interface (``compat``), and the layout gate the
scheduler applies once the KV cache exists (``layout_reasons``, ``decide_layout``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from gate_fakes import PLUGIN_WORKER, RecordingLogger, supported_fake

from boundary_checkpoints import gate as bc_gate
from boundary_checkpoints.gate import GateDecision, decide_policy, log_decision_once, unsupported_reasons
from boundary_checkpoints.settings import CONFIG_KEY, BoundaryConfig, BoundaryConfigError
from boundary_checkpoints.wiring import extends_boundary_scheduler

# --------------------------------------------------------------------------------------------------
# Logging once
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_log_memory(monkeypatch):
    monkeypatch.setattr(bc_gate, "_logged_summaries", set())


def test_log_decision_once_per_distinct_summary(fresh_log_memory):
    logger = RecordingLogger()
    fallback = decide_policy(BoundaryConfig(), supported_fake(lora_config=SimpleNamespace()))
    enabled = decide_policy(BoundaryConfig(), supported_fake())
    for _ in range(3):
        log_decision_once(fallback, logger)
        log_decision_once(enabled, logger)
    # an equal decision built separately is the same summary: still logged once
    log_decision_once(GateDecision(fallback.requested, False, fallback.reasons), RecordingLogger())
    assert logger.calls == [("info", fallback.summary()), ("info", enabled.summary())]
    assert "LoRA adapters" in logger.calls[0][1]


def test_log_decision_once_is_process_wide(fresh_log_memory):
    first, second = RecordingLogger(), RecordingLogger()
    decision = decide_policy(BoundaryConfig(), supported_fake())
    log_decision_once(decision, first)
    log_decision_once(decision, second)
    assert len(first.calls) == 1 and second.calls == []


def test_log_decision_once_with_std_logging(fresh_log_memory, caplog):
    logger = logging.getLogger("boundary_checkpoints.test_config")
    decision = decide_policy(
        BoundaryConfig(),
        supported_fake(speculative_config=SimpleNamespace(), parallel_config__pipeline_parallel_size=2),
    )
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_decision_once(decision, logger)
        log_decision_once(decision, logger)
    records = [r for r in caplog.records if r.name == logger.name]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    message = records[0].getMessage()
    assert "\n" not in message
    for reason in decision.reasons:
        assert reason in message


class CountingHandler(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_apply_policy_logs_its_decision_once_on_the_real_logger(fresh_log_memory):
    """The plugin's own (vLLM) logger: one INFO record for any number of configs with the same
    decision, one more for a different decision. (vLLM sets its loggers to INFO only when an
    engine or server starts, so the level is set here.)"""
    from boundary_checkpoints import plugin

    def engine_config(policy, **overrides):
        cfg = supported_fake(**overrides)
        cfg.additional_config = {CONFIG_KEY: {"policy": policy}}
        cfg.scheduler_config = SimpleNamespace(scheduler_cls=None, async_scheduling=False)
        cfg.parallel_config.worker_cls = "vllm.v1.worker.cpu_worker.CPUWorker"
        return cfg

    handler = CountingHandler()
    level = plugin.logger.level
    plugin.logger.setLevel(logging.INFO)
    plugin.logger.addHandler(handler)
    try:
        for _ in range(3):
            plugin.apply_policy(engine_config("auto"))
        ours = [r for r in handler.records if r.getMessage().startswith(f"{CONFIG_KEY}: policy=")]
        assert [(r.levelno, r.getMessage()) for r in ours] == [
            (logging.INFO, f"{CONFIG_KEY}: policy=auto -> request_boundaries")
        ]
        plugin.apply_policy(engine_config("auto", lora_config=SimpleNamespace()))
        ours = [r for r in handler.records if r.getMessage().startswith(f"{CONFIG_KEY}: policy=")]
        assert len(ours) == 2 and "fallback: LoRA" in ours[1].getMessage()
    finally:
        plugin.logger.removeHandler(handler)
        plugin.logger.setLevel(level)


def test_a_custom_scheduler_extending_the_mixin_is_kept():
    from boundary_checkpoints import plugin
    from boundary_checkpoints.core.scheduler import BoundaryScheduler

    class Custom(BoundaryScheduler):
        pass

    cfg = supported_fake()
    cfg.additional_config = {CONFIG_KEY: {"policy": "request_boundaries"}}
    cfg.scheduler_config = SimpleNamespace(scheduler_cls=Custom, async_scheduling=False)
    cfg.parallel_config.worker_cls = "vllm.v1.worker.cpu_worker.CPUWorker"
    plugin.apply_policy(cfg)
    assert cfg.scheduler_config.scheduler_cls is Custom
    assert cfg.parallel_config.worker_cls == "boundary_checkpoints.worker.cpu.BoundaryCPUWorker"
    assert extends_boundary_scheduler(f"{BoundaryScheduler.__module__}.BoundaryScheduler")
    foreign = supported_fake(scheduler_config=SimpleNamespace(scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler"))
    assert any("custom scheduler class" in r for r in unsupported_reasons(foreign))
    assert any(
        "custom scheduler class" in r
        for r in unsupported_reasons(
            supported_fake(scheduler_config=SimpleNamespace(scheduler_cls="no_such_module.Scheduler"))
        )
    )


def test_installed_vllm_matches_the_pinned_interface():
    from boundary_checkpoints.compat import interface_mismatches

    assert interface_mismatches() == []


def test_interface_check_reports_a_changed_signature(monkeypatch):
    from boundary_checkpoints import compat

    def changed(self, req, something_else=False):  # renamed parameters
        return None

    monkeypatch.setattr(compat.Scheduler, "_free_request", changed)
    problems = compat.interface_mismatches()
    assert len(problems) == 1 and "Scheduler._free_request" in problems[0] and "something_else" in problems[0]


def test_installed_vllm_frontend_matches_the_pinned_interface():
    from boundary_checkpoints.compat import frontend_interface_mismatches

    assert frontend_interface_mismatches() == []


def test_frontend_interface_check_reports_a_missing_method(monkeypatch):
    from boundary_checkpoints import compat

    completion, _, _ = compat.openai_serving_classes()
    monkeypatch.delattr(completion, "render_completion_request")
    assert compat.frontend_interface_mismatches() == ["OpenAIServingCompletion.render_completion_request is missing"]


# --------------------------------------------------------------------------------------------------
# The layout gate (what the scheduler learns once the KV cache exists)
# --------------------------------------------------------------------------------------------------


def test_layout_without_reasons_runs_under_every_policy():
    for policy in ("auto", "request_boundaries"):
        assert bc_gate.decide_layout(
            BoundaryConfig(policy=policy), [], block_aligned=True, worker_cls=PLUGIN_WORKER, logger=RecordingLogger()
        )


def test_layout_reasons_come_in_order_after_the_described_ones():
    assert bc_gate.layout_reasons(["a group"], block_aligned=False, worker_cls="x.Worker") == [
        "a group",
        "recurrent state is not kept block-aligned by this scheduler",
        "worker class x.Worker does not apply capture copies",
    ]
    assert bc_gate.layout_reasons([], block_aligned=True, worker_cls=PLUGIN_WORKER) == []


def test_an_unsupported_layout_falls_back_under_auto_and_is_refused_under_request_boundaries():
    logger = RecordingLogger()
    assert not bc_gate.decide_layout(
        BoundaryConfig(policy="auto"), ["a group"], block_aligned=True, worker_cls=PLUGIN_WORKER, logger=logger
    )
    assert logger.calls == [
        ("warning", "boundary_checkpoints: KV cache layout not supported: a group -> falling back to aligned retention")
    ]
    with pytest.raises(BoundaryConfigError) as info:
        bc_gate.decide_layout(
            BoundaryConfig(policy="request_boundaries"), [], block_aligned=True, worker_cls="x.Worker", logger=logger
        )
    assert str(info.value) == (
        "boundary_checkpoints: KV cache layout not supported: worker class x.Worker does not apply capture copies"
    )
