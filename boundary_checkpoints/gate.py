"""The policy gate: whether boundary retention runs on an engine, and why not.

Contract
--------
* ``unsupported_reasons(vllm_config)`` is a pure function of a ``VllmConfig``-like object (attribute
  access only, missing or ``None`` attributes are tolerated): it lists, in a fixed order, one short
  human clause per feature that boundary retention does not support.
  ``unvalidated_reasons(vllm_config)`` lists the layouts it is built for but has not been
  measured on (model architectures other than the measured ones, tensor parallel, decode context
  parallel, single-module MTP and DFlash above ``k = 3``, a speculative method on an architecture
  not measured with it: not validated on GPU). The tables behind
  both are :mod:`boundary_checkpoints.support`; the plugin's own classes are
  :mod:`boundary_checkpoints.wiring` (a configured ``scheduler_cls`` that subclasses the plugin's
  ``BoundaryCheckpointMixin`` is kept; any other custom scheduler class is a reason against).
* ``decide_policy(config, vllm_config)`` turns the requested policy into a ``GateDecision``:
  ``aligned`` is stock vLLM (never raises), ``auto`` enables boundary retention only when no reason
  of either kind applies and otherwise falls back to ``aligned`` with the reasons,
  ``request_boundaries`` raises ``BoundaryConfigError`` listing every unsupported reason and
  otherwise enables it, also on an unvalidated layout (named in the decision line).
* ``decide_layout(config, reasons, ...)`` is the same rule for what only the scheduler knows, once
  the KV cache exists (its groups, block alignment, the worker class): ``True`` when nothing stands
  against boundary retention; otherwise ``request_boundaries`` raises and ``auto`` falls back with
  a warning. ``match_unit_reasons`` is one such reason: a speculative ``k`` validated only with the
  indexer's pool as vLLM's prefix match unit, on an engine that does not run that unit.
* ``log_decision_once(decision, logger)`` logs the one-line summary at INFO once per process per
  distinct summary.

Nothing here imports vLLM, nor the plugin's scheduler, worker or metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from boundary_checkpoints.settings import CONFIG_KEY, POLICIES, BoundaryConfig, BoundaryConfigError, qualified
from boundary_checkpoints.support import (
    SUPPORTED_DFLASH_ARCHITECTURES,
    SUPPORTED_SPECULATIVE_METHODS,
    UNSUPPORTED_PARALLEL_SIZES,
    VALIDATED_ARCHITECTURES,
    VALIDATED_SPECULATIVE,
    failures_on_gpu,
    largest_speculative_k,
    match_unit_only_k,
    speculative_architectures,
)
from boundary_checkpoints.wiring import SCHEDULER_CLASSES, WORKER_CLASSES, extends_boundary_scheduler

ENABLED_POLICY = "request_boundaries"
FALLBACK_POLICY = "aligned"


@dataclass(frozen=True)
class GateDecision:
    """What the gate chose: ``boundaries_enabled``; when it is off, why (``reasons``); when it is on
    for a layout not yet validated on hardware (explicit ``request_boundaries`` only), which
    (``unvalidated``)."""

    requested: str
    boundaries_enabled: bool
    reasons: tuple[str, ...] = ()
    unvalidated: tuple[str, ...] = ()

    def summary(self) -> str:
        """One log line: the requested policy, the effective one, and every fallback reason."""
        effective = ENABLED_POLICY if self.boundaries_enabled else FALLBACK_POLICY
        line = f"{CONFIG_KEY}: policy={self.requested} -> {effective}"
        if self.reasons:
            line += f" (fallback: {'; '.join(self.reasons)})"
        if self.unvalidated:
            line += f" (on a layout not validated yet: {'; '.join(self.unvalidated)})"
        return " ".join(line.split())  # one line whatever the reasons contain


def _size(section: Any, name: str) -> int:
    value = getattr(section, name, None)
    return 1 if value is None else int(value)


def _is_multimodal(model_config: Any) -> bool:
    if not getattr(model_config, "is_multimodal_model", False):
        return False
    # A multimodal architecture run with --language-model-only accepts no multimodal inputs.
    mm_config = getattr(model_config, "multimodal_config", None)
    return not getattr(mm_config, "language_model_only", False)


def unsupported_reasons(vllm_config: Any) -> list[str]:
    """One short reason per feature of ``vllm_config`` that boundary retention does not support,
    in a fixed order; empty when boundary retention is safe. Attribute access only."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    reasons: list[str] = []

    hybrid = bool(getattr(model, "is_hybrid", False))
    if not hybrid:
        reasons.append("model has no recurrent layers: nothing to checkpoint")
    prefix_caching = bool(getattr(cache, "enable_prefix_caching", False))
    if not prefix_caching:
        reasons.append("prefix caching is disabled")
    mamba_mode = getattr(cache, "mamba_cache_mode", None)
    if hybrid and prefix_caching and mamba_mode != "align":
        reasons.append(f"mamba_cache_mode is {mamba_mode!r}, not 'align'")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        reasons.append("external KV connector or KV offloading is not supported yet")
    reasons += speculative_reasons(vllm_config)
    for attr, label in UNSUPPORTED_PARALLEL_SIZES:
        size = _size(parallel, attr)
        if size > 1:
            reasons.append(f"{label} size {size} is not supported yet")
    if getattr(vllm_config, "lora_config", None) is not None:
        reasons.append("LoRA adapters are part of the key but not supported yet")
    if getattr(model, "enable_prompt_embeds", False):
        reasons.append("prompt embeddings are not supported yet")
    if _is_multimodal(model):
        reasons.append("multimodal inputs are not keyed yet")
    if getattr(model, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models are not supported")
    scheduler_cls = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    if scheduler_cls is not None and scheduler_cls not in SCHEDULER_CLASSES.values():
        if not extends_boundary_scheduler(scheduler_cls):
            reasons.append(f"a custom scheduler class ({scheduler_cls}) is configured")
    worker_cls = getattr(parallel, "worker_cls", None)
    if worker_cls is not None and worker_cls not in WORKER_CLASSES and worker_cls not in WORKER_CLASSES.values():
        reasons.append(f"worker class {worker_cls} has no boundary-checkpoint variant")
    return reasons


def speculative_reasons(vllm_config: Any) -> list[str]:
    """Why the speculative decoding of ``vllm_config`` cannot work with boundary retention (empty
    without speculative decoding, with single-module MTP, or with a DFlash / DFlash2 drafter of
    :data:`SUPPORTED_DFLASH_ARCHITECTURES`). See docs/notes/spec-decode.md:

    * other methods (EAGLE, ngram, draft models, ...) and other DFlash architectures have not been
      run with the plugin;
    * dynamic speculation and adaptive verification change the draft count per step, which the
      response capture's source column (``core/boundaries.py``: ``speculative_response_boundary``)
      does not follow; adaptive verification also keeps a per-request acceptance estimate a
      restore would not carry;
    * multi-module MTP reads ``k > 1`` prefill tokens ahead: vLLM then cuts every prefill chunk
      that would end within ``k`` tokens of the prompt end, so the ``P - 1`` stop livelocks, and
      its later modules re-prefill the last ``k - 1`` rows of shared pages.

    A model with a pooled sparse-attention indexer (GLM-5.3-Flash) is not refused: the scheduler
    keeps its checkpoints on the pool grid under speculative decoding (``docs/design.md``
    contract 13)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return []
    method = getattr(spec, "method", None)
    if method not in SUPPORTED_SPECULATIVE_METHODS:
        return [
            f"speculative decoding method {method!r} is not supported (only single-module MTP and DFlash / DFlash2 are)"
        ]
    reasons = []
    if method == "dflash":
        architectures = list(getattr(getattr(spec, "draft_model_config", None), "architectures", None) or [])
        if not set(architectures) & set(SUPPORTED_DFLASH_ARCHITECTURES):
            reasons.append(
                f"DFlash drafter architecture {', '.join(architectures) or 'unknown'} is not supported "
                f"(only {', '.join(SUPPORTED_DFLASH_ARCHITECTURES)})"
            )
    if getattr(spec, "num_speculative_tokens_per_batch_size", None) is not None:
        reasons.append("dynamic speculative decoding (num_speculative_tokens_per_batch_size) is not supported")
    if getattr(spec, "enable_adaptive_verification", False):
        reasons.append("adaptive verification (enable_adaptive_verification) varies the drafts per step: not supported")
    lookahead = getattr(vllm_config, "num_prefill_lookahead_tokens", None) or 1
    if lookahead > 1:
        reasons.append(
            f"speculative decoding with multi-module MTP (prefill lookahead {lookahead} > 1) livelocks "
            "the P - 1 chunk stop"
        )
    return reasons


def unvalidated_reasons(vllm_config: Any) -> list[str]:
    """Layouts boundary retention is built for but has not been measured on yet: ``auto`` falls
    back for them, an explicit ``request_boundaries`` runs on them (the decision line says so).

    Model families: the scheduler accepts any layout of full-attention (dense or MLA), align-mode
    recurrent and one-pool indexer tail ring groups (``core/layout.py``: ``describe_layout``), but
    only the architectures in :data:`VALIDATED_ARCHITECTURES` have been measured.

    Tensor and decode context parallelism: capture and restore copy whole scheduler blocks on
    every rank, which is exact for replicated recurrent state and, under DCP, for the sharded
    attention pages too (``worker/geometry.py``: a boundary's partial virtual page is one block
    id on every rank), but neither has run on several GPUs yet.

    Speculative decoding (others are unsupported, :func:`speculative_reasons`): single-module MTP
    is measured on the CPU engine (V1 runner, synchronous scheduling) and on a GPU (Model Runner
    V2, async scheduling, drafts accepted) at ``k`` 1 and 3; DFlash and DFlash2 drafters (which
    vLLM runs on GPUs only) on a GPU at ``k`` 3 with a planted drafter whose drafts are accepted
    (:data:`VALIDATED_SPECULATIVE`: larger ``k`` is not validated), on Qwen3-Next; single-module
    MTP also on Nemotron-H at ``k`` 1 and 3 and on GLM-5.3-Flash at ``k`` 1 and 2, 3 only at the
    pool's prefix match unit, which the scheduler checks (:func:`match_unit_reasons`; planted MTP
    layers, drafts accepted). Another architecture, another method on these, or a larger ``k`` than the
    architecture's own is not validated (:data:`VALIDATED_SPECULATIVE_ARCHITECTURES`)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    reasons = []
    architectures = _architectures(vllm_config)
    if architectures and not set(architectures) & set(VALIDATED_ARCHITECTURES):
        reasons.append(
            f"model architecture {', '.join(architectures)} is not validated yet "
            f"(measured: {', '.join(VALIDATED_ARCHITECTURES)}; see docs/compatibility.md)"
        )
    tensor_parallel = _size(parallel, "tensor_parallel_size")
    if tensor_parallel > 1:
        reasons.append(f"tensor parallel size {tensor_parallel} is not validated yet (measured on one GPU only)")
    decode_context_parallel = _size(parallel, "decode_context_parallel_size")
    if decode_context_parallel > 1:
        reasons.append(f"decode context parallel size {decode_context_parallel} is not validated yet")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and not speculative_reasons(vllm_config):
        method, k = getattr(spec, "method", None), getattr(spec, "num_speculative_tokens", None)
        largest = VALIDATED_SPECULATIVE[method]  # every supported method (speculative_reasons passed)
        if (k or 1) > largest:
            reasons.append(
                f"speculative decoding ({method}, k={k}) is measured up to k={largest}, not validated on GPU"
            )
        measured = speculative_architectures(method)
        failures = _failure_notes(architectures, method, k or 1)
        on_architecture = largest_speculative_k(architectures, method)
        at_unit_only = match_unit_only_k(architectures, method)  # the scheduler checks it (match_unit_reasons)
        if architectures and not on_architecture:
            reasons.append(
                f"speculative decoding ({method}) on {', '.join(architectures)} is not validated yet "
                f"(measured with it: {', '.join(measured)})" + failures
            )
        elif architectures and on_architecture < (k or 1) <= largest and (k or 1) > at_unit_only:
            reasons.append(
                f"speculative decoding ({method}, k={k}) on {', '.join(architectures)} is measured up to "
                f"k={on_architecture}, not validated on GPU" + failures
            )
    return reasons


