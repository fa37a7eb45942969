"""The plugin's verdict on each family's KV cache layout, as vLLM 0.32 groups it (CPU, no engine).

The KV cache specs are the ones each family's layers declare (``docs/notes/model-families.md``
§1-§3), built by hand at the dims of the tiny fixtures (``fixtures/*_family.py``): vLLM's model
classes for GLM and Kimi cannot be built on CPU. vLLM's own grouping (``get_kv_cache_groups``
after ``register_all_kvcache_specs``, then ``get_kv_cache_config_from_groups`` and the scheduler's
``generate_scheduler_kv_cache_config``) and vLLM's own ``KVCacheManager`` give the groups and
managers that ``describe_layout`` judges. Block sizes follow vLLM's hybrid formula for these dims
(attention block = the smallest multiple of the alignment whose attention page holds a recurrent
state): 256 for GLM (MLA 1024 B/token, alignment 128), 128 for Kimi (MLA 1152 B/token), 272 for
Nemotron-H (attention 512 B/token, alignment 16). GLM is also judged with the DFlash drafter of
the GPU test's GLM case (a full-attention and a sliding-window draft layer, 4 KV heads of 64) at
k = 3, and with a ring or a window it cannot restore (negative controls).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from shadow_scheduler import build_scheduler
from vllm_layouts import grouped

from boundary_checkpoints.core.group_kinds import GroupKind
from boundary_checkpoints.core.layout import (
    CPU_MAMBA2_REASON,
    describe_layout,
    group_page_bytes,
    ring_span_at_boundary,
    tail_ring_slots,
)
from boundary_checkpoints.settings import BoundaryConfigError

BF16, F32 = torch.bfloat16, torch.float32
GLM_BLOCK, KIMI_BLOCK, NEMOTRON_BLOCK = 256, 128, 272
KPOOL = 4
DRAFT_KV_HEADS, DRAFT_WINDOW = 4, 64  # the GLM DFlash drafter of tests/gpu/test_gpu_dflash.py


def kda_spec(block: int, num_spec: int = 0):
    """KDA (GLM and Kimi, 2 heads of 128, conv 4): conv (3, 3 * 2 * 128) bf16 + state (2, 128, 128) fp32,
    with ``num_spec`` speculative state blocks (align mode under MTP)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block, shapes=((3, 768), (2, 128, 128)), dtypes=(BF16, F32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align", num_speculative_blocks=num_spec,
    )  # fmt: skip


