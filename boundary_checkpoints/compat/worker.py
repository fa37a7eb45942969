"""vLLM 0.32's worker, model runner and GDN layer internals: the worker processes' side.

Contract: nothing here imports vLLM at import time; each function imports what it names on first
call, so the scheduler process never loads vLLM's worker, model runner or layer modules. Names and
the behaviour relied on:

* V1 ``GPUModelRunner`` (v1/worker/gpu_model_runner.py; the CPU engine's ``CPUModelRunner`` is a
  subclass, Model Runner V2 is not): the plugin's workers re-class the runner instance they built
  (:func:`reclass_instance`, ``__class__`` assignment) to a subclass that overrides ``_sample`` and
  ``_bookkeeping_sync`` (``worker/seeded.py``). Relied on: ``_sample`` runs the sampler for the
  step and ``_bookkeeping_sync`` runs after it in the same ``sample_tokens`` call;
  ``discard_request_mask.np[:input_batch.num_reqs]`` marks the rows whose sampled token is
  discarded (set before the forward); ``input_batch.generators`` maps a row to the request's
  ``torch.Generator`` (seeded requests only) and is the dict the sampler draws from; and
  ``_bookkeeping_sync`` rewinds the offset of the generators of discarded rows found in that dict
  (``set_offset(get_offset() - 4)``, which raises on a CPU generator). Imported lazily
  (:func:`v1_model_runner_class`): the scheduler process never loads the runner module.
* Worker base classes (imported lazily, in worker processes only: :func:`gpu_worker_class`,
  :func:`cpu_worker_class`): ``vllm.v1.worker.gpu_worker.Worker`` and
  ``vllm.v1.worker.cpu_worker.CPUWorker``, subclassed by ``worker/gpu.py`` and ``worker/cpu.py``
  (``execute_model(scheduler_output, ...)`` and ``compile_or_warm_up_model()`` overridden, the
  latter called once the KV cache is allocated and before any request; ``model_runner.kv_caches`` and
  ``model_runner.kv_cache_config.num_blocks`` read). ``CPUWorker.init_device`` builds
  ``self.model_runner``; ``Worker._make_model_runner`` (GPU) returns it.
* In-step prompt capture (``prompt_capture.py``, ``worker/gdn_split.py``; worker processes only,
  imported lazily): ``QwenGatedDeltaNetAttention`` (model_executor/layers/mamba/gdn/
  qwen_gdn_linear_attn.py), re-classed per instance (:func:`reclass_instance`) after
  ``Worker.load_model``, found in ``compilation_config.static_forward_context``
  (:func:`forward_context_layers`, the forward context's ``no_compile_layers``); every recurrent
  layer subclasses ``MambaBase``. Relied on: the custom op
  ``vllm::qwen_gdn_attention_core`` (called by ``forward_cuda``) looks the layer up in the forward
  context's ``no_compile_layers`` and calls its ``_forward_core(mixed_qkv, b, a, core_attn_out)``,
  which reads the layer's ``GDNAttentionMetadata`` from ``forward_context.attn_metadata[prefix]``
  (a dict per layer name outside DBO); ``forward_cpu`` computes the same projections as
  ``forward_cuda`` and calls ``vllm::cpu_gdn_attention_core`` (:func:`cpu_gdn_core`, same
  arguments, same metadata lookup), so the CPU subclass runs ``forward_cuda`` and calls the CPU
  core from ``_forward_core``. Metadata: rows ordered decodes first; without speculative decoding
  ``non_spec_query_start_loc`` / ``non_spec_state_indices_tensor`` cover every row,
  ``prefill_query_start_loc`` (rebased to the first prefill token) / ``prefill_state_indices`` /
  ``prefill_has_initial_state`` the prefill rows, ``chunk_indices`` / ``chunk_offsets`` (FLA Triton,
  :func:`fla_chunk_metadata`) follow ``prefill_query_start_loc``, ``nums_dict`` / ``batch_ptr`` /
  ``token_chunk_offset_ptr`` (Triton causal conv, :func:`conv_metadata`) follow
  ``non_spec_query_start_loc``; a decode row (one token, ``num_decodes``) reads and writes its state
  at its index; the state index of a row is the block holding its state after the step (align
  mode: column ``(end - 1) // B``), which the core reads the initial state from and writes the
  final conv and SSM state to; ``layer.kv_cache`` is ``(conv_state, ssm_state)``, both indexed by
  block id first. ``_resolve_gdn_prefill_backend(vllm_config)`` (:func:`gdn_prefill_backend`) is
  the kernel the layers pick; ``vllm.utils.gpu_sync_debug.gpu_sync_allowed`` marks the split's one
  device-to-host read per step (:func:`forward_context_metadata`: every KV group's metadata at once).
* The prefix match unit (``match_unit.py``): ``Worker.get_kv_cache_spec`` returns each layer's
  ``KVCacheSpec`` once the block size is resolved (``update_block_size_for_backend`` runs after
  ``load_model``); ``MambaSpec.mamba_cache_mode`` / ``prefill_checkpoint_alignment`` (None: no
  in-chunk state), every spec's ``prefix_cacheable``, ``block_size`` and ``tokens_per_state``
  (:func:`kv_spec_unit_facts`). The engine core then resolves its hash block from
  ``cache_config.prefix_match_unit`` (``resolve_kv_cache_block_sizes``) on the same ``VllmConfig``
  object the worker holds only under the ``uni`` executor, which runs the worker in the engine
  core's process (:func:`engine_core_shares_worker_config`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "conv_metadata",
    "cpu_gdn_core",
    "cpu_worker_class",
    "engine_core_shares_worker_config",
    "fla_chunk_metadata",
    "forward_context_layers",
    "forward_context_metadata",
    "forward_metadata",
    "gdn_metadata_class",
    "gpu_sync_allowed",
    "gpu_worker_class",
    "kv_spec_unit_facts",
    "layer_metadata",
    "qwen_gdn_layer_class",
    "recurrent_layer_base",
    "v1_model_runner_class",
]


def qwen_gdn_layer_class() -> type:
    """vLLM's ``QwenGatedDeltaNetAttention``."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    return QwenGatedDeltaNetAttention


