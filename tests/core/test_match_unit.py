"""The prefix match unit the plugin gives vLLM (``match_unit.py``, ``worker/unit_choice.py``).

The unit is the indexer's pool where every recurrent layer saves states inside the prefill chunk,
a drafter runs and vLLM's hash block is the engine core's; vLLM's own resolver then accepts it
and hits land on it. Negative controls: a kernel without in-chunk states, a unit the user gave,
``prefix_match_unit: vllm``, ``policy: auto`` on a pair not validated, another executor.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled, resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from boundary_checkpoints import match_unit
from boundary_checkpoints.settings import BoundaryConfig, BoundaryConfigError
from boundary_checkpoints.worker.unit_choice import MatchUnitWorkerMixin

BLOCK, POOL, FLASHKDA = 4608, 16, 16
GLM = match_unit.UnitFacts(
    pool=POOL, speculative=True, prefix_caching=True, recurrent_alignments=(FLASHKDA, FLASHKDA), block_sizes=(BLOCK,)
)


def test_glm_on_flashkda_under_a_drafter_gets_the_pool():
    choice = match_unit.choose(GLM)
    assert choice.unit == 16
    assert "prefix match unit 16 tokens" in choice.why and "crosses a block boundary" in choice.why


def test_a_pool_finer_than_the_kernels_alignment_gets_their_common_multiple():
    assert match_unit.choose(match_unit.UnitFacts(**{**GLM.__dict__, "pool": 4})).unit == 16


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"pool": 0}, "no pooled indexer"),
        ({"speculative": False}, "no speculative decoding"),
        ({"prefix_caching": False}, "prefix caching is off"),
        ({"validated": False}, "not validated"),
        ({"engine_reads_config": False}, "uni executor"),
        ({"recurrent_alignments": (FLASHKDA, None)}, "saves no state inside the prefill chunk"),
        ({"recurrent_alignments": ()}, "saves no state inside the prefill chunk"),
        ({"block_sizes": (4600,)}, "does not divide"),
        ({"block_sizes": (16,)}, "does not divide"),
        ({"tokens_per_state": (32,)}, "off a compressed state's grid"),
        ({"shortest_prefill_row": 17}, "no longer than a verify row"),
        ({"whole_block_lookups": (BLOCK,)}, "finds hits only by whole blocks"),
    ],
)
def test_no_unit_where_vllm_would_not_keep_the_state_in_the_step(change, why):
    choice = match_unit.choose(match_unit.UnitFacts(**{**GLM.__dict__, **change}))
    assert choice.unit == 0 and why in choice.why


def test_apply_sets_the_unit_once_and_never_over_the_users():
    cache = SimpleNamespace(prefix_match_unit=None)
    assert match_unit.apply(cache, match_unit.AUTO, GLM) and cache.prefix_match_unit == 16
    assert match_unit.apply(cache, match_unit.AUTO, GLM) == ""  # set already: no second line
    given = SimpleNamespace(prefix_match_unit=4608)
    assert match_unit.apply(given, match_unit.AUTO, GLM) == "" and given.prefix_match_unit == 4608
    kept = SimpleNamespace(prefix_match_unit=None)
    assert match_unit.apply(kept, match_unit.VLLM, GLM) == "" and kept.prefix_match_unit is None


def test_the_setting_takes_auto_or_vllm_only():
    assert BoundaryConfig().prefix_match_unit == "auto"
    assert BoundaryConfig.from_additional_config({"boundary_checkpoints": {"prefix_match_unit": "vllm"}})
    with pytest.raises(BoundaryConfigError, match="boundary_checkpoints.prefix_match_unit"):
        BoundaryConfig.from_additional_config({"boundary_checkpoints": {"prefix_match_unit": 16}})


# ---------------------------------------------------------------------------------------------------
# The worker on vLLM's own specs, and vLLM's resolver on the unit it chose
# ---------------------------------------------------------------------------------------------------


def glm_specs(alignment: int | None) -> dict:
    recurrent = MambaSpec(
        block_size=BLOCK, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align",
        num_speculative_blocks=3, num_prefill_checkpoint_blocks=int(alignment is not None),
        prefill_checkpoint_alignment=alignment,
    )  # fmt: skip
    return {
        "kda.0": recurrent,
        "kda.1": recurrent,
        "attn.0": FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32),
        "ring.0": CircularBufferSpec(
            block_size=32, num_kv_heads=1, head_size=1, dtype=torch.float32, dcp_sharded=False
        ),
    }


class _StockWorker:
    def __init__(self, specs: dict, vllm_config) -> None:
        self.specs, self.vllm_config = specs, vllm_config

    def get_kv_cache_spec(self) -> dict:
        return self.specs


class _Worker(MatchUnitWorkerMixin, _StockWorker):
    pass


def engine_config(policy="request_boundaries", backend="uni", setting="auto", unit=None, method="mtp"):
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(index_kpool=POOL), architectures=["Glm5NextForCausalLM"]
        ),
        speculative_config=SimpleNamespace(method=method, num_speculative_tokens=3),
        cache_config=SimpleNamespace(enable_prefix_caching=True, prefix_match_unit=unit, block_size=BLOCK),
        parallel_config=SimpleNamespace(distributed_executor_backend=backend, decode_context_parallel_size=1),
        additional_config={"boundary_checkpoints": {"policy": policy, "prefix_match_unit": setting}},
        kv_transfer_config=None,
    )  # fmt: skip


def groups_of(specs: dict) -> list[KVCacheGroupSpec]:
    """``specs`` grouped by kind, one KV cache group each."""
    return [
        KVCacheGroupSpec([name for name, spec in specs.items() if type(spec) is kind], spec)
        for kind, spec in {type(s): s for s in specs.values()}.items()
    ]


def hash_block(specs: dict, config) -> int:
    """vLLM's own resolver on a KV cache of ``specs`` grouped by kind, under ``config``."""
    groups = groups_of(specs)
    kv_cache = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups, prefix_cache_retention_interval=0
    )
    return resolve_kv_cache_block_sizes(kv_cache, config)[1]