def decide_policy(config: BoundaryConfig, vllm_config: Any, extra_reasons: Sequence[str] = ()) -> GateDecision:
    """Apply the requested policy to ``vllm_config`` (see the module docstring); ``extra_reasons``
    (e.g. vLLM internals that differ from the pinned version) count like unsupported features."""
    requested = config.policy
    if requested == "aligned":
        return GateDecision(requested, False, ())
    reasons = tuple(unsupported_reasons(vllm_config)) + tuple(extra_reasons)
    unvalidated = tuple(unvalidated_reasons(vllm_config))
    if not reasons and not unvalidated:
        return GateDecision(requested, True, ())
    if not reasons and requested == "request_boundaries":
        return GateDecision(requested, True, (), unvalidated)
    if requested == "request_boundaries":
        raise BoundaryConfigError(
            f"{qualified('policy')}=request_boundaries is not supported with this configuration: "
            f"{'; '.join(reasons)}. Use policy 'auto' to fall back to 'aligned' automatically "
            f"(allowed policies: {', '.join(POLICIES)})."
        )
    return GateDecision(requested, False, reasons + unvalidated)


def _architectures(vllm_config: Any) -> list[str]:
    """The model's architectures (none where the config has no model config)."""
    return list(getattr(getattr(vllm_config, "model_config", None), "architectures", None) or [])


