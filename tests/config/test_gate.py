"""The policy gate (``gate.py``) on SimpleNamespace fakes of VllmConfig, its log line, and the
plugin applying it (``plugin.apply_policy``)."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from boundary_checkpoints import gate as bc_gate
from boundary_checkpoints.gate import (
    GateDecision,
    decide_policy,
    log_decision_once,
    unsupported_reasons,
)
from boundary_checkpoints.settings import CONFIG_KEY, BoundaryConfig, BoundaryConfigError
from boundary_checkpoints.wiring import extends_boundary_scheduler

# --------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------


def supported_fake(**overrides) -> SimpleNamespace:
    """A VllmConfig look-alike on which boundary retention is supported; ``section__attr=value``
    keyword arguments override one attribute of one section."""
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(
            is_hybrid=True,
            enable_prompt_embeds=False,
            is_multimodal_model=False,
            multimodal_config=None,
            is_encoder_decoder=False,
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
        ),
        kv_transfer_config=None,
        speculative_config=None,
        lora_config=None,
    )
    for name, value in overrides.items():
        section, _, attr = name.partition("__")
        if attr:
            setattr(getattr(cfg, section), attr, value)
        else:
            setattr(cfg, section, value)
    return cfg


# (id, overrides, text the single reason must contain), in the gate's fixed order.
UNSUPPORTED = [
    ("not_hybrid", {"model_config__is_hybrid": False}, "no recurrent layers"),
    ("no_prefix_caching", {"cache_config__enable_prefix_caching": False}, "prefix caching is disabled"),
    ("mamba_mode_none", {"cache_config__mamba_cache_mode": "none"}, "mamba_cache_mode is 'none'"),
    ("kv_connector", {"kv_transfer_config": SimpleNamespace(kv_connector="X")}, "KV connector"),
    ("spec_decode", {"speculative_config": SimpleNamespace(method="eagle3")}, "speculative decoding method 'eagle3'"),
    ("pp", {"parallel_config__pipeline_parallel_size": 2}, "pipeline parallel size 2"),
    ("dp", {"parallel_config__data_parallel_size": 4}, "data parallel size 4"),
    ("pcp", {"parallel_config__prefill_context_parallel_size": 2}, "prefill context parallel size 2"),
    ("lora", {"lora_config": SimpleNamespace(max_loras=1)}, "LoRA"),
    ("prompt_embeds", {"model_config__enable_prompt_embeds": True}, "prompt embeddings"),
    ("multimodal", {"model_config__is_multimodal_model": True}, "multimodal inputs are not keyed"),
    ("encoder_decoder", {"model_config__is_encoder_decoder": True}, "encoder-decoder"),
]
UNSUPPORTED_IDS = [case[0] for case in UNSUPPORTED]


def test_supported_fake_has_no_reasons():
    assert unsupported_reasons(supported_fake()) == []


def test_auto_on_supported_enables():
    decision = decide_policy(BoundaryConfig(policy="auto"), supported_fake())
    assert decision == GateDecision("auto", True, ())
    assert decision.summary() == "boundary_checkpoints: policy=auto -> request_boundaries"


def test_request_boundaries_on_supported_enables():
    decision = decide_policy(BoundaryConfig(policy="request_boundaries"), supported_fake())
    assert decision.boundaries_enabled and decision.reasons == ()
    assert decision.summary() == "boundary_checkpoints: policy=request_boundaries -> request_boundaries"


@pytest.mark.parametrize(("case_id", "overrides", "text"), UNSUPPORTED, ids=UNSUPPORTED_IDS)
def test_each_reason_alone(case_id, overrides, text):
    reasons = unsupported_reasons(supported_fake(**overrides))
    assert len(reasons) == 1, reasons
    assert text in reasons[0]
    assert "\n" not in reasons[0] and len(reasons[0]) <= 120


@pytest.mark.parametrize(("case_id", "overrides", "text"), UNSUPPORTED, ids=UNSUPPORTED_IDS)
def test_each_reason_makes_auto_fall_back(case_id, overrides, text):
    decision = decide_policy(BoundaryConfig(policy="auto"), supported_fake(**overrides))
    assert decision.requested == "auto"
    assert not decision.boundaries_enabled
    assert len(decision.reasons) == 1 and text in decision.reasons[0]
    assert decision.summary().startswith("boundary_checkpoints: policy=auto -> aligned (fallback: ")
    assert decision.reasons[0] in decision.summary()


@pytest.mark.parametrize(("case_id", "overrides", "text"), UNSUPPORTED, ids=UNSUPPORTED_IDS)
def test_each_reason_makes_request_boundaries_raise(case_id, overrides, text):
    with pytest.raises(BoundaryConfigError) as info:
        decide_policy(BoundaryConfig(policy="request_boundaries"), supported_fake(**overrides))
    message = str(info.value)
    assert text in message
    assert "boundary_checkpoints.policy" in message


def all_unsupported_fake() -> SimpleNamespace:
    overrides: dict = {}
    for _, case_overrides, _ in UNSUPPORTED:
        overrides.update(case_overrides)
    # The mamba mode is only checked on a hybrid model with prefix caching on; every other reason
    # is independent, so this fake triggers all of them but that one.
    return supported_fake(**overrides)


def test_reasons_come_in_fixed_order():
    reasons = unsupported_reasons(all_unsupported_fake())
    expected = [text for case_id, _, text in UNSUPPORTED if case_id != "mamba_mode_none"]
    assert len(reasons) == len(expected)
    for reason, text in zip(reasons, expected):
        assert text in reason


def test_request_boundaries_error_lists_every_reason():
    fake = all_unsupported_fake()
    with pytest.raises(BoundaryConfigError) as info:
        decide_policy(BoundaryConfig(policy="request_boundaries"), fake)
    for reason in unsupported_reasons(fake):
        assert reason in str(info.value)


def test_mamba_mode_only_checked_for_hybrid_with_prefix_caching():
    assert unsupported_reasons(
        supported_fake(model_config__is_hybrid=False, cache_config__mamba_cache_mode="none")
    ) == ["model has no recurrent layers: nothing to checkpoint"]
    assert unsupported_reasons(
        supported_fake(cache_config__enable_prefix_caching=False, cache_config__mamba_cache_mode="none")
    ) == ["prefix caching is disabled"]


def test_language_model_only_multimodal_is_supported():
    fake = supported_fake(
        model_config__is_multimodal_model=True,
        model_config__multimodal_config=SimpleNamespace(language_model_only=True),
    )
    assert unsupported_reasons(fake) == []
    fake.model_config.multimodal_config.language_model_only = False
    assert unsupported_reasons(fake) == ["multimodal inputs are not keyed yet"]


def test_missing_and_none_attributes_are_tolerated():
    fake = supported_fake(
        parallel_config=SimpleNamespace(pipeline_parallel_size=None),
        cache_config__mamba_cache_mode=None,
    )
    del fake.kv_transfer_config, fake.speculative_config, fake.lora_config
    assert unsupported_reasons(fake) == ["mamba_cache_mode is None, not 'align'"]
    bare = SimpleNamespace(model_config=None, cache_config=None, parallel_config=None)
    assert unsupported_reasons(bare) == [
        "model has no recurrent layers: nothing to checkpoint",
        "prefix caching is disabled",
    ]


@pytest.mark.parametrize("fake", [supported_fake(), all_unsupported_fake()], ids=["supported", "unsupported"])
def test_aligned_never_raises_and_is_disabled(fake):
    decision = decide_policy(BoundaryConfig(policy="aligned"), fake)
    assert decision == GateDecision("aligned", False, ())
    assert decision.summary() == "boundary_checkpoints: policy=aligned -> aligned"


def test_summary_is_one_line_with_every_reason():
    fake = all_unsupported_fake()
    decision = decide_policy(BoundaryConfig(), fake)
    line = decision.summary()
    assert "\n" not in line
    assert line.startswith("boundary_checkpoints: policy=auto -> aligned (fallback: ")
    assert line.endswith(")")
    assert len(decision.reasons) == len(UNSUPPORTED) - 1
    for reason in decision.reasons:
        assert reason in line


def test_summary_example_from_the_brief():
    decision = decide_policy(
        BoundaryConfig(),
        supported_fake(speculative_config=SimpleNamespace(), lora_config=SimpleNamespace()),
    )
    assert decision.summary() == (
        "boundary_checkpoints: policy=auto -> aligned (fallback: speculative decoding method None "
        "is not supported (only single-module MTP and DFlash / DFlash2 are); LoRA adapters are part of the key but "
        "not supported yet)"
    )


def test_summary_stays_one_line_for_multiline_reasons():
    assert "\n" not in GateDecision("auto", False, ("a\nb", "c")).summary()


# --------------------------------------------------------------------------------------------------
# Logging once
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_log_memory(monkeypatch):
    monkeypatch.setattr(bc_gate, "_logged_summaries", set())


class RecordingLogger:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def info(self, msg, *args):
        self.calls.append(("info", msg % args))

    def warning(self, msg, *args):  # pragma: no cover - must not be used
        self.calls.append(("warning", msg % args))


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


def test_vllm_interface_mismatches_block_boundaries():
    """A vLLM whose internals differ from 0.32.0 falls back under auto and is refused under
    request_boundaries, naming the difference (``compat.interface_mismatches``)."""
    mismatch = ["installed vLLM differs from 0.32.0: Scheduler._free_request is missing"]
    fallback = decide_policy(BoundaryConfig(policy="auto"), supported_fake(), mismatch)
    assert not fallback.boundaries_enabled and fallback.reasons == tuple(mismatch)
    with pytest.raises(BoundaryConfigError, match="_free_request is missing"):
        decide_policy(BoundaryConfig(policy="request_boundaries"), supported_fake(), mismatch)


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


@pytest.mark.parametrize(
    "overrides, text",
    [
        ({"parallel_config__tensor_parallel_size": 2}, "tensor parallel size 2 is not validated yet"),
        ({"parallel_config__decode_context_parallel_size": 4}, "decode context parallel size 4 is not validated yet"),
    ],
    ids=["tp2", "dcp4"],
)
def test_unvalidated_layouts_fall_back_under_auto_and_run_when_asked_for(overrides, text):
    """Tensor and decode context parallelism are built for (whole-block copies on every rank) but
    not measured: auto falls back naming why, an explicit request_boundaries runs and says so."""
    fake = supported_fake(**overrides)
    assert unsupported_reasons(fake) == []
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert not auto.boundaries_enabled and len(auto.reasons) == 1 and text in auto.reasons[0]
    explicit = decide_policy(BoundaryConfig(policy="request_boundaries"), fake)
    assert explicit.boundaries_enabled and explicit.reasons == () and text in explicit.unvalidated[0]
    assert "not validated yet" in explicit.summary() and "-> request_boundaries" in explicit.summary()


def test_an_unsupported_feature_still_refuses_request_boundaries_on_an_unvalidated_layout():
    fake = supported_fake(parallel_config__decode_context_parallel_size=2, lora_config=SimpleNamespace())
    with pytest.raises(BoundaryConfigError, match="LoRA"):
        decide_policy(BoundaryConfig(policy="request_boundaries"), fake)


def test_an_unmeasured_model_architecture_falls_back_under_auto():
    fake = supported_fake()
    fake.model_config.architectures = ["GraniteMoeHybridForCausalLM"]
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert not auto.boundaries_enabled and "GraniteMoeHybridForCausalLM is not validated yet" in auto.reasons[0]
    assert decide_policy(BoundaryConfig(policy="request_boundaries"), fake).boundaries_enabled
    for measured in ("Qwen3NextForCausalLM", "NemotronHForCausalLM", "KimiLinearForCausalLM", "Glm5NextForCausalLM"):
        fake.model_config.architectures = [measured]
        assert decide_policy(BoundaryConfig(policy="auto"), fake).boundaries_enabled, measured


def mtp_fake(k: int = 1, lookahead: int = 1, **spec) -> SimpleNamespace:
    """A supported fake with MTP speculative decoding of ``k`` tokens (prefill lookahead
    ``lookahead``: 1 for single-module MTP, ``k`` for multi-module)."""
    fake = supported_fake(speculative_config=SimpleNamespace(method="mtp", num_speculative_tokens=k, **spec))
    fake.num_prefill_lookahead_tokens = lookahead
    return fake


def test_speculative_decoding_on_an_architecture_measured_only_without_it_falls_back_under_auto():
    """Kimi-Linear's restores were validated without drafts only: MTP on it falls back under
    ``auto`` with a reason naming the architecture and the ones measured with MTP; explicit
    ``request_boundaries`` runs. The same family without speculative decoding turns on."""
    fake = mtp_fake(1)
    fake.model_config.architectures = ["KimiLinearForCausalLM"]
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert not auto.boundaries_enabled, auto.summary()
    assert auto.reasons == (
        "speculative decoding (mtp) on KimiLinearForCausalLM is not validated yet "
        "(measured with it: Qwen3NextForCausalLM, NemotronHForCausalLM, Glm5NextForCausalLM)",
    )
    assert decide_policy(BoundaryConfig(policy="request_boundaries"), fake).boundaries_enabled
    fake.speculative_config = None
    assert decide_policy(BoundaryConfig(policy="auto"), fake).boundaries_enabled


@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "NemotronHForCausalLM"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_single_module_mtp_up_to_k3_on_a_measured_architecture_turns_on_under_auto(architecture, k):
    """Qwen3-Next and Nemotron-H under MTP were measured on a GPU with drafts accepted (Nemotron-H:
    docs/results/gpu-nemotron-mtp-h200.md): ``auto`` turns boundary retention on, with no reason."""
    fake = mtp_fake(k)
    fake.model_config.architectures = [architecture]
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert auto.boundaries_enabled and auto.reasons == () and auto.unvalidated == (), auto.summary()
    assert auto.summary() == "boundary_checkpoints: policy=auto -> request_boundaries"


def test_nemotron_h_under_mtp_above_k3_is_unvalidated():
    fake = mtp_fake(4)
    fake.model_config.architectures = ["NemotronHForCausalLM"]
    check_unvalidated_above_k3(fake, "mtp", 4)


def test_dflash_on_an_architecture_validated_under_mtp_only_falls_back_under_auto():
    """Nemotron-H is validated under MTP only: a DFlash drafter on it (vLLM's Nemotron-H takes
    EAGLE-3 style drafters) falls back under ``auto`` naming the architectures measured with
    DFlash, nothing refuses it, and an explicit ``request_boundaries`` runs. Qwen3-Next and
    GLM-5.3-Flash with the same drafter turn on."""
    fake = dflash_fake(3)
    fake.model_config.architectures = ["NemotronHForCausalLM"]
    assert unsupported_reasons(fake) == []
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert not auto.boundaries_enabled
    assert auto.reasons == (
        "speculative decoding (dflash) on NemotronHForCausalLM is not validated yet "
        "(measured with it: Qwen3NextForCausalLM, Glm5NextForCausalLM)",
    )
    assert decide_policy(BoundaryConfig(policy="request_boundaries"), fake).boundaries_enabled
    for validated in ("Qwen3NextForCausalLM", "Glm5NextForCausalLM"):
        fake.model_config.architectures = [validated]
        auto = decide_policy(BoundaryConfig(policy="auto"), fake)
        assert auto.boundaries_enabled and auto.reasons == () and auto.unvalidated == (), auto.summary()


@pytest.mark.parametrize("k", [1, 2])
def test_glm_under_mtp_up_to_k2_turns_on_under_auto(k):
    """GLM-5.3-Flash under MTP at k = 1 and 2 passed the GPU test with drafts accepted
    (docs/results/gpu-glm-mtp-h200.md, gpu-prompt-end-keyed-h200.md): ``auto`` turns boundary
    retention on, with no reason."""
    fake = mtp_fake(k)
    fake.model_config.architectures = ["Glm5NextForCausalLM"]
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert auto.boundaries_enabled and auto.reasons == () and auto.unvalidated == (), auto.summary()


def test_glm_under_mtp_k3_is_left_to_the_scheduler_which_needs_the_pool_as_vllms_unit():
    """At k = 3 GLM-5.3-Flash under MTP passes its GPU test only with the indexer's pool as vLLM's
    prefix match unit (gpu-glm-mtp-unit-h100.md); at vLLM's block unit it takes the engine down on a
    vLLM assert. The config gate turns it on; the scheduler's layout reason (``match_unit_reasons``)
    refuses it where vLLM keeps no prompt state on the pool grid, with the GPU note. Nemotron-H's
    k = 3, GLM's k = 2 and GLM's k = 4 never get that reason."""
    k = 3
    fake = mtp_fake(k)
    fake.model_config.architectures = ["Glm5NextForCausalLM"]
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert auto.boundaries_enabled and auto.reasons == () and auto.unvalidated == (), auto.summary()
    assert bc_gate.match_unit_reasons(fake, vllm_keeps_prompts_on_grid=True) == []
    (reason,) = bc_gate.match_unit_reasons(fake, vllm_keeps_prompts_on_grid=False)
    assert reason.startswith(
        f"speculative decoding (mtp, k={k}) on Glm5NextForCausalLM is validated only with the indexer's pool "
        "as vLLM's prefix match unit, which this engine does not run"
    ), reason
    assert "takes the engine down" in reason and "stock vLLM 0.32.0 gets through that batch" in reason
    logger = RecordingLogger()
    assert not bc_gate.decide_layout(
        BoundaryConfig(policy="auto"), [reason], block_aligned=True, worker_cls=PLUGIN_WORKER, logger=logger
    )
    with pytest.raises(BoundaryConfigError, match="takes the engine down"):
        bc_gate.decide_layout(
            BoundaryConfig(policy="request_boundaries"), [reason], block_aligned=True, worker_cls=PLUGIN_WORKER,
            logger=logger,
        )  # fmt: skip
    for architecture, other_k in (("NemotronHForCausalLM", 3), ("Glm5NextForCausalLM", 2), ("Glm5NextForCausalLM", 4)):
        other = mtp_fake(other_k)
        other.model_config.architectures = [architecture]
        assert bc_gate.match_unit_reasons(other, vllm_keeps_prompts_on_grid=False) == [], (architecture, other_k)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_single_module_mtp_up_to_k3_turns_on_under_auto(k):
    """Single-module MTP with k <= 3 (measured on a GPU with drafts accepted) is validated:
    auto turns boundary retention on, with no reason."""
    auto = decide_policy(BoundaryConfig(policy="auto"), mtp_fake(k))
    assert auto.boundaries_enabled and auto.reasons == () and auto.unvalidated == ()


@pytest.mark.parametrize("k", [4, 8])
def test_single_module_mtp_above_k3_is_unvalidated(k):
    """Larger k is in the unvalidated tier: auto falls back naming the measured range, an explicit
    request_boundaries runs and says so."""
    check_unvalidated_above_k3(mtp_fake(k), "mtp", k)


def check_unvalidated_above_k3(fake, method: str, k: int) -> None:
    """``auto`` falls back naming the measured range; an explicit ``request_boundaries`` runs and
    says so."""
    assert unsupported_reasons(fake) == []
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert not auto.boundaries_enabled and auto.reasons == (
        f"speculative decoding ({method}, k={k}) is measured up to k=3, not validated on GPU",
    )
    explicit = decide_policy(BoundaryConfig(policy="request_boundaries"), fake)
    assert explicit.boundaries_enabled and "measured up to k=3, not validated on GPU" in explicit.summary()


def dflash_fake(k: int = 3, architecture: str = "DFlashDraftModel", **spec) -> SimpleNamespace:
    """A supported fake with a DFlash drafter of ``architecture`` drafting ``k`` tokens (prefill
    lookahead 1, as vLLM gives every EAGLE-family drafter but multi-module MTP)."""
    drafter = SimpleNamespace(architectures=[architecture])
    spec_config = SimpleNamespace(method="dflash", num_speculative_tokens=k, draft_model_config=drafter, **spec)
    fake = supported_fake(speculative_config=spec_config)
    fake.num_prefill_lookahead_tokens = 1
    return fake


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
@pytest.mark.parametrize("k", [1, 3])
def test_dflash_drafters_up_to_k3_turn_on_under_auto(architecture, k):
    """DFlash and DFlash2 with k <= 3 (measured on a GPU with a planted drafter whose drafts are
    accepted) are validated: auto turns boundary retention on, with no reason."""
    auto = decide_policy(BoundaryConfig(policy="auto"), dflash_fake(k, architecture))
    assert auto.boundaries_enabled and auto.reasons == () and auto.unvalidated == ()


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
@pytest.mark.parametrize("k", [4, 15])
def test_dflash_drafters_above_k3_are_unvalidated(architecture, k):
    """Larger k is in the unvalidated tier (like single-module MTP): auto falls back naming the
    measured range, an explicit request_boundaries runs and says so."""
    check_unvalidated_above_k3(dflash_fake(k, architecture), "dflash", k)


@pytest.mark.parametrize(
    "fake, text",
    [
        (mtp_fake(2, lookahead=2), "multi-module MTP (prefill lookahead 2 > 1) livelocks the P - 1 chunk stop"),
        (mtp_fake(2, num_speculative_tokens_per_batch_size=[(1, 8, 2)]), "dynamic speculative decoding"),
        (dflash_fake(3, "LiLiCorrDraftModel"), "DFlash drafter architecture LiLiCorrDraftModel is not supported"),
        (supported_fake(speculative_config=SimpleNamespace(method="dflash")), "DFlash drafter architecture unknown"),
        (dflash_fake(3, enable_adaptive_verification=True), "adaptive verification (enable_adaptive_verification)"),
        (dflash_fake(3, num_speculative_tokens_per_batch_size=[(1, 8, 3)]), "dynamic speculative decoding"),
        (supported_fake(speculative_config=SimpleNamespace(method="eagle3")), "method 'eagle3' is not supported"),
        (supported_fake(speculative_config=SimpleNamespace(method="ngram")), "method 'ngram' is not supported"),
    ],
    ids=[
        "multi_module_mtp",
        "dynamic",
        "lilicorr",
        "dflash_no_drafter",
        "dflash_adaptive",
        "dflash_dynamic",
        "eagle3",
        "ngram",
    ],
)
def test_speculative_configs_that_cannot_work_are_refused(fake, text):
    """Refused at startup under request_boundaries, naming the reason; auto falls back with it."""
    with pytest.raises(BoundaryConfigError, match=re.escape(text)):
        decide_policy(BoundaryConfig(policy="request_boundaries"), fake)
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert not auto.boundaries_enabled and any(text in reason for reason in auto.reasons)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_with_a_pooled_indexer_is_not_refused(k):
    """GLM-5.3-Flash (``index_kpool`` > 1) under MTP: the scheduler keeps its checkpoints on the
    pool grid (``docs/design.md`` contract 13), so nothing refuses the layout: ``auto`` turns on
    (k = 3 left to the scheduler's unit check), and an explicit ``request_boundaries`` runs."""
    fake = mtp_fake(k)
    fake.model_config.architectures = ["Glm5NextForCausalLM"]
    fake.model_config.hf_text_config = SimpleNamespace(index_kpool=4)
    assert unsupported_reasons(fake) == []
    auto = decide_policy(BoundaryConfig(policy="auto"), fake)
    assert auto.boundaries_enabled and auto.reasons == (), auto.summary()
    assert decide_policy(BoundaryConfig(policy="request_boundaries"), fake).boundaries_enabled


# --------------------------------------------------------------------------------------------------
# The layout gate (what the scheduler learns once the KV cache exists)
# --------------------------------------------------------------------------------------------------

PLUGIN_WORKER = "boundary_checkpoints.worker.cpu.BoundaryCPUWorker"


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
