"""vLLM 0.32's scheduler, KV cache manager and request internals: the scheduler process's side.

Contract: the vLLM classes below are imported eagerly, when ``boundary_checkpoints.compat`` is;
the plugin reads their private attributes through the functions here or the subclasses that
override their hooks. Names and the behaviour relied on:

* ``Scheduler`` / ``AsyncScheduler`` (v1/core/sched): subclassed. Overridden hooks:
  ``schedule``, ``update_from_output``, ``_get_local_prefix_cache_hit`` (lookup),
  ``_mamba_block_aligned_split`` (chunk stop at the prompt boundary), ``_free_request`` (response
  capture), ``_preempt_request``, ``finish_requests`` via ``_free_request``,
  ``reset_prefix_cache``. Attributes read: ``kv_cache_manager``, ``requests``, ``hash_block_size``,
  ``need_mamba_block_aligned_split``, ``vllm_config``, ``num_spec_tokens``.
* Speculative decoding in align mode (``core/boundaries.py``, docs/notes/spec-decode.md):
  ``SchedulerOutput.scheduled_spec_decode_tokens`` (drafts per request of a step), the
  ``MambaManager.num_speculative_blocks`` state columns and their layout (SSM column ``t`` holds
  the state after query token ``t``; the conv window after the first query token at offset
  ``k - d`` of column 0; the V1 post-step copy of a block-aligned committed state into block
  ``aligned // B - 1``), and the EAGLE/MTP drafter's input shift (draft K/V row ``r`` computed
  from token ``r + 1``). Async scheduling: ``num_computed_tokens`` counts a scheduled step's
  drafts at once and ``update_from_output`` takes its rejected drafts back before the stop check
  (which trims tokens without touching the count); a request that finishes with a step in
  flight is freed at once and that step's output, which still carries its sampled tokens
  (:func:`sampled_token_ids`), is dropped by the scheduler; a non-null entry of a ``MambaManager``
  request's ``req_to_blocks`` is the block the worker's append-only block table holds at that
  index (a relocated speculative block leaves a null behind, docs/notes/spec-decode.md §10).
* ``KVCacheManager`` (v1/core/kv_cache_manager.py): its ``allocate_slots`` returns None without
  side effects when the pool is short, which the plugin's subclass answers by evicting retained
  checkpoints and retrying. The scheduler builds its manager itself, so the plugin re-classes that
  instance to the subclass (``__class__`` assignment; no vLLM function is replaced).
* ``KVCacheBlocks`` and ``KVCacheBlock`` (``block_id``, ``ref_cnt``, ``is_null``, ``block_hash``:
  a ``BlockHashWithGroupId``, whose hash-block hash ``get_block_hash`` gives and KV group
  ``get_group_id``), ``BlockPool``
  (``get_new_blocks``, ``free_blocks``, ``get_num_free_blocks``, ``null_block``,
  ``num_gpu_blocks``; ``_maybe_evict_cached_block(block)``, overridden under retention ``borrow``
  to learn each cached block it evicts: it returns True when it removed the block's hash), the
  coordinator's ``find_longest_cache_hit`` (:func:`block_grid_hit`), ``get_cached_block``
  (:func:`caches_hash`) and ``single_type_managers``
  (``req_to_blocks``,
  ``block_size``), ``MambaManager`` and ``FullAttentionManager``; ``CircularBufferManager`` (the
  GLM-5.3-Flash indexer's tail ring, named in a fallback reason only); ``SlidingWindowManager``
  (``sliding_window``; its spec's ``extra_retained_tokens`` and ``prefix_replay_tokens``): a request
  resumed at ``N`` needs the pages from ``(N - W + 1) // B`` on, and vLLM lists null blocks below
  that for a prefix hit (``add_local_computed_blocks``, ``get_num_skipped_tokens``).
* Layout facts read at startup (``core/layout.py``): ``KVCacheConfig.kv_cache_tensors``
  (``KVCacheTensor.layers``, ``layer_stride``, ``block_stride``: a layer's page is the smaller of
  the two strides) and ``MambaSpec.mamba_type`` (``MambaAttentionBackendEnum.MAMBA2`` for Mamba2
  mixers).
* ``SchedulerOutput.kv_cache_block_copies`` (``KVCacheBlockCopy`` pairs) and
  ``SchedulerOutput.new_block_ids_to_zero``: both model runners (V1 on CPU, V2 on GPU) zero the
  step's new blocks, then apply these whole-block copy-on-write copies (restores of partial hits)
  with ``copy_kv_cache_blocks_inplace``, both at the start of ``execute_model``. The plugin's
  worker applies the copies itself and removes them, and their destinations from the zero list,
  from the step it hands on (``worker/capture.py``). ``copy_kv_cache_blocks_inplace`` itself is
  used for caches that are not block-outermost.
* ``RequestStatus`` and ``Request`` fields (``all_token_ids``, ``block_hashes``, ``cache_salt``,
  ``lora_request``, ``prompt_embeds``, ``mm_features``, ``num_prompt_tokens``,
  ``num_computed_tokens``, ``num_tokens``, ``skip_reading_prefix_cache``, ``sampling_params``).
* KV cache coordinator (v1/core/kv_cache_coordinator.py): the scheduler re-classes the manager's
  coordinator to a subclass whose ``get_num_blocks_to_allocate`` remembers its last answer, so a
  refused allocation's shortfall is known, and lowers the ``prefill_end`` keyword of a step's
  count (not the admission count, ``apply_admission_cap``) to the end of a chunk the plugin cut
  (``core/scheduler.py``); relied on: ``allocate_slots`` passes ``request_id`` and ``prefill_end``
  by keyword, and ``MambaManager`` reserves an in-chunk prefill checkpoint block
  (``num_prefill_checkpoint_blocks``) under sparse retention only for a chunk reaching
  ``prefill_end``, while the worker's ``compute_mamba_prefill_checkpoints`` exports it from any
  chunk whose end puts a block boundary inside it; ``allocate_slots``
  asks it for the block count it compares with ``block_pool.get_num_free_blocks()`` (plus
  ``watermark_blocks`` for waiting requests and ``reserved_blocks``), and answers more blocks than
  the pool holds to defer a recurrent hit to the next step. ``KVCacheBlock.ref_cnt`` tells whether
  a retained block's release frees it.
* ``MambaManager.cached_blocks_this_step`` in align mode (``mamba_cache_mode``): the hashes it
  marks as written in this step; a new request whose recurrent hit ends on a marked hash is
  deferred to the next step (more blocks than the pool). Its ``cache_blocks`` also marks the hash
  of a prompt's last hash-block boundary when it re-registers a block that already held it (a hit
  ending there); ``new_step_starts`` clears the set. ``KVCacheBlocks.blocks``: the hit's blocks
  per KV group, the recurrent group's state in the last (``core/shared_hits.py``).
* ``KVCacheManager.new_step_starts`` (called at the start of every ``schedule()``), the scheduler's
  ``use_eagle_block_drop`` and ``connector``, and ``get_mamba_prefill_checkpoint_position``
  (v1/kv_cache_interface.py): where align mode keeps a prompt's reusable state in its last chunk
  (``prefill_state_position``, for ``core/prefix_in_flight.py``); the scheduler's
  ``mamba_partial_cache_hit``: whether it also keeps one at the prompt's last hash-block boundary
  (``keeps_prompt_states_between_blocks``).
* A restore at a mid-block ``P`` (``core/chunk_stops.py``): vLLM's ``_mamba_block_aligned_split``
  stops a chunk that starts inside a block at the next block boundary, so that the recurrent
  group's slot of that block holds the state after the block's last token. A restored request's
  first chunk runs past it instead where :func:`runs_restores_past_their_block` holds: its slot
  ``P // B`` holds the restored state (``preprocess_mamba`` copies the previous slot into the
  chunk's last), which vLLM would register as the state at that block's end;
  :func:`leave_state_slot_uncached` moves a recurrent manager's ``num_cached_block`` past it, so
  ``cache_blocks`` starts after it, and ``last_state_block_idx`` frees it once the state has
  moved on. The chunk only reads that slot, so
  :func:`read_restored_slot_in_place` drops the copy-on-write (``_partial_hit_reqs``, set by
  ``save_new_computed_blocks`` before ``allocate_new_blocks``) and the slot keeps the restored
  block itself; ``get_num_blocks_to_allocate`` counts one block per recurrent group for that
  copy (:func:`recurrent_copies_on_write`), which the plugin's count takes off. The shifted
  call (a block-aligned start, the same chunk end) gives every other stop vLLM applies.
* ``Scheduler.make_stats`` (v1/core/sched/scheduler.py): overridden to add the plugin's counters
  to the step's ``SchedulerStats`` (v1/metrics/stats.py). Relied on: the engine core sends its
  result to the frontend inside ``EngineCoreOutputs`` (msgpack, decoded to the declared
  ``SchedulerStats`` fields only), and ``SchedulerStats.num_kv_fetch_reqs_by_stage`` is a fresh
  ``dict[str, int]`` per call whose stock readers (Prometheus and logging stat loggers) look up
  only their own stage keys once this plugin's logger removed its entries (``metrics.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    KVCacheBlockCopy,
    get_block_hash,
    get_group_id,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import (
    CircularBufferManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

__all__ = [
    "STATS_CARRIER_FIELD",
    "AsyncScheduler",
    "BlockPool",
    "CircularBufferManager",
    "FullAttentionManager",
    "KVCacheBlock",
    "KVCacheBlockCopy",
    "KVCacheBlocks",
    "KVCacheManager",
    "MambaAttentionBackendEnum",
    "MambaManager",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SlidingWindowManager",
    "block_grid_hit",
    "caches_hash",
    "copy_kv_cache_blocks_inplace",
    "drops_eagle_block",
    "free_queue_order",
    "group_hit_blocks",
    "get_block_hash",
    "get_group_id",
    "keeps_prompt_states_between_blocks",
    "leave_state_slot_uncached",
    "prefill_state_position",
    "read_restored_slot_in_place",
    "recurrent_copies_on_write",
    "request_blocks",
    "runs_restores_past_their_block",
    "sampled_token_ids",
    "same_step_marks",
    "single_type_managers",
    "watermark_blocks",
]


def sampled_token_ids(model_runner_output, request_id: str) -> list[int]:
    """The tokens a step sampled for ``request_id`` (``ModelRunnerOutput.sampled_token_ids``, by
    ``req_id_to_index``); empty when the step sampled none for it."""
    index = model_runner_output.req_id_to_index.get(request_id)
    rows = model_runner_output.sampled_token_ids
    if index is None or not rows or index >= len(rows):
        return []
    return list(rows[index])


# The ``SchedulerStats`` field the plugin's per-step counters ride in to the frontend (see the
# module docstring: a fresh ``dict[str, int]`` per call whose stock readers look up only their keys).
STATS_CARRIER_FIELD = "num_kv_fetch_reqs_by_stage"


def single_type_managers(kv_cache_manager) -> list:
    """The per-KV-group managers of vLLM's coordinator, in group order."""
    return list(kv_cache_manager.coordinator.single_type_managers)