def _failure_notes(architectures: list[str], method: str | None, k: int) -> str:
    """``support.FAILED_ON_GPU``'s notes for this method and ``k``, each after "; " (a reason's tail)."""
    return "".join(f"; {what}" for what in failures_on_gpu(architectures, method, k))


def match_unit_reasons(vllm_config: Any, vllm_keeps_prompts_on_grid: bool) -> list[str]:
    """What only the scheduler knows about a speculative ``k`` validated on the architecture only
    with the indexer's pool as vLLM's prefix match unit (``support.MATCH_UNIT_ONLY_K``, which
    :func:`unvalidated_reasons` leaves to this check): none where vLLM keeps each prompt's state
    on the pool grid (``vllm_keeps_prompts_on_grid``), else one naming the unit and the GPU failure
    at vLLM's block unit."""
    architectures = _architectures(vllm_config)
    spec = getattr(vllm_config, "speculative_config", None)
    method, k = getattr(spec, "method", None), getattr(spec, "num_speculative_tokens", None) or 1
    if spec is None or vllm_keeps_prompts_on_grid or k <= largest_speculative_k(architectures, method):
        return []
    if k > match_unit_only_k(architectures, method):
        return []
    failures = _failure_notes(architectures, method, k)
    return [
        f"speculative decoding ({method}, k={k}) on {', '.join(architectures)} is validated only with the "
        "indexer's pool as vLLM's prefix match unit, which this engine does not run (the plugin sets it under "
        "prefix_match_unit auto with prefix caching, the uni executor and recurrent kernels that save states "
        "inside the prefill chunk, as FlashKDA does; or give --prefix-match-unit a multiple of the pool)" + failures
    ]


