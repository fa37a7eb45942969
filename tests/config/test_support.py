"""The support matrix (``support.py``) is consistent with itself; the gate's tests
(``tests/config/test_gate.py``) check what it decides from it."""

from boundary_checkpoints import support


def test_every_supported_speculative_method_has_a_validated_k():
    assert set(support.VALIDATED_SPECULATIVE) == set(support.SUPPORTED_SPECULATIVE_METHODS)


def test_speculative_validation_is_on_validated_architectures():
    assert set(support.VALIDATED_SPECULATIVE_ARCHITECTURES) <= set(support.VALIDATED_ARCHITECTURES)


def test_failures_on_gpu_lookup():
    glm, method, smallest = next(iter(support.FAILED_ON_GPU))
    note = support.FAILED_ON_GPU[(glm, method, smallest)]
    assert support.failures_on_gpu([glm], method, smallest) == [note]
    assert support.failures_on_gpu(["Other", glm], method, smallest + 1) == [note]
    assert support.failures_on_gpu([glm], method, smallest - 1) == []
    assert support.failures_on_gpu([glm], "dflash", smallest) == []
    assert support.failures_on_gpu(["Other"], method, smallest) == []
