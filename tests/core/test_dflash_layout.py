"""DFlash draft groups: the plugin's verdict on vLLM's own grouping, and the window plan (CPU).

A Qwen3-Next target (three Gated DeltaNet layers and one attention layer, 2 KV heads of 64, block
272 as on Hopper GPUs) with DFlash draft layers, grouped by vLLM 0.32 (``test_family_layouts.grouped``:
``get_kv_cache_groups``, the scheduler's config, vLLM's own ``KVCacheManager``). The specs are the
ones ``tests/tools/test_dflash_config.py`` reads from vLLM's DFlash layers: a full layer declares the
target's ``FullAttentionSpec`` (or its own, with other KV heads), a sliding layer a
``SlidingWindowSpec`` (docs/notes/spec-decode.md §11.1).

``plan_bundle`` on a window group (§11.3): pages below ``f = max(0, N - W + 1) // B`` are nulls,
the pages from ``f`` on are needed, and a missing one (a hole) plans no bundle.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from vllm_layouts import grouped

from boundary_checkpoints.core.boundaries import plan_bundle
from boundary_checkpoints.core.group_kinds import AttentionGroup, GroupKind, WindowGroup, first_window_page
from boundary_checkpoints.core.layout import describe_layout

BF16, F32 = torch.bfloat16, torch.float32
BLOCK = 272
WINDOW = 64


def target_specs() -> dict:
    """The tiny Qwen3-Next's KV cache specs: GDN conv (3, 512) bf16 + state (4, 64, 64) fp32, and
    one attention layer (2 KV heads of 64)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    gdn = MambaSpec(
        block_size=BLOCK, shapes=((3, 512), (4, 64, 64)), dtypes=(BF16, F32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align", num_speculative_blocks=3,
    )  # fmt: skip
    specs = {f"model.layers.{i}.linear_attn": gdn for i in range(3)}
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=BF16)
    specs["model.layers.3.self_attn.attn"] = attention
    return specs