def layout_reasons(describe_reasons: Sequence[str], *, block_aligned: bool, worker_cls: Any) -> list[str]:
    """Why the engine's scheduler cannot run boundary retention, known only once the KV cache
    exists: ``describe_reasons`` (``core/layout.py``: ``describe_layout``), then a scheduler that does
    not keep the recurrent state block-aligned, then a worker class that does not apply the
    capture copies (not one of :data:`wiring.WORKER_CLASSES`' values)."""
    reasons = list(describe_reasons)
    if not block_aligned:
        reasons.append("recurrent state is not kept block-aligned by this scheduler")
    if worker_cls not in WORKER_CLASSES.values():
        reasons.append(f"worker class {worker_cls} does not apply capture copies")
    return reasons


def decide_layout(
    config: BoundaryConfig, describe_reasons: Sequence[str], *, block_aligned: bool, worker_cls: Any, logger: Any
) -> bool:
    """Whether the scheduler runs boundary retention on its KV cache layout (:func:`layout_reasons`):
    ``True`` when no reason applies; otherwise raises ``BoundaryConfigError`` under
    ``request_boundaries`` and, under any other policy, warns on ``logger`` and returns ``False``
    (stock aligned retention)."""
    reasons = layout_reasons(describe_reasons, block_aligned=block_aligned, worker_cls=worker_cls)
    if not reasons:
        return True
    message = "boundary_checkpoints: KV cache layout not supported: " + "; ".join(reasons)
    if config.policy == ENABLED_POLICY:
        raise BoundaryConfigError(message)
    logger.warning("%s -> falling back to aligned retention", message)
    return False


_logged_summaries: set[str] = set()
_logged_lock = threading.Lock()


def log_decision_once(decision: GateDecision, logger: Any) -> None:
    """Log ``decision.summary()`` at INFO once per process per distinct summary."""
    line = decision.summary()
    with _logged_lock:
        if line in _logged_summaries:
            return
        _logged_summaries.add(line)
    logger.info("%s", line)