def _align_recurrent(manager) -> bool:
    """Whether ``manager`` is a recurrent group's manager in align mode."""
    return isinstance(manager, MambaManager) and getattr(manager, "mamba_cache_mode", None) == "align"


def same_step_marks(manager) -> set | None:
    """The hashes a recurrent group's manager in align mode marks as written in this step
    (``cached_blocks_this_step``: a hit ending on one waits a step); None for any other manager."""
    if _align_recurrent(manager):
        marks = getattr(manager, "cached_blocks_this_step", None)
        return marks if isinstance(marks, set) else None
    return None


def group_hit_blocks(blocks, group: int) -> list:
    """The prefix hit's blocks of KV group ``group`` (``KVCacheBlocks.blocks``)."""
    return list(blocks.blocks[group])


def request_blocks(kv_cache_manager, request_id: str) -> list[list]:
    """Per KV group, the blocks vLLM's manager holds for ``request_id`` (``req_to_blocks``)."""
    return [manager.req_to_blocks.get(request_id, []) for manager in single_type_managers(kv_cache_manager)]


def free_queue_order(block_pool) -> Iterator:
    """The pool's free blocks in the order ``get_new_blocks`` hands them out (the free queue's head
    first: ``FreeKVCacheBlockQueue.iter_blocks_after(None)``)."""
    return block_pool.free_block_queue.iter_blocks_after(None)