def draft_specs(kinds: str, kv_heads: int = 2, extra_retained: int = 0) -> dict:
    """Draft layers ``model.layers.{4 + i}.self_attn.attn``: ``f`` full, ``s`` sliding (window 64)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = {}
    for i, kind in enumerate(kinds):
        name = f"model.layers.{4 + i}.self_attn.attn"
        if kind == "f":
            specs[name] = FullAttentionSpec(block_size=BLOCK, num_kv_heads=kv_heads, head_size=64, dtype=BF16)
        else:
            specs[name] = SlidingWindowSpec(
                block_size=BLOCK, num_kv_heads=kv_heads, head_size=64, dtype=BF16, sliding_window=WINDOW,
                extra_retained_tokens=extra_retained,
            )  # fmt: skip
    return specs


LAYOUTS = ("LBHNC", "BLHNC")  # layer-outermost and block-outermost KV cache tensors group differently


def judged(kinds: str, layout: str, **draft):
    """(geometries, reasons, geometry by layer name) of the target plus draft layers ``kinds``."""
    config, managers = grouped({**target_specs(), **draft_specs(kinds, **draft)}, layout)
    geometries, reasons = describe_layout(config, managers, num_spec_tokens=3)
    by_layer = {}
    for group, geometry in zip(config.kv_cache_groups, geometries, strict=True):
        for layer in group.layer_names:
            by_layer[layer] = geometry
    return geometries, reasons, by_layer


@pytest.mark.parametrize("kinds", ["fs", "sf", "fss"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_and_sliding_draft_layers_are_attention_and_window_groups(layout, kinds):
    """Mixed drafters (full layers of the target's spec, sliding layers): every group is supported;
    the sliding layers' group is WINDOW with the drafter's window, the full layers' ATTENTION (a
    group of their own, or the target's)."""
    geometries, reasons, by_layer = judged(kinds, layout)
    assert reasons == []
    for i, kind in enumerate("f" + kinds):  # the target's attention layer 3, then the drafter's
        geometry = by_layer[f"model.layers.{3 + i}.self_attn.attn"]
        want = (GroupKind.WINDOW, BLOCK, WINDOW) if kind == "s" else (GroupKind.ATTENTION, BLOCK, 0)
        assert (geometry.kind, geometry.block_size, geometry.window) == want
    assert [g.kind for g in geometries].count(GroupKind.WINDOW) == 1
    assert [g.label for g in geometries if g.kind is GroupKind.WINDOW] == [f"window/{BLOCK} w{WINDOW}"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_draft_layer_with_other_kv_heads(layout):
    """One KV head halves the draft page. Layer-outermost: vLLM doubles the draft group's block to
    the common page, so its bundle pages are planned on 544-token pages, the target's on 272.
    Block-outermost: it shares the target's group and block ids (272)."""
    _, reasons, by_layer = judged("f", layout, kv_heads=1)
    assert reasons == []
    draft, target = by_layer["model.layers.4.self_attn.attn"], by_layer["model.layers.3.self_attn.attn"]
    assert draft.kind is GroupKind.ATTENTION and target.block_size == BLOCK
    assert draft.block_size == (2 * BLOCK if layout == "LBHNC" else BLOCK)


def test_a_window_that_retains_pages_below_it_is_named():
    """Multi-module speculative decoding keeps pages below the window (extra_retained_tokens); the
    plugin plans no such pages, so the layout is named, never served."""
    config, managers = grouped({**target_specs(), **draft_specs("s", extra_retained=2)}, "LBHNC")
    _, reasons = describe_layout(config, managers, num_spec_tokens=3)
    assert reasons == [
        "sliding-window group (window 64, 1 layers) retains 2 tokens below its window (multi-module speculative "
        "decoding): the plugin's bundles hold the pages of the window only"
    ]


@dataclass(frozen=True)
class Block:
    block_id: int
    is_null: bool = False


NULL = Block(0, is_null=True)


def window_plan(n: int, blocks: list[Block], block: int = 4, window: int = 8):
    geometry = WindowGroup(block, 1, window)
    return plan_bundle([geometry], [blocks], n, NULL)


@pytest.mark.parametrize(
    ("n", "first"),
    [(1, 0), (7, 0), (8, 0), (11, 1), (12, 1), (29, 5), (32, 6), (33, 6)],
)  # fmt: skip
def test_window_plan_nulls_below_the_window_and_keeps_every_page_in_it(n, first):
    """Block 4, window 8: the next token at N reads rows [N - 7, N); pages below that row's page are
    listed as nulls (vLLM nulls them for a restored request too), the rest shared, the tail (N % 4)
    the copy source. N = 29 is the digest's example (f = 22 // 4 = 5)."""
    assert first_window_page(n, 4, 8) == first
    live = [Block(10 + i) for i in range(-(-n // 4) + 1)]  # one page past N, as a running request has
    blocks = [NULL] * first + live[first:]  # the producer's table: vLLM already freed the pages below f
    plan = window_plan(n, blocks)
    assert plan is not None
    assert plan.shared[0] == (NULL,) * first + tuple(live[first : n // 4])
    assert plan.sources[0] == (live[n // 4] if n % 4 else None)


@pytest.mark.parametrize("n", [11, 12, 29, 33])
def test_a_hole_in_the_window_plans_no_bundle(n):
    """A null page at any index the window needs (from f to the tail) means no bundle, never a
    bundle with a page missing; a null below f is no hole."""
    first = first_window_page(n, 4, 8)
    needed = -(-n // 4)
    live = [Block(10 + i) for i in range(needed)]
    for hole in range(first, needed):
        blocks = list(live)
        blocks[hole] = NULL
        assert window_plan(n, blocks) is None, hole
    if first:
        blocks = list(live)
        blocks[first - 1] = NULL
        assert window_plan(n, blocks) is not None


def test_a_window_wider_than_the_prefix_needs_every_page_like_attention():
    live = [Block(10 + i) for i in range(3)]
    window = window_plan(9, live, window=64)
    attention = plan_bundle([AttentionGroup(4, 1)], [live], 9, NULL)
    assert window == attention and window.shared[0] == tuple(live[:2]) and window.sources[0] == live[2]
