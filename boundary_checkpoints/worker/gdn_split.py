"""In-step prompt capture inside vLLM's Gated DeltaNet layers (``prompt_capture: in_step``).

Contract
--------
* :func:`install` (worker, after the model is loaded) re-classes every recurrent layer of the
  model to :class:`BoundaryQwenGDN` and returns the worker's :class:`StepCaptures`. It raises if
  a recurrent layer is not exactly vLLM's ``QwenGatedDeltaNetAttention`` (``prompt_capture.py``
  decides ``in_step`` only for architectures made of those).
* Per step the worker calls ``begin(pairs)`` with the step's ``(slot, destination)`` block pairs
  (one per captured prompt and recurrent KV group: the block that holds the prompt's recurrent
  state after this step, and the checkpoint's private block), runs the step, and ``end()``
  returns the slots no layer split (the capture did not happen: the worker fails the step).
* In a layer, a prefill row whose state index is one of the ``slots`` is a capture row; the
  scheduler sends only rows of two tokens or more whose chunk ends at the prompt's ``P``. The core
  then runs as two calls of vLLM's own core on derived metadata (:func:`step_splits`, once per
  step for every KV group, from one device read of their row layouts):
  1. the step without the last token of each capture row (its ``cu_seqlens`` entries shortened,
     the Triton kernels' chunk and conv metadata rebuilt): the batch the ``P - 1`` stop runs, so
     each capture row's slot then holds its conv and SSM state after ``P - 1``, which is copied
     into the row's destination block;
  2. those last tokens as one-token decode rows that read and write their slots: what the step
     after the stop runs for them.
  Each of the layer's inputs is gathered once, in the order call 1's tokens then call 2's
  (:attr:`RowLayout.order`), so the two calls take contiguous slices of one buffer, and the
  outputs go back to their token positions in one scatter. Every GDN kernel treats rows
  independently, so each row's outputs and states are those of the two-step run (bit for bit on
  the CPU kernels).
* Any other call (no pair this step, no capture row in this KV group, no metadata) is vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from boundary_checkpoints.compat import (
    conv_metadata,
    cpu_gdn_core,
    fla_chunk_metadata,
    forward_context_layers,
    forward_context_metadata,
    forward_metadata,
    gdn_metadata_class,
    gpu_sync_allowed,
    layer_metadata,
    qwen_gdn_layer_class,
    reclass_instance,
    recurrent_layer_base,
)

GDNMetadata = gdn_metadata_class()


@dataclass(frozen=True)
class RowSplit:
    """One step's split of one KV group's batch (see the module docstring)."""

    order: torch.Tensor  # token positions: call 1's (ascending), then each capture row's last token
    num_kept: int  # call 1's tokens: order[:num_kept]
    slots: torch.Tensor  # each capture row's state index
    slot_ids: tuple[int, ...]  # the same indices on the host (no device read to learn them)
    destinations: torch.Tensor  # each capture row's destination block
    without_last: object  # metadata of call 1
    last_tokens: object  # metadata of call 2


@dataclass(frozen=True)
class RowLayout:
    """The token layout of a split: which tokens each call takes and call 1's query metadata. It
    depends only on the batch's rows and which of them are capture rows, so the KV groups of a step
    (the same batch, each with its own state indices) share one."""

    order: torch.Tensor  # call 1's token positions (ascending), then each capture row's last token
    num_kept: int  # call 1's tokens
    num_tokens: int  # real tokens of the batch (zero-token padding rows hold none)
    query_fields: dict  # call 1's query starts (and the CUDA core's kernel metadata), for ``replace``
    last_query_start_loc: torch.Tensor  # call 2: one token per row


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; on CUDA through pinned memory, so the copy does not wait for the
    device (a pageable copy synchronizes the stream)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def kernel_fields(query_starts: torch.Tensor, prefill_starts: torch.Tensor, device) -> dict:
    """The CUDA core's Triton chunk metadata for the prefill ``cu_seqlens`` ``prefill_starts`` and
    its causal-conv metadata for the batch's ``query_starts`` (both on CPU)."""
    chunk_indices, chunk_offsets = fla_chunk_metadata(prefill_starts)
    nums_dict, batch_ptr, token_chunk_offset_ptr = conv_metadata(query_starts, device)
    return {
        "chunk_indices": to_device(chunk_indices, device), "chunk_offsets": to_device(chunk_offsets, device),
        "nums_dict": nums_dict, "batch_ptr": batch_ptr, "token_chunk_offset_ptr": token_chunk_offset_ptr,
    }  # fmt: skip


def with_kernel_metadata(metadata, query_starts: torch.Tensor, prefill_starts: torch.Tensor, device):
    """``metadata`` with :func:`kernel_fields` for these query starts (both on CPU)."""
    return replace(metadata, **kernel_fields(query_starts, prefill_starts, device))


