"""The vLLM 0.32.0 signatures the plugin relies on, and the checks that compare them with the
installed vLLM.

Contract: :func:`interface_mismatches` (scheduler, KV cache manager, coordinator and block pool
methods, vLLM's CUDA graph sizing, and ``SchedulerOutput`` fields) and
:func:`frontend_interface_mismatches` (the OpenAI serving methods) return how the installed vLLM
differs, empty when it matches; they never raise for a difference.
The plugin asks them before it installs anything, so a different vLLM falls back at startup
instead of failing at the first request.
"""

from __future__ import annotations

import inspect

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from boundary_checkpoints.compat.engine import VllmConfig
from boundary_checkpoints.compat.frontend import openai_serving_classes
from boundary_checkpoints.compat.scheduler import KVCacheManager, Scheduler, SchedulerOutput

__all__ = ["frontend_interface_mismatches", "interface_mismatches"]

# Methods the plugin overrides or calls, with the leading parameters it relies on (after self).
_EXPECTED_PARAMETERS: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (Scheduler, "schedule", ()),
    (Scheduler, "update_from_output", ("scheduler_output", "model_runner_output")),
    (Scheduler, "_get_local_prefix_cache_hit", ("request",)),
    (
        Scheduler,
        "_mamba_block_aligned_split",
        ("request", "num_new_tokens", "num_new_local_computed_tokens", "num_external_computed_tokens"),
    ),
    (Scheduler, "_free_request", ("request", "delay_free_blocks")),
    (Scheduler, "_preempt_request", ("request",)),
    (Scheduler, "reset_prefix_cache", ("reset_running_requests",)),
    (Scheduler, "make_stats", ("spec_decoding_stats",)),
    (KVCacheManager, "allocate_slots", ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks")),
    (KVCacheManager, "prefix_cache_lookup_enabled", ("request",)),
    (KVCacheManager, "new_step_starts", ()),
    (KVCacheManager, "free", ("request",)),
    (KVCacheCoordinator, "find_longest_cache_hit", ("block_hashes", "max_cache_hit_length")),
    # The block pool's own API, which the plugin calls for its bundles' references.
    (BlockPool, "get_new_blocks", ("num_blocks",)),
    (BlockPool, "touch", ("blocks",)),
    (BlockPool, "free_blocks", ("ordered_blocks",)),
    (BlockPool, "get_num_free_blocks", ()),
    (BlockPool, "_maybe_evict_cached_block", ("block",)),
    (BlockPool, "get_cached_block", ("block_hash", "kv_cache_group_ids")),
    (FreeKVCacheBlockQueue, "iter_blocks_after", ("cursor",)),
    (VllmConfig, "_set_cudagraph_sizes", ()),
)
_EXPECTED_KEYWORDS: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (KVCacheManager, "allocate_slots", ("reserved_blocks", "has_scheduled_reqs", "num_external_computed_tokens")),
    (KVCacheCoordinator, "get_num_blocks_to_allocate", ("request_id", "apply_admission_cap", "prefill_end")),
)
_EXPECTED_FIELDS = ("kv_cache_block_copies", "new_block_ids_to_zero", "num_scheduled_tokens",
                    "total_num_scheduled_tokens")  # fmt: skip


def interface_mismatches() -> list[str]:
    """How the installed vLLM differs from the 0.32.0 internals this package describes (empty when
    it matches). Checked before boundary retention is turned on, so a different vLLM falls back
    to stock retention (or refuses ``request_boundaries``) at startup instead of failing at the
    first request."""
    problems: list[str] = []
    for cls, name, expected in _EXPECTED_PARAMETERS:
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        found = tuple(inspect.signature(method).parameters)[1:]
        if found[: len(expected)] != expected:
            problems.append(f"{cls.__name__}.{name}{expected} expected, found {found}")
    for cls, name, keywords in _EXPECTED_KEYWORDS:
        method = getattr(cls, name, None)
        missing = [k for k in keywords if method is None or k not in inspect.signature(method).parameters]
        if missing:
            problems.append(f"{cls.__name__}.{name} has no parameter(s) {', '.join(missing)}")
    fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
    missing_fields = [f for f in _EXPECTED_FIELDS if f not in fields]
    if missing_fields:
        problems.append(f"SchedulerOutput has no field(s) {', '.join(missing_fields)}")
    return problems


def frontend_interface_mismatches() -> list[str]:
    """How vLLM's OpenAI frontend differs from the 0.32.0 methods the endpoint plugin extends."""
    completion, chat, _ = openai_serving_classes()
    expected = (
        (completion, "render_completion_request"),
        (chat, "render_chat_request"),
        (completion, "_extract_prompt_len"),
        (chat, "_extract_prompt_components"),
        (chat, "create_error_response"),
    )
    return [f"{cls.__name__}.{name} is missing" for cls, name in expected if not callable(getattr(cls, name, None))]
