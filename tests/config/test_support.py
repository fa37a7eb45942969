"""The support matrix (``support.py``) is consistent with itself; the gate's tests
(``tests/config/test_gate.py``) check what it decides from it."""

from boundary_checkpoints import support


def test_every_supported_speculative_method_has_a_validated_k():
    assert set(support.VALIDATED_SPECULATIVE) == set(support.SUPPORTED_SPECULATIVE_METHODS)


def test_speculative_validation_is_on_validated_architectures():
    assert set(support.VALIDATED_SPECULATIVE_ARCHITECTURES) <= set(support.VALIDATED_ARCHITECTURES)
    for methods in support.VALIDATED_SPECULATIVE_ARCHITECTURES.values():
        assert methods and set(methods) <= set(support.SUPPORTED_SPECULATIVE_METHODS), methods


def test_speculative_validation_is_what_the_gpu_measured():
    """Qwen3-Next under MTP and DFlash (gpu-session8-h200.md), Nemotron-H under MTP
    (gpu-nemotron-mtp-h200.md); nothing else. Kimi-Linear has no MTP module in vLLM 0.32;
    GLM-5.3-Flash under MTP crashed twice at k = 3 (FAILED_ON_GPU)."""
    assert support.VALIDATED_SPECULATIVE_ARCHITECTURES == {
        "Qwen3NextForCausalLM": ("mtp", "dflash"),
        "NemotronHForCausalLM": ("mtp",),
    }
    assert support.speculative_architectures("mtp") == ["Qwen3NextForCausalLM", "NemotronHForCausalLM"]
    assert support.speculative_architectures("dflash") == ["Qwen3NextForCausalLM"]
    assert support.speculative_architectures(None) == []


def test_failures_on_gpu_lookup():
    glm, method, smallest = next(iter(support.FAILED_ON_GPU))
    note = support.FAILED_ON_GPU[(glm, method, smallest)]
    assert support.failures_on_gpu([glm], method, smallest) == [note]
    assert support.failures_on_gpu(["Other", glm], method, smallest + 1) == [note]
    assert support.failures_on_gpu([glm], method, smallest - 1) == []
    assert support.failures_on_gpu([glm], "dflash", smallest) == []
    assert support.failures_on_gpu(["Other"], method, smallest) == []