def glm_specs(ring: int = KPOOL, mla_layers: tuple[int, ...] = (3,), num_spec: int = 0) -> dict:
    """3 KDA layers and one sparse MLA layer: latent (head 512), indexer keys (128 fp8 + 4 scale
    bytes per pool of KPOOL tokens, same block ids) and the tail ring of ``ring`` slots.
    ``mla_layers=(3, 4)`` adds the MTP layer of ``glm5_next_mtp`` (vLLM builds it as one more
    sparse MLA layer with its own indexer and ring); ``num_spec``: the KDA layers' speculative blocks."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MLAAttentionSpec, SparseCacheRole

    specs = {f"model.layers.{i}.self_attn": kda_spec(GLM_BLOCK, num_spec) for i in range(3)}
    for i in mla_layers:
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=GLM_BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER, tokens_per_state=KPOOL,
        )  # fmt: skip
        specs[f"model.layers.{i}.self_attn.mla_attn"] = MLAAttentionSpec(
            block_size=GLM_BLOCK, num_kv_heads=1, head_size=512, dtype=BF16, cache_role=SparseCacheRole.SPARSE,
            is_index_group_leader=True,
        )  # fmt: skip
        specs[f"model.layers.{i}.self_attn.indexer.tail"] = CircularBufferSpec(
            block_size=ring, num_kv_heads=2, head_size=128, head_size_v=0, dtype=BF16, dcp_sharded=False
        )
    return specs


def glm_tail_ring(kpool: int, num_spec_tokens: int) -> int:
    """vLLM 0.32's ring size (``models/glm5next/common/attention.py``, ``Glm5NextTailCache``): room
    for a pool plus the drafts, rounded up to a power-of-two number of pools."""
    from vllm.utils.math_utils import cdiv, next_power_of_2

    return kpool * next_power_of_2(cdiv(kpool + num_spec_tokens, kpool))


def glm_dflash_specs(k: int, ring: int, window_retained: int = 0) -> dict:
    """GLM (``glm_specs``, KDA with ``k`` speculative blocks, no MTP layer) plus the GPU GLM case's
    DFlash drafter (``fixtures/dflash.py`` for ``glm5_next_mtp_planted``: 4 KV heads of 64, the
    draft layers numbered after GLM's): layer 4 full attention, layer 5 sliding, window
    ``DRAFT_WINDOW``, keeping ``window_retained`` tokens below it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = glm_specs(ring, num_spec=k)
    specs["model.layers.4.self_attn.attn"] = FullAttentionSpec(
        block_size=GLM_BLOCK, num_kv_heads=DRAFT_KV_HEADS, head_size=64, dtype=BF16
    )
    specs["model.layers.5.self_attn.attn"] = SlidingWindowSpec(
        block_size=GLM_BLOCK, num_kv_heads=DRAFT_KV_HEADS, head_size=64, dtype=BF16, sliding_window=DRAFT_WINDOW,
        extra_retained_tokens=window_retained,
    )  # fmt: skip
    return specs


def kimi_specs() -> dict:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    specs = {f"model.layers.{i}.self_attn": kda_spec(KIMI_BLOCK) for i in range(3)}
    latent = MLAAttentionSpec(block_size=KIMI_BLOCK, num_kv_heads=1, head_size=576, dtype=BF16)
    specs["model.layers.3.self_attn.attn"] = latent
    return specs


def nemotron_specs() -> dict:
    """Mamba2 (8 heads of 64, state 64, one group: conv (3, 512 + 2 * 64) + SSM (8, 64, 64) fp32,
    with MambaMixer2's prefill-checkpoint block) twice, and one attention layer (2 KV heads of 64)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mamba2 = MambaSpec(
        block_size=NEMOTRON_BLOCK, shapes=((3, 640), (8, 64, 64)), dtypes=(BF16, F32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2, mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1,
    )  # fmt: skip
    attention = FullAttentionSpec(block_size=NEMOTRON_BLOCK, num_kv_heads=2, head_size=64, dtype=BF16)
    return {
        "backbone.layers.0.mixer": mamba2, "backbone.layers.1.mixer.attn": attention, "backbone.layers.2.mixer": mamba2,
    }  # fmt: skip


def test_glm_layout_with_its_pool_size_is_supported_and_counts_the_mixed_group():
    """KDA groups are recurrent; latent + indexer share one attention group whose block moves both
    pages (the scheduler's group spec is only the first layer's); the ring of one pool is a RING
    group of the pool size. GLM's indexer backend needs BLHNC (note §1)."""
    specs = glm_specs()
    config, managers = grouped(specs, "BLHNC")
    geometries, reasons = describe_layout(config, managers, kpool=KPOOL)
    assert reasons == []
    assert [g.kind for g in geometries] == [GroupKind.RECURRENT] * 3 + [GroupKind.ATTENTION, GroupKind.RING]
    assert [g.block_size for g in geometries] == [GLM_BLOCK] * 4 + [KPOOL]
    [mixed] = [g for g in config.kv_cache_groups if len(g.layer_names) == 2]
    latent_and_keys = sum(specs[name].page_size_bytes for name in mixed.layer_names)
    assert geometries[3].page_bytes == group_page_bytes(config, mixed) == latent_and_keys
    assert latent_and_keys != mixed.kv_cache_spec.page_size_bytes * 2  # the count before: first spec x layers
    assert geometries[4].page_bytes == specs["model.layers.3.self_attn.indexer.tail"].page_size_bytes


@pytest.mark.parametrize(("kpool", "why"), [
    (None, "of a model without index_kpool cannot be restored"),
    (KPOOL // 2, "is not the ring of 2 slots vLLM sizes for a pool of 2 tokens and 0 draft tokens"),
])  # fmt: skip
def test_glm_ring_without_a_matching_pool_is_named(kpool, why):
    config, managers = grouped(glm_specs(), "BLHNC")
    _, reasons = describe_layout(config, managers, kpool=kpool)
    assert reasons == [
        f"GLM indexer tail ring (1 layers, 4 slots, CircularBufferManager) {why}: vLLM gives a restored "
        "request a fresh ring, so a restore off the kpool grid would compress its open pool from keys it never "
        "wrote (docs/notes/model-families.md 6.1-6.2)"
    ]


@pytest.mark.parametrize("k", [1, 3])
def test_glm_layout_under_mtp_accepts_the_lookahead_ring(k):
    """``glm5_next_mtp`` under MTP: every ring (the target's and the MTP layer's, one group) holds
    the pool plus ``k`` drafts -- 8 slots for a pool of 4 at k = 1 and 3, as vLLM sizes it and as
    the plugin computes it -- and is a RING group of 8 slots over the pool of 4 (the MTP layer's
    latent and keys are attention groups too)."""
    ring = glm_tail_ring(KPOOL, k)
    assert ring == tail_ring_slots(KPOOL, k) == 8
    config, managers = grouped(glm_specs(ring, mla_layers=(3, 4), num_spec=k), "BLHNC")
    geometries, reasons = describe_layout(config, managers, kpool=KPOOL, num_spec_tokens=k)
    assert reasons == []
    [ring_group] = [g for g in geometries if g.kind is GroupKind.RING]
    assert (ring_group.block_size, ring_group.pool) == (8, KPOOL)
    assert {g.kind for g in geometries} == {GroupKind.RECURRENT, GroupKind.ATTENTION, GroupKind.RING}


@pytest.mark.parametrize(("k", "slots"), [(3, KPOOL), (1, 16)])
def test_glm_layout_under_mtp_refuses_another_ring_size(k, slots):
    """A ring that is not the one vLLM sizes for (kpool, k) -- one pool, or twice the lookahead --
    stays refused, naming the expected size."""
    config, managers = grouped(glm_specs(slots, mla_layers=(3, 4), num_spec=k), "BLHNC")
    _, reasons = describe_layout(config, managers, kpool=KPOOL, num_spec_tokens=k)
    assert reasons == [
        f"GLM indexer tail ring (2 layers, {slots} slots, CircularBufferManager) is not the ring of 8 slots vLLM "
        f"sizes for a pool of {KPOOL} tokens and {k} draft tokens: vLLM gives a restored request a fresh ring, so "
        "a restore off the kpool grid would compress its open pool from keys it never wrote "
        "(docs/notes/model-families.md 6.1-6.2)"
    ]


@pytest.mark.parametrize(("kpool", "k", "ok"), [(4, 1, True), (4, 2, True), (4, 3, True), (4, 4, False),
                                                (4, 5, True), (16, 3, True), (16, 8, True), (2, 2, True)])  # fmt: skip
def test_ring_span_against_vllm_ring_size(kpool, k, ok):
    """The whole-block copy is exact when the open pool and every key written past the boundary
    (``2k - 1`` positions under MTP) fit in vLLM's ring; k = 4 on a pool of 4 overruns 8 slots."""
    assert tail_ring_slots(kpool, k) == glm_tail_ring(kpool, k)
    assert (ring_span_at_boundary(kpool, k) <= tail_ring_slots(kpool, k)) is ok


def test_glm_layout_under_dflash_accepts_the_draft_groups_and_the_lookahead_ring():
    """``glm5_next_mtp_planted`` with the GPU case's DFlash drafter at k = 3 (vLLM's block-outermost
    layout, which GLM's indexer needs): KDA groups recurrent, the ring of 8 slots a RING group over
    the pool of 4 (vLLM sizes it by k whatever the method), the draft full-attention layer in an
    ATTENTION group (its page per token, 2 x 4 x 64 bf16, is the MLA latent's: vLLM groups it with
    the latent and the indexer keys, and one block of that group moves all three), the sliding
    layer a WINDOW group of the drafter's window."""
    k = 3
    specs = glm_dflash_specs(k, glm_tail_ring(KPOOL, k))
    config, managers = grouped(specs, "BLHNC")
    geometries, reasons = describe_layout(config, managers, kpool=KPOOL, num_spec_tokens=k)
    assert reasons == []
    by_layer = {
        layer: (geometry, group)
        for group, geometry in zip(config.kv_cache_groups, geometries, strict=True)
        for layer in group.layer_names
    }
    for i in range(3):
        assert by_layer[f"model.layers.{i}.self_attn"][0].kind is GroupKind.RECURRENT
    ring = by_layer["model.layers.3.self_attn.indexer.tail"][0]
    assert (ring.kind, ring.block_size, ring.pool, ring.label) == (GroupKind.RING, 8, KPOOL, "ring/8 p4")
    draft, group = by_layer["model.layers.4.self_attn.attn"]
    assert (draft.kind, draft.block_size) == (GroupKind.ATTENTION, GLM_BLOCK)
    assert draft.page_bytes == sum(specs[name].page_size_bytes for name in group.layer_names)
    window = by_layer["model.layers.5.self_attn.attn"][0]
    assert (window.kind, window.block_size, window.window) == (GroupKind.WINDOW, GLM_BLOCK, DRAFT_WINDOW)
    assert window.label == f"window/{GLM_BLOCK} w{DRAFT_WINDOW}"  # what the GPU test finds in the startup line


@pytest.mark.parametrize(("ring", "retained", "why"), [
    (KPOOL, 0, "GLM indexer tail ring (1 layers, 4 slots, CircularBufferManager) is not the ring of 8 slots"),
    (8, 2, "sliding-window group (window 64, 1 layers) retains 2 tokens below its window"),
])  # fmt: skip
def test_glm_layout_under_dflash_names_a_ring_or_window_it_cannot_restore(ring, retained, why):
    """Negative controls of the layout above: a ring of one pool (vLLM's size without drafts) and
    a draft window that keeps pages below it are each named, one reason, the rest still accepted."""
    config, managers = grouped(glm_dflash_specs(3, ring, retained), "BLHNC")
    _, reasons = describe_layout(config, managers, kpool=KPOOL, num_spec_tokens=3)
    assert len(reasons) == 1 and reasons[0].startswith(why), reasons


def test_kimi_layout_is_supported():
    specs = kimi_specs()
    for layout in ("LBHNC", "BLHNC"):
        config, managers = grouped(specs, layout)
        geometries, reasons = describe_layout(config, managers, on_cpu=True)
        assert reasons == []
        assert [g.kind for g in geometries] == [GroupKind.RECURRENT] * 3 + [GroupKind.ATTENTION]
        assert geometries[3].page_bytes == specs["model.layers.3.self_attn.attn"].page_size_bytes


def test_nemotron_layout_is_supported_on_gpu_and_named_on_cpu():
    for layout in ("LBHNC", "BLHNC"):
        config, managers = grouped(nemotron_specs(), layout)
        geometries, reasons = describe_layout(config, managers)
        assert reasons == []
        assert sorted(g.kind.value for g in geometries) == ["attention", "recurrent", "recurrent"]
        assert describe_layout(config, managers, on_cpu=True)[1] == [CPU_MAMBA2_REASON]  # named once


def test_the_startup_labels_name_vllm_in_chunk_checkpoints():
    """Mamba2 (and KDA on FlashKDA) export a state from inside a prefill chunk; the startup line's
    group labels say so, with the alignment, and groups without one say nothing."""
    config, managers = grouped(nemotron_specs(), "BLHNC")
    labels = sorted(g.label for g in describe_layout(config, managers)[0])
    assert labels == [f"attention/{NEMOTRON_BLOCK}", f"recurrent/{NEMOTRON_BLOCK} c1", f"recurrent/{NEMOTRON_BLOCK} c1"]
    flash_kda = {name: replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16)
                 if name.endswith("self_attn") else spec for name, spec in glm_specs().items()}  # fmt: skip
    for specs, recurrent in ((glm_specs(), f"recurrent/{GLM_BLOCK}"), (flash_kda, f"recurrent/{GLM_BLOCK} c16")):
        config, managers = grouped(specs, "BLHNC")
        geometries, reasons = describe_layout(config, managers, kpool=KPOOL)
        assert reasons == []
        assert [g.label for g in geometries if g.is_recurrent] == [recurrent] * 3


def test_kda_on_cpu_is_not_a_mamba2_reason():
    config, managers = grouped(kimi_specs(), "BLHNC")
    assert CPU_MAMBA2_REASON not in describe_layout(config, managers, on_cpu=True)[1]


def test_page_bytes_of_uniform_groups_are_unchanged():
    """Groups of one spec keep counting spec page x layers, whatever the tensor layout."""
    for layout in ("LBHNC", "BLHNC"):
        config, _ = grouped(kimi_specs(), layout)
        for group in config.kv_cache_groups:
            assert group_page_bytes(config, group) == group.kv_cache_spec.page_size_bytes * len(group.layer_names)


@pytest.mark.parametrize("policy", ["auto", "request_boundaries"])
def test_scheduler_on_the_glm_layout_without_index_kpool_falls_back(model_dir, policy):
    """vLLM's real scheduler with the plugin, over the GLM groups of a model config that has no
    ``index_kpool``: ``auto`` stays stock (the warning names the ring), an explicit
    ``request_boundaries`` refuses to start with the same reason."""
    config, _ = grouped(glm_specs(), "BLHNC")
    build = dict(policy=policy, block_size=GLM_BLOCK, max_num_batched_tokens=2048, max_model_len=4096,
                 kv_cache_groups=config.kv_cache_groups)  # fmt: skip
    if policy == "request_boundaries":
        with pytest.raises(BoundaryConfigError, match=r"tail ring \(1 layers, 4 slots.*without index_kpool"):
            build_scheduler(model_dir, **build)
    else:
        scheduler, _ = build_scheduler(model_dir, **build)
        assert not scheduler.boundaries_active
