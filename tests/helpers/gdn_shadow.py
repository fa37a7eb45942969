"""Shadow check of the in-step split on a real Gated DeltaNet layer of a loaded engine.

:func:`compare` runs inside the engine's worker (``LLM.collective_rpc(compare)``) on its first
re-classed GDN layer, with that layer's real weights and KV cache, on random inputs:

* in step: one mixed batch (decode rows first, then prefill rows, some of them capture rows, and
  a zero-token padding row) through the plugin's ``_forward_core`` with the capture pairs begun,
  as a step would run it;
* reference: every row alone through vLLM's own core, a capture row in the two steps of the
  ``P - 1`` stop (its first ``L - 1`` tokens as a prefill, the state copied out, then its last
  token as a decode row).

It returns, per compared quantity, the largest absolute difference and whether it is bit-exact:
the outputs of every token, each capture row's captured conv and SSM state against the
reference's state after ``P - 1``, and every row's final state; and, as the negative control,
each capture row's state after ``P`` (what a capture after ``P`` would keep) against the same
state after ``P - 1``. ``rows`` breaks the outputs and final states down per row, beside the same
differences for stock's own step (the whole batch through vLLM's core, no capture): how far the
kernels move a row between a mixed batch and running alone, which the in-step split cannot beat
where it runs those rows as stock does; ``vs_stock_*`` is each row of the split against the same
row of stock's step, directly. Metadata is built here the way vLLM's GDN builder lays it out.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

# (tokens in this step, has an initial state, capture row); the first NUM_DECODES rows are decodes.
ROWS = [
    (1, True, False),
    (1, True, False),
    (5, False, False),
    (7, False, True),
    (3, True, True),  # fewer tokens before P - 1 than the conv window: part of its state is the initial one
    (70, True, False),
    (130, False, True),  # its last token opens the third chunk of the chunked kernel
    (2, False, True),  # a fresh two-token prompt: one token before P - 1
    (66, True, True),
]
NUM_DECODES = 2


def _metadata(rows, num_decodes, slots, device, cuda, padding: int = 0):
    """GDN metadata of ``rows`` ((tokens, has initial state), decodes first) on state ``slots``,
    followed by ``padding`` zero-token rows on the null block (as vLLM's builder may leave them)."""
    from boundary_checkpoints.compat import gdn_metadata_class
    from boundary_checkpoints.worker.gdn_split import with_kernel_metadata

    num_prefills = len(rows) - num_decodes
    rows, slots = [*rows, *[(0, False)] * padding], [*slots, *[0] * padding]
    starts = torch.tensor([0, *itertools.accumulate(length for length, _ in rows)], dtype=torch.int32)
    indices = torch.tensor(slots, dtype=torch.int32)
    has_initial = torch.tensor([initial for _, initial in rows])
    decode_tokens, num_tokens = int(starts[num_decodes]), int(starts[-1])
    metadata = gdn_metadata_class()(
        num_prefills=num_prefills, num_prefill_tokens=num_tokens - decode_tokens, num_decodes=num_decodes,
        num_decode_tokens=decode_tokens, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=num_tokens,
        non_spec_query_start_loc=starts.to(device), non_spec_state_indices_tensor=indices.to(device),
    )  # fmt: skip
    if not num_prefills:
        return metadata
    prefill_starts = starts[num_decodes:] - decode_tokens
    metadata = replace(
        metadata, has_initial_state=has_initial.to(device), prefill_query_start_loc=prefill_starts.to(device),
        prefill_state_indices=indices[num_decodes:].to(device),
        prefill_has_initial_state=has_initial[num_decodes:].to(device),
    )  # fmt: skip
    return with_kernel_metadata(metadata, starts, prefill_starts, device) if cuda else metadata


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    return float((got.float() - want.float()).abs().max()), bool(torch.equal(got, want))


@torch.inference_mode()
def compare(worker, seed: int = 0) -> dict:
    from vllm.forward_context import set_forward_context

    from boundary_checkpoints.compat import cpu_gdn_core, forward_context_layers, qwen_gdn_layer_class
    from boundary_checkpoints.worker.gdn_split import BoundaryQwenGDN

    config = worker.vllm_config
    layer = next(x for x in forward_context_layers(config) if isinstance(x, BoundaryQwenGDN))
    states = layer.kv_cache  # (conv, ssm), block id first
    device, cuda = states[1].device, states[1].device.type == "cuda"
    generator = torch.Generator().manual_seed(seed)
    slots = [10 + i for i in range(len(ROWS))]
    destinations = {slot: 100 + i for i, slot in enumerate(slots) if ROWS[i][2]}
    num_tokens = sum(length for length, _, _ in ROWS)
    qkv_dim = (2 * layer.key_dim + layer.value_dim) // layer.tp_size
    heads = layer.num_v_heads // layer.tp_size

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    mixed_qkv, b, a = rand(num_tokens, qkv_dim), rand(num_tokens, heads), rand(num_tokens, heads)
    initial = [rand(*state[slots].shape, dtype=state.dtype) for state in states]

    def reset() -> None:
        for state, values in zip(states, initial):
            state[slots] = values

    def core(metadata, x, b_, a_, out) -> None:
        with set_forward_context({layer.prefix: metadata}, config):
            if cuda:
                qwen_gdn_layer_class()._forward_core(layer, x, b_, a_, out)
            else:
                cpu_gdn_core(x, b_, a_, out, layer.prefix)

    def empty(n: int) -> torch.Tensor:
        return torch.zeros(n, heads, layer.head_v_dim, dtype=torch.bfloat16, device=device)

    # Reference: every row alone; a capture row in the two steps of the stop.
    reset()
    reference_out, after_p_minus_1 = empty(num_tokens), {}
    start = 0
    for i, (length, has_initial, capture) in enumerate(ROWS):
        tokens = slice(start, start + length)
        decode = i < NUM_DECODES
        first = length - 1 if capture else length
        out = empty(length)
        core(_metadata([(first, has_initial)], int(decode), [slots[i]], device, cuda),
             mixed_qkv[tokens][:first], b[tokens][:first], a[tokens][:first], out[:first])  # fmt: skip
        if capture:
            after_p_minus_1[slots[i]] = [state[slots[i]].clone() for state in states]
            last = slice(start + length - 1, start + length)
            core(_metadata([(1, True)], 1, [slots[i]], device, cuda), mixed_qkv[last], b[last], a[last], out[first:])
        reference_out[tokens] = out
        start += length
    reference_final = [state[slots].clone() for state in states]

    # Stock's own step: the whole batch through vLLM's core, no capture (the per-row control: how
    # far the kernels themselves move a row between a mixed batch and running alone).
    reset()
    stock_out = empty(num_tokens)
    batch = _metadata([row[:2] for row in ROWS], NUM_DECODES, slots, device, cuda, padding=1)
    core(batch, mixed_qkv, b, a, stock_out)
    stock_final = [state[slots].clone() for state in states]

    # In step: the whole batch through the plugin's layer.
    reset()
    for state in states:
        state[list(destinations.values())] = 0
    out = empty(num_tokens)
    captures = layer.boundary_captures
    captures.begin(destinations.items())
    with set_forward_context({layer.prefix: batch}, config):
        layer._forward_core(mixed_qkv, b, a, out)
    untaken = captures.end()

    result = {"device": device.type, "untaken": untaken, "outputs": _diff(out, reference_out), "final": [],
              "captured": [], "after_p": [], "rows": [],
              "output_scale": float(reference_out.float().abs().max())}  # fmt: skip
    for state, want in zip(states, reference_final):
        result["final"].append(_diff(state[slots], want))
    for slot, destination in destinations.items():
        for state, want in zip(states, after_p_minus_1[slot]):
            result["captured"].append(_diff(state[destination], want))
            result["after_p"].append(_diff(state[slot], want))  # the negative control
    start = 0
    for i, (length, has_initial, capture) in enumerate(ROWS):  # per row: in step and stock, each against the reference
        tokens = slice(start, start + length)
        start += length
        result["rows"].append({
            "tokens": length, "initial": has_initial, "capture": capture, "decode": i < NUM_DECODES,
            "outputs": _diff(out[tokens], reference_out[tokens])[0],
            "final": [_diff(state[slots[i]], want[i])[0] for state, want in zip(states, reference_final)],
            "stock_outputs": _diff(stock_out[tokens], reference_out[tokens])[0],
            "stock_final": [_diff(got[i], want[i])[0] for got, want in zip(stock_final, reference_final)],
            "vs_stock_outputs": _diff(out[tokens], stock_out[tokens])[0],
            "vs_stock_final": [_diff(state[slots[i]], got[i])[0] for state, got in zip(states, stock_final)],
        })  # fmt: skip
    return result
