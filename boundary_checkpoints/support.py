"""The support matrix: which model families and features boundary retention is validated on, which
it refuses, and why. Data and lookups only.

Contract
--------
* Nothing here decides a policy or reads a ``VllmConfig``: :mod:`boundary_checkpoints.gate` turns
  these tables into reasons. Reasons are stated as they stand now; the measurements behind them are
  listed in ``docs/compatibility.md`` and ``docs/results/``.
* Imports nothing (not vLLM, not the plugin).
"""

from __future__ import annotations

from collections.abc import Iterable

# ---- refused (the gate's unsupported reasons) ------------------------------------------------

# Speculative decoding methods boundary retention works with: single-module MTP and DFlash (other
# methods -- EAGLE, ngram, draft models -- are not run with the plugin).
SUPPORTED_SPECULATIVE_METHODS = ("mtp", "dflash")
# DFlash drafters whose KV cache the plugin's notes cover (docs/notes/spec-decode.md §11): vLLM's
# Qwen3 DFlash and DFlash2 classes. Other architectures under method "dflash" (LiLiCorr, Laguna,
# Muse Glimmer) are other speculators or models, not read.
SUPPORTED_DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# Parallel layouts that are refused: (``parallel_config`` attribute, label) for a size above 1.
UNSUPPORTED_PARALLEL_SIZES = (
    ("pipeline_parallel_size", "pipeline parallel"),
    ("data_parallel_size", "data parallel"),
    ("prefill_context_parallel_size", "prefill context parallel"),
)

# ---- validated (anything supported but not listed here is the gate's unvalidated tier) --------

# Model architectures whose boundaries are validated end to end on a GPU (docs/compatibility.md).
VALIDATED_ARCHITECTURES = (
    "Qwen3NextForCausalLM", "NemotronHForCausalLM", "KimiLinearForCausalLM", "Glm5NextForCausalLM",
)  # fmt: skip
# Of the validated architectures, the ones validated under speculative decoding with drafts
# accepted, each with the methods it was measured with and the largest k measured on it:
# Qwen3-Next under MTP and DFlash / DFlash2; Nemotron-H under MTP, k = 1 and 3 with a planted MTP
# layer (docs/results/gpu-nemotron-mtp-h200.md); GLM-5.3-Flash under MTP at k = 1 and 2 with a
# planted MTP layer (docs/results/gpu-glm-mtp-h200.md, gpu-prompt-end-keyed-h200.md; k = 3 only at
# the pool's prefix match unit, MATCH_UNIT_ONLY_K, else a vLLM assert, FAILED_ON_GPU) and under
# a DFlash2 drafter at k = 3 (docs/results/gpu-glm-dflash-h200.md).
# Nemotron-H under DFlash has not run; vLLM 0.32 has no MTP module for Kimi-Linear (its
# ``kimi_k3_mtp`` is Kimi-K3's).
VALIDATED_SPECULATIVE_ARCHITECTURES: dict[str, dict[str, int]] = {
    "Qwen3NextForCausalLM": {"mtp": 3, "dflash": 3},
    "NemotronHForCausalLM": {"mtp": 3},
    "Glm5NextForCausalLM": {"mtp": 2, "dflash": 3},
}
# Supported speculative methods validated on a GPU with drafts accepted, each with the largest k
# validated on any architecture (single-module MTP at k 1 and 3; DFlash and DFlash2 drafters at k 3).
VALIDATED_SPECULATIVE = {
    method: max(methods.get(method, 0) for methods in VALIDATED_SPECULATIVE_ARCHITECTURES.values())
    for method in SUPPORTED_SPECULATIVE_METHODS
}
# Where ``prompt_capture: auto`` takes the checkpoint at P under a drafter (no P - 1 stop):
# architecture -> method -> the largest k whose GPU test (tests/gpu/test_gpu_spec_prompt_end.py)
# passed. Qwen3-Next under MTP k = 1 and 3 (docs/results/gpu-prompt-end-keyed-h200.md) and under
# DFlash and DFlash2 k = 3; Nemotron-H under MTP k = 1: at k = 3 its fixture forgets a one-token-off
# state within the prompt's tail, so the negative control tells none apart
# (docs/results/gpu-spec-prompt-end-drafters-h100.md).
PROMPT_END_SPECULATIVE: dict[str, dict[str, int]] = {
    "Qwen3NextForCausalLM": {"mtp": 3, "dflash": 3},
    "NemotronHForCausalLM": {"mtp": 1},
}
# Where ``policy: auto`` gives vLLM the indexer's pool as its prefix match unit (``match_unit.py``):
# the architecture and method pairs whose GPU exactness run at that unit, drafts accepted, passes
# every check of its test. GLM-5.3-Flash under MTP at k = 1, 2 and 3 (docs/results/gpu-glm-mtp-unit-h100.md).
# An explicit ``request_boundaries`` chooses it on any pair.
MATCH_UNIT_SPECULATIVE: dict[str, tuple[str, ...]] = {"Glm5NextForCausalLM": ("mtp",)}
# Where a larger k than the architecture's own is validated only with the indexer's pool as vLLM's
# prefix match unit (``match_unit.py``: vLLM keeps each prompt's state on the pool grid, the plugin
# runs no pool-grid stop): (architecture, method) -> the largest such k. GLM-5.3-Flash under MTP
# at k = 3 passes every check of its GPU test at that unit (docs/results/gpu-glm-mtp-unit-h100.md)
# and ran 15 rounds at real dims there without an assert (gpu-glm-unit16-h100.md). The scheduler
# checks the unit once the KV cache exists (``gate.match_unit_reasons``).
MATCH_UNIT_ONLY_K: dict[tuple[str, str], int] = {("Glm5NextForCausalLM", "mtp"): 3}
# Speculative combinations known to fail on a GPU: (architecture, method, smallest k the note
# covers) -> what happens, added to the reason ``auto`` falls back with and to the decision line
# of an explicit ``request_boundaries``.
FAILED_ON_GPU = {
    ("Glm5NextForCausalLM", "mtp", 3): (
        "at vLLM's block unit (the plugin's pool-grid stop) k = 3 takes the engine down in the first batch of "
        "the exactness test's probes (a device-side index assert in vLLM's indexer path); stock vLLM 0.32.0 gets "
        "through that batch but dies on the same assert once its own batch holds prefill rows of 2-3 tokens "
        "beside verify rows (k = 1 and 2 pass; k = 3 passes with the indexer's pool as vLLM's prefix match unit)"
    ),
}


