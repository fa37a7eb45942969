"""Policy resolution (``gate.py``: ``unsupported_reasons``, ``decide_policy``, ``GateDecision``) on
``SimpleNamespace`` fakes of VllmConfig: each unsupported feature alone and all together, in a fixed
order; ``auto`` falling back, ``request_boundaries`` refusing, ``aligned`` never raising; the one-line
summary; vLLM interface mismatches as reasons; layouts and architectures not validated yet."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gate_fakes import supported_fake

from boundary_checkpoints.gate import GateDecision, decide_policy, unsupported_reasons
from boundary_checkpoints.settings import BoundaryConfig, BoundaryConfigError

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


def test_vllm_interface_mismatches_block_boundaries():
    """A vLLM whose internals differ from 0.32.0 falls back under auto and is refused under
    request_boundaries, naming the difference (``compat.interface_mismatches``)."""
    mismatch = ["installed vLLM differs from 0.32.0: Scheduler._free_request is missing"]
    fallback = decide_policy(BoundaryConfig(policy="auto"), supported_fake(), mismatch)
    assert not fallback.boundaries_enabled and fallback.reasons == tuple(mismatch)
    with pytest.raises(BoundaryConfigError, match="_free_request is missing"):
        decide_policy(BoundaryConfig(policy="request_boundaries"), supported_fake(), mismatch)


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