def drops_eagle_block(scheduler) -> bool:
    """Whether the scheduler's prefix lookups drop a hit's last block for an EAGLE-style drafter."""
    return bool(scheduler.use_eagle_block_drop)


def keeps_prompt_states_between_blocks(scheduler) -> bool:
    """Whether vLLM's align mode keeps each prompt's recurrent state at the last hash-block boundary
    before its end, not only at block boundaries (``--prefix-match-unit`` finer than the block:
    ``mamba_partial_cache_hit``): inside the prompt's last chunk where the kernels save a state
    there (``num_prefill_checkpoint_blocks``), else at a chunk end of its own
    (``_mamba_block_aligned_split``)."""
    return bool(scheduler.mamba_partial_cache_hit)


def prefill_state_position(scheduler, num_prompt_tokens: int) -> int:
    """Where vLLM's align mode keeps a reusable recurrent state inside a prompt's last prefill
    chunk: a block boundary below its end, one block lower where EAGLE-style drafters drop a hit's
    last block (``get_mamba_prefill_checkpoint_position``); 0 for none."""
    block_size = scheduler.cache_config.block_size
    return get_mamba_prefill_checkpoint_position(num_prompt_tokens, block_size, drops_eagle_block(scheduler))


def runs_restores_past_their_block(scheduler) -> bool:
    """Whether a restored request's first chunk may run past the block its restore point is in:
    align mode, whole-block prefix matching, no in-chunk prefill checkpoints (KDA, Mamba2) and no
    draft tokens (module docstring)."""
    return (
        bool(scheduler.need_mamba_block_aligned_split)
        and not scheduler.mamba_partial_cache_hit
        and not scheduler.mamba_has_prefill_checkpoint_blocks
        and not scheduler.num_spec_tokens
    )


