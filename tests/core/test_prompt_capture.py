"""The per-engine choice between in-step prompt capture and the ``P - 1`` stop
(``boundary_checkpoints/prompt_capture.py``): pure decisions on facts, and the facts of real
``VllmConfig`` objects on this (CPU) machine."""

from __future__ import annotations

import pytest

from boundary_checkpoints import support
from boundary_checkpoints.prompt_capture import (
    AUTO,
    CUDA_IN_STEP_CAVEAT,
    END,
    IN_STEP,
    OFF,
    POOL_GRID_REASON,
    STOP,
    EngineFacts,
    PromptCaptureDecision,
    decide,
    decide_for,
    facts_of,
    on_pool_grid,
    speculative_auto_reason,
)
from boundary_checkpoints.settings import BoundaryConfig
from boundary_checkpoints.support import PROMPT_END_SPECULATIVE

SUPPORTED = dict(platform="cuda", gdn_prefill_backend="triton", architectures=("Qwen3NextForCausalLM",),
                 speculative=False, micro_batching=False)  # fmt: skip


def facts(**overrides) -> EngineFacts:
    return EngineFacts(**{**SUPPORTED, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"platform": "cpu", "gdn_prefill_backend": None}, {"architectures": ("Qwen3_5MoeForCausalLM",)}],
)
def test_in_step_where_the_split_knows_the_layers_and_kernels(overrides):
    decision = decide(True, "in_step", facts(**overrides))
    assert (decision.mode, decision.reason) == (IN_STEP, "")
    assert "no P - 1 stop" in decision.describe()
    # on CUDA the startup line says what is not validated there
    assert (
        (CUDA_IN_STEP_CAVEAT in decision.describe())
        == (decision.caveat != "")
        == (overrides.get("platform", "cuda") == "cuda")
    )


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"gdn_prefill_backend": "flashinfer"}, "GDN prefill backend flashinfer"),
        ({"gdn_prefill_backend": "cutedsl"}, "GDN prefill backend cutedsl"),
        ({"platform": "rocm", "gdn_prefill_backend": None}, "platform rocm"),
        ({"platform": "xpu", "gdn_prefill_backend": None}, "platform xpu"),
        ({"architectures": ("Glm5NextForCausalLM",)}, "Glm5NextForCausalLM"),
        ({"architectures": ("KimiLinearForCausalLM",)}, "KimiLinearForCausalLM"),
        ({"architectures": ("NemotronHForCausalLM",)}, "NemotronHForCausalLM"),
        ({"architectures": ()}, "(none)"),
        ({"speculative": True}, "speculative decoding"),
        ({"micro_batching": True}, "micro-batching"),
        ({"full_graphs_for_prefills": True}, "cudagraph_mode FULL"),
    ],
)
def test_anything_else_stops_at_p_minus_1_and_says_why(overrides, reason):
    decision = decide(True, "in_step", facts(**overrides))
    assert decision.mode == STOP and reason in decision.reason
    assert decision.describe() == f"on (prefills stop at P - 1: {decision.reason})"


def test_auto_keeps_the_prompt_checkpoint_at_p_and_a_resends_at_p_minus_1_as_in_step_would():
    """``auto`` (the default) decides as ``end`` wherever no drafter runs; a resend's ``P - 1`` is
    taken as ``in_step`` decides: in step on the CPU kernels and on CUDA with the FLA Triton
    kernel, by the stop on vLLM's Hopper default, FlashInfer (the reason names the setting)."""
    cpu = decide(True, AUTO, facts(platform="cpu", gdn_prefill_backend=None))
    assert (cpu.mode, cpu.resend, cpu.splits_in_step) == (END, IN_STEP, True)
    assert decide(True, AUTO, facts()) == decide(True, END, facts())
    assert decide(True, AUTO, facts()).caveat == CUDA_IN_STEP_CAVEAT
    decision = decide(True, AUTO, facts(gdn_prefill_backend="flashinfer"))
    assert (decision.mode, decision.resend, decision.splits_in_step) == (END, STOP, False)
    assert "gdn_prefill_backend=triton" in decision.reason and "by the P - 1 stop" in decision.describe()
    nemotron = ("NemotronHForCausalLM",)
    drafted = facts(speculative=True, speculative_method="dflash", speculative_k=3, architectures=nemotron)
    speculative = decide(True, AUTO, drafted)
    assert (speculative.mode, speculative.reason) == (STOP, speculative_auto_reason())
    assert "on a GPU it is validated under" in speculative.describe()


VALIDATED_AT_P = {"Qwen3NextForCausalLM": {"mtp": 3}, "NemotronHForCausalLM": {"mtp": 1}}


def at_p(architecture: str, method: str, k: int) -> bool:
    return k <= VALIDATED_AT_P.get(architecture, {}).get(method, 0)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", ["mtp", "dflash"])
