"""The support matrix (``support.py``) is consistent with itself; the gate's tests
(``tests/config/test_gate_policy.py``, ``test_gate_speculative.py``) check what it decides from it."""

from boundary_checkpoints import support


def test_every_supported_speculative_method_has_a_validated_k():
    assert set(support.VALIDATED_SPECULATIVE) == set(support.SUPPORTED_SPECULATIVE_METHODS)


def test_speculative_validation_is_on_validated_architectures():
    assert set(support.VALIDATED_SPECULATIVE_ARCHITECTURES) <= set(support.VALIDATED_ARCHITECTURES)
    for methods in support.VALIDATED_SPECULATIVE_ARCHITECTURES.values():
        assert methods and set(methods) <= set(support.SUPPORTED_SPECULATIVE_METHODS), methods
        assert all(1 <= k <= support.VALIDATED_SPECULATIVE[method] for method, k in methods.items()), methods


def test_speculative_validation_is_what_the_gpu_measured():
    """Qwen3-Next under MTP and DFlash (gpu-session8-h200.md), Nemotron-H under MTP
    (gpu-nemotron-mtp-h200.md), GLM-5.3-Flash under MTP at k = 1 and 2 (gpu-glm-mtp-h200.md,
    gpu-prompt-end-keyed-h200.md; k = 3 only at the pool's unit, MATCH_UNIT_ONLY_K) and under DFlash2
    at k = 3 (gpu-glm-dflash-h200.md); nothing else. Kimi-Linear has no MTP module in vLLM 0.32."""
    assert support.VALIDATED_SPECULATIVE_ARCHITECTURES == {
        "Qwen3NextForCausalLM": {"mtp": 3, "dflash": 3},
        "NemotronHForCausalLM": {"mtp": 3},
        "Glm5NextForCausalLM": {"mtp": 2, "dflash": 3},
    }
    assert support.VALIDATED_SPECULATIVE == {"mtp": 3, "dflash": 3}
    assert support.speculative_architectures("mtp") == [
        "Qwen3NextForCausalLM", "NemotronHForCausalLM", "Glm5NextForCausalLM",
    ]  # fmt: skip
    assert support.speculative_architectures("dflash") == ["Qwen3NextForCausalLM", "Glm5NextForCausalLM"]
    assert support.speculative_architectures(None) == []


def test_largest_speculative_k_is_the_architectures_own():
    assert support.largest_speculative_k(["Glm5NextForCausalLM"], "mtp") == 2
    assert support.largest_speculative_k(["Other", "NemotronHForCausalLM"], "mtp") == 3
    assert support.largest_speculative_k(["Glm5NextForCausalLM"], "dflash") == 3
    assert support.largest_speculative_k(["NemotronHForCausalLM"], "dflash") == 0
    assert support.largest_speculative_k(["KimiLinearForCausalLM"], "mtp") == 0
    assert support.largest_speculative_k([], "mtp") == 0
    assert support.largest_speculative_k(["Qwen3NextForCausalLM"], None) == 0


def test_the_checkpoint_at_p_under_a_drafter_is_what_the_gpu_measured():
    """Qwen3-Next under MTP k = 1 and 3 (gpu-prompt-end-keyed-h200.md) and DFlash / DFlash2 k = 3,
    Nemotron-H under MTP k = 1 (gpu-spec-prompt-end-drafters-h100.md); nothing else, and never
    beyond what speculative decoding is validated at on that architecture."""
    assert support.PROMPT_END_SPECULATIVE == {
        "Qwen3NextForCausalLM": {"mtp": 3, "dflash": 3},
        "NemotronHForCausalLM": {"mtp": 1},
    }
    for arch, methods in support.PROMPT_END_SPECULATIVE.items():
        for method, k in methods.items():
            assert k <= support.VALIDATED_SPECULATIVE_ARCHITECTURES[arch][method], (arch, method)


def test_validated_for_every_architecture_checks_method_and_k():
    table = {"A": {"mtp": 3}, "B": {"mtp": 1, "dflash": 3}}
    check = support.validated_for_every_architecture
    assert check(table, ["A"], "mtp", 3) and check(table, ["A", "B"], "mtp", 1)
    assert not check(table, ["A"], "mtp", 4) and not check(table, ["A", "B"], "mtp", 2)
    assert not check(table, ["A"], "dflash", 1) and not check(table, [], "mtp", 1)
    assert not check(table, ["B"], None, 1)
    assert not check(table, ["C"], "mtp", 0) and not check(table, ["A", "C"], "mtp", 0)  # unlisted: never


def test_failures_on_gpu_lookup():
    glm, method, smallest = next(iter(support.FAILED_ON_GPU))
    note = support.FAILED_ON_GPU[(glm, method, smallest)]
    assert support.failures_on_gpu([glm], method, smallest) == [note]
    assert support.failures_on_gpu(["Other", glm], method, smallest + 1) == [note]
    assert support.failures_on_gpu([glm], method, smallest - 1) == []
    assert support.failures_on_gpu([glm], "dflash", smallest) == []
    assert support.failures_on_gpu(["Other"], method, smallest) == []


def test_k3_at_the_pools_unit_is_glm_under_mtp_alone():
    """GLM-5.3-Flash under MTP at k = 3 passed its GPU test at the pool's prefix match unit
    (gpu-glm-mtp-unit-h100.md), a k above its own validated 2 and within the GPU-wide 3."""
    assert support.MATCH_UNIT_ONLY_K == {("Glm5NextForCausalLM", "mtp"): 3}
    assert support.match_unit_only_k(["Glm5NextForCausalLM"], "mtp") == 3
    assert support.match_unit_only_k(["Glm5NextForCausalLM", "Other"], "mtp") == 0
    assert support.match_unit_only_k(["Glm5NextForCausalLM"], "dflash") == 0
    assert support.match_unit_only_k([], "mtp") == 0
    for (arch, method), k in support.MATCH_UNIT_ONLY_K.items():
        assert support.largest_speculative_k([arch], method) < k <= support.VALIDATED_SPECULATIVE[method]
        assert method in support.MATCH_UNIT_SPECULATIVE[arch]