def recurrent_copies_on_write(managers) -> int:
    """Blocks vLLM counts for the copy-on-write of a partial recurrent hit: one per recurrent
    manager in align mode (``get_num_blocks_to_allocate``' ``has_partial_hit``)."""
    return sum(_align_recurrent(manager) for manager in managers)


def read_restored_slot_in_place(managers, request_id: str) -> None:
    """Drop the copy-on-write vLLM planned for ``request_id``'s partial recurrent hit
    (``_partial_hit_reqs``), so its slot keeps the restored block: the chunk only reads it
    (``preprocess_mamba`` copies it into the chunk's last slot) and ``last_state_block_idx``
    releases it."""
    for manager in managers:
        if _align_recurrent(manager):
            manager._partial_hit_reqs.pop(request_id, None)


def leave_state_slot_uncached(managers, request_id: str, slot: int) -> None:
    """Make every recurrent manager in align mode start caching ``request_id``'s blocks after
    ``slot`` (the restored state, read in place: no block-end state, and a checkpoint's own
    block)."""
    for manager in managers:
        if _align_recurrent(manager):
            cached = manager.num_cached_block
            cached[request_id] = max(cached.get(request_id, 0), slot + 1)


def watermark_blocks(kv_cache_manager) -> int:
    """The free blocks vLLM keeps back when it admits a waiting request."""
    return kv_cache_manager.watermark_blocks


def block_grid_hit(kv_cache_manager, block_hashes, max_tokens: int) -> tuple[tuple[list, ...], int]:
    """The hit vLLM's own prefix cache gives a prompt with ``block_hashes`` of at most ``max_tokens``
    tokens, without taking it: ``(blocks per KV group, hit length)`` from the coordinator's
    ``find_longest_cache_hit`` (a lookup with no side effect on the pool)."""
    blocks, num_tokens, _ = kv_cache_manager.coordinator.find_longest_cache_hit(block_hashes, max_tokens)
    return blocks, num_tokens


def caches_hash(block_pool, block_hash, group: int) -> bool:
    """Whether the pool's prefix cache holds a block of hash-block hash ``block_hash`` in KV group
    ``group`` (``BlockPool.get_cached_block``)."""
    return block_pool.get_cached_block(block_hash, [group]) is not None