@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "NemotronHForCausalLM", "Glm5NextForCausalLM"])
def test_auto_under_a_drafter_takes_p_only_where_a_gpu_validated_it(monkeypatch, architecture, method, k):
    """Under a drafter ``auto`` takes the checkpoint at P exactly for the pairs and k of
    ``PROMPT_END_SPECULATIVE``; elsewhere it stops at P - 1 and the reason names the pairs."""
    monkeypatch.setattr(support, "PROMPT_END_SPECULATIVE", VALIDATED_AT_P)
    drafted = facts(speculative=True, speculative_method=method, speculative_k=k, architectures=(architecture,))
    decision = decide(True, AUTO, drafted)
    if at_p(architecture, method, k):
        assert (decision.mode, decision.resend) == (END, STOP) and "speculative" in decision.reason
    else:
        assert (decision.mode, decision.reason) == (STOP, speculative_auto_reason())
        pairs = "mtp up to k = 3 on Qwen3NextForCausalLM, mtp up to k = 1 on NemotronHForCausalLM"
        assert f"validated under {pairs})" in decision.reason
    both = ("Qwen3NextForCausalLM", architecture)
    mixed = facts(speculative=True, speculative_method=method, speculative_k=k, architectures=both)
    assert (decide(True, AUTO, mixed).mode == END) == all(at_p(arch, method, k) for arch in both)


def test_configured_stop_and_off():
    assert decide(True, "stop", facts()).mode == STOP
    assert decide(False, "in_step", facts()).mode == OFF
    assert decide(False, "in_step", facts()).describe() == "off"


def real_config(model_dir, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=1024, **engine_args
    ).create_engine_config()


def test_real_cpu_configs(model_dir):
    """This machine's vLLM (CPU platform) on the Qwen3-Next config: at P by default (a resend in
    step), in step when configured, the stop under MTP speculative decoding or when configured."""
    config = BoundaryConfig()
    assert decide_for(config, real_config(model_dir)).mode == END
    assert decide_for(BoundaryConfig(prompt_capture="in_step"), real_config(model_dir)).mode == IN_STEP
    mtp = real_config(model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert (facts_of(mtp).speculative_method, facts_of(mtp).speculative_k) == ("mtp", 1)
    expected = END if PROMPT_END_SPECULATIVE.get("Qwen3NextForCausalLM", {}).get("mtp", 0) >= 1 else STOP
    assert decide_for(config, mtp).mode == expected
    at_end = decide_for(BoundaryConfig(prompt_capture="end"), mtp)
    assert (at_end.mode, at_end.resend) == (END, STOP) and "speculative" in at_end.reason
    assert decide_for(BoundaryConfig(prompt_capture="stop"), mtp).mode == STOP
    assert decide_for(BoundaryConfig(prompt_capture="stop"), real_config(model_dir)).mode == STOP


GRAPH_MODES = [("FULL", True), ("FULL_AND_PIECEWISE", False), ("FULL_DECODE_ONLY", False), ("PIECEWISE", False),
               ("NONE", False)]  # fmt: skip


@pytest.mark.parametrize(("mode", "full"), GRAPH_MODES)
def test_which_graph_modes_replay_prefill_steps_whole(mode, full):
    """Only ``cudagraph_mode`` FULL replays a batch with prefills from a whole graph (vLLM's own
    ``CUDAGraphMode.mixed_mode``), where the GDN layers' Python forward -- the split -- does not run."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from boundary_checkpoints.compat import mixed_batches_replay_full_graphs

    config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]))
    assert mixed_batches_replay_full_graphs(config) is full
    assert mixed_batches_replay_full_graphs(SimpleNamespace()) is False


@pytest.mark.parametrize(
    "overrides",
    [{}, {"gdn_prefill_backend": "flashinfer"}, {"architectures": ("KimiLinearForCausalLM",)}, {"platform": "cpu"},
     {"full_graphs_for_prefills": True}, {"micro_batching": True}],
)  # fmt: skip
def test_end_needs_no_split_so_any_kernel_and_family_takes_it(overrides):
    decision = decide(True, "end", facts(**overrides))
    assert decision.mode == END and "no extra step" in decision.describe()
    assert decision.resend == decide(True, "in_step", facts(**overrides)).mode  # a resend's P - 1, as in_step takes it


def test_end_under_speculative_decoding_keeps_p_and_a_resends_p_minus_1_by_the_stop():
    """Under speculative decoding ``end`` keeps a fresh prompt's checkpoint at ``P`` too (the
    scheduler guards it with the first sampled token under MTP); a resend keeps ``P - 1`` by the
    stop, since the in-step split handles non-speculative rows only, and the startup line says so.
    ``stop`` and ``in_step`` asked for explicitly stop at ``P - 1``."""
    decision = decide(True, END, facts(speculative=True))
    assert (decision.mode, decision.resend, decision.splits_in_step) == (END, STOP, False)
    assert "speculative decoding" in decision.reason and "drafter" not in decision.reason
    text = decision.describe()
    assert "at the prompt's end P" in text and "no extra step" in text and "by the P - 1 stop" in text
    assert decide(True, STOP, facts(speculative=True)).mode == STOP
    in_step = decide(True, IN_STEP, facts(speculative=True))
    assert in_step.mode == STOP and "speculative decoding" in in_step.reason
    assert decide(False, END, facts(speculative=True)).mode == OFF


@pytest.mark.parametrize("asked", [AUTO, END, STOP, IN_STEP])
def test_a_pooled_indexer_under_speculative_decoding_stops_every_prompt_on_its_grid(asked):
    """A pooled indexer under speculative decoding (GLM-5.3-Flash): every checkpoint sits on its
    pool grid, which ``P`` rarely is, so every prompt stops on the grid below ``P - 1`` whatever
    was asked (a next turn restores that checkpoint there); off stays off."""
    grid = on_pool_grid(decide(True, asked, facts(speculative=True)))
    assert grid == PromptCaptureDecision(STOP, POOL_GRID_REASON)
    assert on_pool_grid(decide(False, asked, facts(speculative=True))).mode == OFF