def row_layout(metadata, starts: torch.Tensor, rows: tuple[int, ...], rebuild_kernel_metadata: bool) -> RowLayout:
    """The layout of ``metadata``'s batch (row starts ``starts`` on the host) with capture rows
    ``rows``; ``rebuild_kernel_metadata``: the CUDA core's Triton chunk and conv metadata follow the
    shortened rows. Every row keeps its place, zero-token padding rows included, so the per-row
    tensors of the metadata still line up."""
    short = [row for row in rows if starts[row + 1] - starts[row] < 2]
    if short:
        raise RuntimeError(f"in-step capture rows {short} have fewer than two tokens")
    device = metadata.non_spec_query_start_loc.device
    num_tokens = int(starts[metadata.num_decodes + metadata.num_prefills])
    last = [int(starts[row + 1]) - 1 for row in rows]
    shortened = starts.clone()
    for row in rows:
        shortened[row + 1 :] -= 1
    keep = torch.ones(num_tokens, dtype=torch.bool)
    keep[last] = False
    order = torch.cat([keep.nonzero().flatten(), torch.tensor(last, dtype=torch.long)])
    prefill_starts = shortened[metadata.num_decodes :] - metadata.num_decode_tokens
    fields = {"non_spec_query_start_loc": to_device(shortened, device),
              "prefill_query_start_loc": to_device(prefill_starts, device)}  # fmt: skip
    if rebuild_kernel_metadata:
        fields |= kernel_fields(shortened, prefill_starts, device)
    return RowLayout(
        order=to_device(order, device),
        num_kept=num_tokens - len(rows),
        num_tokens=num_tokens,
        query_fields=fields,
        last_query_start_loc=torch.arange(len(rows) + 1, dtype=starts.dtype, device=device),
    )


def group_split(metadata, layout: RowLayout, slots: list[int], pairs: dict[int, int]) -> RowSplit:
    """The split of one KV group's batch over a shared ``layout``; ``slots``: the capture rows'
    state indices in this group."""
    device, n = metadata.non_spec_query_start_loc.device, len(slots)
    index_dtype = metadata.prefill_state_indices.dtype
    indices = to_device(torch.tensor([slots, [pairs[slot] for slot in slots]], dtype=index_dtype), device)
    without_last = replace(
        metadata, num_prefill_tokens=metadata.num_prefill_tokens - n, num_actual_tokens=layout.num_tokens - n,
        **layout.query_fields,
    )  # fmt: skip
    last_tokens = GDNMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=n, num_decode_tokens=n, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=n, non_spec_query_start_loc=layout.last_query_start_loc,
        non_spec_state_indices_tensor=indices[0],
    )  # fmt: skip
    return RowSplit(
        order=layout.order, num_kept=layout.num_kept, slots=indices[0], slot_ids=tuple(slots), destinations=indices[1],
        without_last=without_last, last_tokens=last_tokens,
    )  # fmt: skip


def step_splits(batches: list, pairs: dict[int, int], rebuild_kernel_metadata: bool) -> list[RowSplit | None]:
    """The split of each non-speculative GDN batch of ``batches`` (one per KV group of a step)
    whose prefill rows with a state index in ``pairs`` are capture rows (None: there are none).
    The rows' layout is read from the device once for all of them, and batches with the same rows
    and capture rows share one :class:`RowLayout`."""
    if not batches:
        return []
    pieces = []
    for metadata in batches:
        indices = metadata.prefill_state_indices[: metadata.num_prefills]
        pieces += [metadata.non_spec_query_start_loc.long(), indices.long()]
    with gpu_sync_allowed():  # the step's one device-to-host read: every group's row layout
        host = torch.cat(pieces).cpu()
    splits, layouts, offset = [], {}, 0
    for metadata in batches:
        width = metadata.non_spec_query_start_loc.numel()
        starts = host[offset : offset + width].to(metadata.non_spec_query_start_loc.dtype)
        indices = host[offset + width : offset + width + metadata.num_prefills].tolist()
        offset += width + metadata.num_prefills
        rows = tuple(metadata.num_decodes + r for r, index in enumerate(indices) if index in pairs)
        if not rows:
            splits.append(None)
            continue
        key = (rows, metadata.num_decodes, metadata.num_decode_tokens, tuple(starts.tolist()))
        if key not in layouts:
            layouts[key] = row_layout(metadata, starts, rows, rebuild_kernel_metadata)
        slots = [indices[row - metadata.num_decodes] for row in rows]
        splits.append(group_split(metadata, layouts[key], slots, pairs))
    return splits


