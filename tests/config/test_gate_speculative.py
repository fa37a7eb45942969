"""Speculative decoding through the policy gate (``gate.py``: ``speculative_reasons``,
``unvalidated_reasons``, ``match_unit_reasons``): single-module MTP and DFlash / DFlash2 tiers by
``k`` and by target architecture (validated, unvalidated, refused), and GLM-5.3-Flash's pooled
indexer, on ``SimpleNamespace`` fakes of VllmConfig."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from gate_fakes import PLUGIN_WORKER, RecordingLogger, supported_fake

from boundary_checkpoints import gate as bc_gate
from boundary_checkpoints.gate import decide_policy, unsupported_reasons
from boundary_checkpoints.settings import BoundaryConfig, BoundaryConfigError


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