def lists_every_architecture(
    table: dict[str, tuple[str, ...]], architectures: Iterable[str], method: str | None
) -> bool:
    """Whether ``table`` (architecture -> speculative methods validated for a path, such as
    :data:`MATCH_UNIT_SPECULATIVE`) lists ``method`` for every one of ``architectures`` (none: False)."""
    architectures = list(architectures)
    return bool(architectures) and all(method in table.get(arch, ()) for arch in architectures)


def validated_for_every_architecture(
    table: dict[str, dict[str, int]], architectures: Iterable[str], method: str | None, k: int
) -> bool:
    """Whether ``table`` (architecture -> method -> largest k validated, such as
    :data:`PROMPT_END_SPECULATIVE`) validates ``method`` with ``k`` drafts on every one of
    ``architectures`` (none: False)."""
    limits = [table.get(arch, {}).get(method or "") for arch in architectures]
    return bool(limits) and all(limit is not None and k <= limit for limit in limits)


def speculative_architectures(method: str | None) -> list[str]:
    """The architectures of :data:`VALIDATED_SPECULATIVE_ARCHITECTURES` validated under ``method``,
    in table order."""
    return [arch for arch, methods in VALIDATED_SPECULATIVE_ARCHITECTURES.items() if method in methods]


def largest_speculative_k(architectures: Iterable[str], method: str | None) -> int:
    """The largest ``k`` validated under ``method`` on any of ``architectures`` (0 if none)."""
    measured = [VALIDATED_SPECULATIVE_ARCHITECTURES.get(arch, {}).get(method or "", 0) for arch in architectures]
    return max(measured, default=0)


def match_unit_only_k(architectures: Iterable[str], method: str | None) -> int:
    """The largest ``k`` :data:`MATCH_UNIT_ONLY_K` validates under ``method`` for every one of
    ``architectures`` at the pool's prefix match unit (0 if none)."""
    found = [MATCH_UNIT_ONLY_K.get((arch, method or ""), 0) for arch in architectures]
    return min(found, default=0)


def failures_on_gpu(architectures: Iterable[str], method: str | None, k: int) -> list[str]:
    """The :data:`FAILED_ON_GPU` notes for any of ``architectures`` under ``method`` with ``k``
    drafts, in table order."""
    architectures = list(architectures)
    return [
        what for (arch, failed_method, smallest), what in FAILED_ON_GPU.items()
        if arch in architectures and failed_method == method and k >= smallest
    ]  # fmt: skip
