"""vLLM's own grouping of a model's KV cache specs, for the layout tests
(``tests/core/test_family_layouts.py``, ``tests/core/test_dflash_layout.py``)."""

from __future__ import annotations


def grouped(specs: dict, layout: str):
    """vLLM's scheduler view of ``specs`` (layers grouped and packed as the engine would) and the
    single-type managers a ``KVCacheManager`` builds for it."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = layout
    register_all_kvcache_specs(vllm_config)
    groups = get_kv_cache_groups(vllm_config, specs)
    config = generate_scheduler_kv_cache_config([get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)])
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(config, vllm_config)
    manager = KVCacheManager(config, 4096, scheduler_block, hash_block, enable_caching=True)
    return config, manager.coordinator.single_type_managers
