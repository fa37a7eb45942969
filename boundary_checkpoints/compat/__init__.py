"""Every vLLM 0.32 internal the plugin touches, in one package, so a version bump is one package.

Contract: the rest of the plugin reaches a private vLLM internal only through a name imported from
here (``from boundary_checkpoints.compat import X``), never from vLLM or from a submodule. Public
vLLM API used elsewhere: ``vllm.logger.init_logger`` and the OpenAI server / ``vllm.LLM``.
Importing this package loads the vLLM modules its submodules import eagerly (the scheduler and
KV cache classes, ``VllmConfig``, ``AggregateStatLoggerBase``); everything else is imported on
first call. Each submodule states the names and the behaviour it relies on:

* ``scheduler``: scheduler, KV cache manager, coordinator, block pool and request internals;
* ``worker``: worker, model runner and GDN layer internals (worker processes only);
* ``engine``: engine configuration, platform, plugin loading and the re-classing of instances;
* ``frontend``: the stat logger plugin base and the OpenAI server's classes;
* ``signatures``: the 0.32.0 signatures relied on and the checks against the installed vLLM.
"""

from boundary_checkpoints.compat.engine import (
    VllmConfig,
    allowed_vllm_plugins,
    engine_tokenizer,
    gdn_prefill_backend,
    indexer_requires_uniform_decode_rows,
    mixed_batches_replay_full_graphs,
    platform_is_cpu,
    platform_name,
    reclass_instance,
    restore_class,
)
from boundary_checkpoints.compat.frontend import AggregateStatLoggerBase, openai_serving_classes
from boundary_checkpoints.compat.scheduler import (
    STATS_CARRIER_FIELD,
    AsyncScheduler,
    BlockPool,
    CircularBufferManager,
    FullAttentionManager,
    KVCacheBlock,
    KVCacheBlockCopy,
    KVCacheBlocks,
    KVCacheManager,
    MambaAttentionBackendEnum,
    MambaManager,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    SlidingWindowManager,
    block_grid_hit,
    copy_kv_cache_blocks_inplace,
    free_queue_order,
    request_blocks,
    sampled_token_ids,
    single_type_managers,
    watermark_blocks,
)
from boundary_checkpoints.compat.signatures import frontend_interface_mismatches, interface_mismatches
from boundary_checkpoints.compat.worker import (
    conv_metadata,
    cpu_gdn_core,
    cpu_worker_class,
    fla_chunk_metadata,
    forward_context_layers,
    forward_context_metadata,
    forward_metadata,
    gdn_metadata_class,
    gpu_sync_allowed,
    gpu_worker_class,
    layer_metadata,
    qwen_gdn_layer_class,
    recurrent_layer_base,
    v1_model_runner_class,
)

__all__ = [
    "STATS_CARRIER_FIELD",
    "AggregateStatLoggerBase",
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
    "VllmConfig",
    "allowed_vllm_plugins",
    "block_grid_hit",
    "conv_metadata",
    "copy_kv_cache_blocks_inplace",
    "free_queue_order",
    "cpu_gdn_core",
    "cpu_worker_class",
    "engine_tokenizer",
    "fla_chunk_metadata",
    "forward_context_layers",
    "forward_context_metadata",
    "forward_metadata",
    "frontend_interface_mismatches",
    "gdn_metadata_class",
    "gdn_prefill_backend",
    "gpu_sync_allowed",
    "gpu_worker_class",
    "indexer_requires_uniform_decode_rows",
    "interface_mismatches",
    "layer_metadata",
    "mixed_batches_replay_full_graphs",
    "openai_serving_classes",
    "platform_is_cpu",
    "platform_name",
    "qwen_gdn_layer_class",
    "reclass_instance",
    "recurrent_layer_base",
    "request_blocks",
    "restore_class",
    "sampled_token_ids",
    "single_type_managers",
    "v1_model_runner_class",
    "watermark_blocks",
]
