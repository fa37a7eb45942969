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
  then runs as two calls of vLLM's own core on derived metadata (:func:`split_rows`):
  1. the step without the last token of each capture row (its ``cu_seqlens`` entries shortened,
     the Triton kernels' chunk and conv metadata rebuilt): the batch the ``P - 1`` stop runs, so
     each capture row's slot then holds its conv and SSM state after ``P - 1``, which is copied
     into the row's destination block;
  2. those last tokens as one-token decode rows that read and write their slots: what the step
     after the stop runs for them.
  Outputs go back to their token positions. Every GDN kernel treats rows independently, so each
  row's outputs and states are those of the two-step run (bit for bit on the CPU kernels).
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

    keep: torch.Tensor  # token positions of call 1, ascending
    last: torch.Tensor  # token position of each capture row's last token
    slots: torch.Tensor  # each capture row's state index
    slot_ids: tuple[int, ...]  # the same indices on the host (no device read to learn them)
    destinations: torch.Tensor  # each capture row's destination block
    without_last: object  # metadata of call 1
    last_tokens: object  # metadata of call 2


def with_kernel_metadata(metadata, query_starts: torch.Tensor, prefill_starts: torch.Tensor, device):
    """``metadata`` with the CUDA core's Triton chunk metadata for the prefill ``cu_seqlens``
    ``prefill_starts`` and its causal-conv metadata for the batch's ``query_starts`` (both on CPU)."""
    chunk_indices, chunk_offsets = fla_chunk_metadata(prefill_starts, device)
    nums_dict, batch_ptr, token_chunk_offset_ptr = conv_metadata(query_starts, device)
    return replace(
        metadata, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, nums_dict=nums_dict,
        batch_ptr=batch_ptr, token_chunk_offset_ptr=token_chunk_offset_ptr,
    )  # fmt: skip


def split_rows(metadata, pairs: dict[int, int], rebuild_kernel_metadata: bool) -> RowSplit | None:
    """The split of a non-speculative GDN batch whose prefill rows with a state index in ``pairs``
    are capture rows (None: there are none). ``rebuild_kernel_metadata``: the CUDA core's Triton
    chunk and conv metadata follow the shortened rows. Every row of the batch keeps its place,
    zero-token padding rows included, so the per-row tensors of ``metadata`` still line up."""
    num_decodes, num_rows = metadata.num_decodes, metadata.num_decodes + metadata.num_prefills
    starts = metadata.non_spec_query_start_loc.cpu()  # zero-token padding rows (if any) follow the real ones
    indices = metadata.prefill_state_indices[: metadata.num_prefills].tolist()
    rows = [num_decodes + r for r, index in enumerate(indices) if index in pairs]
    if not rows:
        return None
    short = [row for row in rows if starts[row + 1] - starts[row] < 2]
    if short:
        raise RuntimeError(f"in-step capture rows {short} have fewer than two tokens")
    device = metadata.non_spec_query_start_loc.device
    num_tokens, n = int(starts[num_rows]), len(rows)
    last = [int(starts[row + 1]) - 1 for row in rows]
    shortened = starts.clone()
    for row in rows:
        shortened[row + 1 :] -= 1
    keep = torch.ones(num_tokens, dtype=torch.bool)
    keep[last] = False
    prefill_starts = shortened[num_decodes:] - metadata.num_decode_tokens
    without_last = replace(
        metadata,
        num_prefill_tokens=metadata.num_prefill_tokens - n,
        num_actual_tokens=num_tokens - n,
        non_spec_query_start_loc=shortened.to(device),
        prefill_query_start_loc=prefill_starts.to(device),
    )
    if rebuild_kernel_metadata:
        without_last = with_kernel_metadata(without_last, shortened, prefill_starts, device)
    slots = [indices[row - num_decodes] for row in rows]
    index_dtype = metadata.prefill_state_indices.dtype
    last_tokens = GDNMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=n, num_decode_tokens=n, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=n,
        non_spec_query_start_loc=torch.arange(n + 1, dtype=starts.dtype, device=device),
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=index_dtype, device=device),
    )  # fmt: skip
    return RowSplit(
        keep=keep.nonzero().flatten().to(device),
        last=torch.tensor(last, device=device),
        slots=torch.tensor(slots, device=device),
        slot_ids=tuple(slots),
        destinations=torch.tensor([pairs[slot] for slot in slots], device=device),
        without_last=without_last,
        last_tokens=last_tokens,
    )


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
        """The split of the batch ``metadata`` describes (computed once per step and KV group:
        its layers share the metadata object), or None."""
        if not self._pairs or metadata.num_prefills == 0 or metadata.spec_sequence_masks is not None:
            return None
        key = id(metadata)
        if key not in self._splits:
            with gpu_sync_allowed():  # reads the row layout: once per step and KV group with capture pairs
                split = split_rows(metadata, self._pairs, self.rebuild_kernel_metadata)
            self._splits[key] = (metadata, split)  # the metadata is kept so that its id stays unique
            if split is not None:
                self._taken.update(split.slot_ids)
        return self._splits[key][1]


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
        out = core_attn_out.new_zeros((len(split.keep), *core_attn_out.shape[1:]))
        with layer_metadata(self.prefix, split.without_last):
            self._vllm_core(mixed_qkv[split.keep], b[split.keep], a[split.keep], out)
        core_attn_out.index_copy_(0, split.keep, out)
        for state in self.kv_cache:  # conv and SSM state after P - 1 into the checkpoint's block
            state[split.destinations] = state[split.slots]
        out = core_attn_out.new_zeros((len(split.last), *core_attn_out.shape[1:]))
        with layer_metadata(self.prefix, split.last_tokens):
            self._vllm_core(mixed_qkv[split.last], b[split.last], a[split.last], out)
        core_attn_out.index_copy_(0, split.last, out)

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