def test_the_worker_gives_vllm_the_pool_and_vllms_resolver_takes_it(caplog):
    config = engine_config()
    specs = glm_specs(FLASHKDA)
    with caplog.at_level(logging.INFO, logger="vllm"):
        assert _Worker(specs, config).get_kv_cache_spec() is specs
    assert config.cache_config.prefix_match_unit == 16
    assert hash_block(specs, config) == 16
    assert sum("prefix match unit 16 tokens" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "config",
    [
        engine_config(policy="auto", method="dflash"),  # GLM under DFlash is not on support.MATCH_UNIT_SPECULATIVE
        engine_config(backend="mp"),  # the engine core resolves its hash block from its own copy
        engine_config(setting="vllm"),
    ],
    ids=["auto-not-validated", "mp-executor", "setting-vllm"],
)
def test_the_worker_leaves_vllms_unit_alone(config):
    specs = glm_specs(FLASHKDA)
    _Worker(specs, config).get_kv_cache_spec()
    assert config.cache_config.prefix_match_unit is None
    assert hash_block(specs, config) == BLOCK


def test_auto_gives_vllm_the_pool_on_a_validated_pair():
    config = engine_config(policy="auto")  # GLM under MTP: on support.MATCH_UNIT_SPECULATIVE
    specs = glm_specs(FLASHKDA)
    _Worker(specs, config).get_kv_cache_spec()
    assert config.cache_config.prefix_match_unit == 16
    assert hash_block(specs, config) == 16


def test_a_kernel_without_in_chunk_states_keeps_the_block_negative_control():
    config = engine_config()
    specs = glm_specs(None)  # the Triton KDA kernel: no state inside the chunk
    _Worker(specs, config).get_kv_cache_spec()
    assert config.cache_config.prefix_match_unit is None
    assert hash_block(specs, config) == BLOCK


def vllm_finds_hits_between_blocks(specs: dict, unit: int) -> bool:
    """vLLM's own rule (``partial_hash_hits_enabled``) on ``specs`` at prefix match unit ``unit``."""
    groups = groups_of(specs)
    managers = [KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec) for group in groups]
    return partial_hash_hits_enabled(groups, unit, 1, managers)


def test_a_drafters_sliding_window_keeps_the_block():
    """GLM under DFlash: the drafter's sliding-window layer finds hits by whole blocks only, so at
    the pool vLLM itself would turn its hits between blocks off (its rule, on the same specs) and
    keep no prompt state there: the worker sets no unit, even under ``request_boundaries``. Without
    the window layer the same rule keeps them (the control)."""
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=2048)
    specs = {**glm_specs(FLASHKDA), "draft.0": window}
    assert not vllm_finds_hits_between_blocks(specs, POOL)
    assert vllm_finds_hits_between_blocks(glm_specs(FLASHKDA), POOL)
    config = engine_config()
    _Worker(specs, config).get_kv_cache_spec()
    assert config.cache_config.prefix_match_unit is None
    assert hash_block(specs, config) == BLOCK