class StepCaptures:
    """A worker's capture pairs for the step it runs, and the splits its layers computed."""

    def __init__(self, rebuild_kernel_metadata: bool) -> None:
        self.rebuild_kernel_metadata = rebuild_kernel_metadata
        self._pairs: dict[int, int] = {}
        self._taken: set[int] = set()
        self._splits: dict[int, tuple[object, RowSplit | None]] = {}  # id(metadata) -> (metadata, split)

    def begin(self, pairs) -> None:
        self._pairs = {int(slot): int(destination) for slot, destination in pairs}
        self._taken = set()
        self._splits = {}

    def end(self) -> list[int]:
        """The slots of this step that no layer split; clears the step."""
        missing = sorted(set(self._pairs) - self._taken)
        self._pairs, self._splits = {}, {}
        return missing

    def split_for(self, metadata) -> RowSplit | None:
        """The split of the batch ``metadata`` describes, or None. The first call of a step splits
        every GDN batch of the forward context at once (one device read for all KV groups: their
        layers share one metadata object per group); a batch not among them is split alone."""
        if not self._pairs or not splittable(metadata):
            return None
        if not self._splits:
            self._remember([m for m in forward_context_metadata() if isinstance(m, GDNMetadata) and splittable(m)])
        if id(metadata) not in self._splits:
            self._remember([metadata])
        return self._splits[id(metadata)][1]

    def _remember(self, batches: list) -> None:
        for metadata, split in zip(batches, step_splits(batches, self._pairs, self.rebuild_kernel_metadata)):
            self._splits[id(metadata)] = (metadata, split)  # the metadata is kept so that its id stays unique
            if split is not None:
                self._taken.update(split.slot_ids)


def splittable(metadata) -> bool:
    """A batch the split applies to: prefill rows, no speculative rows."""
    return metadata.num_prefills > 0 and metadata.spec_sequence_masks is None


class BoundaryQwenGDN(qwen_gdn_layer_class()):
    """vLLM's Qwen GDN layer with the in-step split (module docstring). Set by :func:`install`:
    ``boundary_captures`` (the worker's :class:`StepCaptures`), ``boundary_on_cpu``."""

    boundary_captures: StepCaptures
    boundary_on_cpu: bool

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # vLLM's forward_cpu and forward_cuda compute the same projections; forward_cuda's core op
        # dispatches to self._forward_core, where the split runs (on CPU with the CPU core).
        return self.forward_cuda(hidden_states)

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        metadata = forward_metadata(self.prefix)
        split = self.boundary_captures.split_for(metadata) if isinstance(metadata, GDNMetadata) else None
        if split is None:
            return self._vllm_core(mixed_qkv, b, a, core_attn_out)
        order, kept = split.order, split.num_kept
        qkv, gate_b, gate_a = mixed_qkv[order], b[order], a[order]
        out = core_attn_out.new_zeros((len(order), *core_attn_out.shape[1:]))
        with layer_metadata(self.prefix, split.without_last):
            self._vllm_core(qkv[:kept], gate_b[:kept], gate_a[:kept], out[:kept])
        for state in self.kv_cache:  # conv and SSM state after P - 1 into the checkpoint's block
            state[split.destinations] = state[split.slots]
        with layer_metadata(self.prefix, split.last_tokens):
            self._vllm_core(qkv[kept:], gate_b[kept:], gate_a[kept:], out[kept:])
        core_attn_out.index_copy_(0, order, out)

    def _vllm_core(self, mixed_qkv, b, a, core_attn_out) -> None:
        if self.boundary_on_cpu:
            cpu_gdn_core(mixed_qkv, b, a, core_attn_out, self.prefix)
        else:
            super()._forward_core(mixed_qkv, b, a, core_attn_out)


def install(vllm_config, on_cpu: bool) -> StepCaptures:
    """Re-class the model's recurrent layers to :class:`BoundaryQwenGDN` (module docstring)."""
    base, recurrent = qwen_gdn_layer_class(), recurrent_layer_base()
    layers = [layer for layer in forward_context_layers(vllm_config) if isinstance(layer, recurrent)]
    foreign = sorted({type(layer).__name__ for layer in layers if type(layer) is not base})
    if foreign or not layers:
        raise RuntimeError(
            f"prompt_capture in_step expects only QwenGatedDeltaNetAttention recurrent layers, found "
            f"{', '.join(foreign) or 'none'}; set boundary_checkpoints.prompt_capture to 'stop'"
        )
    captures = StepCaptures(rebuild_kernel_metadata=not on_cpu)
    for layer in layers:
        reclass_instance(layer, BoundaryQwenGDN)
        layer.boundary_captures = captures
        layer.boundary_on_cpu = on_cpu
        if on_cpu:  # vLLM bound its CPU forward when it built the layer
            layer._forward_method = layer.forward_cpu
    return captures