def recurrent_layer_base() -> type:
    """``MambaBase``: the base of every recurrent mixer layer (GDN, KDA, Mamba2, ...)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return MambaBase


def gdn_metadata_class() -> type:
    """``GDNAttentionMetadata``."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    return GDNAttentionMetadata


def cpu_gdn_core(mixed_qkv, b, a, core_attn_out, layer_name: str) -> None:
    """vLLM's CPU GDN core (the body of ``vllm::cpu_gdn_attention_core``)."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import cpu_gdn_attention_core

    cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name)


def fla_chunk_metadata(prefill_query_start_loc_cpu):
    """``(chunk_indices, chunk_offsets)`` of the FLA Triton chunk kernel for these prefill
    ``cu_seqlens``, on the CPU (as ``GDNAttentionMetadataBuilder._build_chunk_metadata`` makes
    them before moving them to the device)."""
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    return (prepare_chunk_indices(prefill_query_start_loc_cpu, FLA_CHUNK_SIZE),
            prepare_chunk_offsets(prefill_query_start_loc_cpu, FLA_CHUNK_SIZE))  # fmt: skip


def conv_metadata(query_start_loc_cpu, device):
    """``(nums_dict, batch_ptr, token_chunk_offset_ptr)`` of the Triton causal conv kernel."""
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    return compute_causal_conv1d_metadata(query_start_loc_cpu, device=device)


def gpu_sync_allowed():
    """vLLM's context that marks a deliberate device-to-host read (its sync checker's allowlist)."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed as allowed

    return allowed()


def forward_metadata(layer_name: str):
    """The attention metadata of ``layer_name`` in the current forward pass, or None (no metadata:
    a profile or warm-up run; a list of them: DBO micro-batches)."""
    from vllm.forward_context import get_forward_context

    table = get_forward_context().attn_metadata
    return table.get(layer_name) if isinstance(table, dict) else None


def forward_context_layers(vllm_config) -> list:
    """The layers vLLM registered for its forward context (``static_forward_context``, by prefix)."""
    return list(vllm_config.compilation_config.static_forward_context.values())


def forward_context_metadata() -> list:
    """Every attention metadata object of the current forward pass (one per KV group; layers of a
    group share theirs), or [] (no metadata, or DBO micro-batches)."""
    from vllm.forward_context import get_forward_context

    table = get_forward_context().attn_metadata
    return [*{id(m): m for m in table.values()}.values()] if isinstance(table, dict) else []


@contextmanager
def layer_metadata(layer_name: str, metadata) -> Iterator[None]:
    """Make ``metadata`` the attention metadata the current forward context gives ``layer_name``
    for the duration of the block."""
    from vllm.forward_context import get_forward_context

    table = get_forward_context().attn_metadata
    saved = table[layer_name]
    table[layer_name] = metadata
    try:
        yield
    finally:
        table[layer_name] = saved


def v1_model_runner_class() -> type:
    """vLLM's V1 ``GPUModelRunner`` (base of the CPU engine's runner); imported on first call."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def gpu_worker_class() -> type:
    """vLLM's GPU ``Worker`` (Model Runner V2 or V1); imported on first call."""
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def cpu_worker_class() -> type:
    """vLLM's ``CPUWorker``; imported on first call."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    return CPUWorker


def kv_spec_unit_facts(specs: dict) -> dict[str, tuple]:
    """From a worker's ``get_kv_cache_spec()``, keyed as ``match_unit.UnitFacts``' fields: each
    recurrent (align-mode ``MambaSpec``) layer's in-chunk checkpoint alignment (None where it saves
    none, or runs another cache mode); each prefix-cacheable spec's block size and tokens per state
    above 1; and the block sizes of those whose vLLM manager finds hits only by whole blocks
    (``supports_fine_grained_hash_lookup`` false, as a drafter's sliding window), where vLLM turns
    hits between blocks off unless the unit is that block (``partial_hash_hits_enabled``)."""
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    alignments: list[int | None] = []
    blocks: set[int] = set()
    per_state: set[int] = set()
    whole_blocks: set[int] = set()
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            in_chunk = spec.mamba_cache_mode == "align" and spec.num_prefill_checkpoint_blocks > 0
            alignments.append(spec.prefill_checkpoint_alignment if in_chunk else None)
        if not spec.prefix_cacheable:
            continue
        blocks.add(spec.block_size)
        manager = KVCacheSpecRegistry.get_manager_class(spec)
        if manager is not None and not manager.supports_fine_grained_hash_lookup:
            whole_blocks.add(spec.block_size)
        try:
            tokens = spec.tokens_per_state
        except NotImplementedError:
            continue
        if isinstance(tokens, int) and tokens > 1:
            per_state.add(tokens)
    return {
        "recurrent_alignments": tuple(alignments),
        "block_sizes": tuple(sorted(blocks)),
        "tokens_per_state": tuple(sorted(per_state)),
        "whole_block_lookups": tuple(sorted(whole_blocks)),
    }


def engine_core_shares_worker_config(vllm_config) -> bool:
    """Whether the engine core reads the worker's own ``VllmConfig`` (the ``uni`` executor)."""
    return getattr(vllm_config.parallel_config, "distributed_executor_backend", None) == "uni"
