"""Batched whole-page copies between KV cache blocks: one Triton launch for every capture of a step.

Contract
--------
:func:`copy_pages` copies, for every (source block, destination block) pair and every distinct KV
cache storage, the storage's whole page of the source block onto the page of the destination
block. A page holds one layer slot of whichever KV cache group owns the block: an attention page
(K and V rows of ``block_size`` tokens) or a recurrent state page (conv state and SSM/GDN state
back to back, in whatever dtypes vLLM chose, fp32 SSM state included), so one raw byte copy
serves every group, page size and dtype in the same launch. Nothing outside the destination pages
is written. Sources and destinations of one call must be distinct blocks.

Why not vLLM's copies: ``copy_kv_cache_blocks_inplace`` (vLLM's copy-on-write path, which
restores use unchanged) does a gather plus a scatter per storage, and
``mamba_utils.batch_memcpy`` runs one CTA per copy with byte loads; multi-MiB recurrent pages
need many CTAs per page and 8-byte accesses to approach copy bandwidth. The kernel below tiles
every page over ``TILE_WORDS`` 8-byte words per program: grid = (pages to copy, tiles of the
largest page), masked on each page's own size.

Storages that are not laid out block-outermost (a block's page is then not one contiguous span)
are copied with vLLM's ``copy_kv_cache_blocks_inplace`` instead, which handles strided views.
On CPU the same Triton kernel runs under ``TRITON_INTERPRET=1``; without Triton a byte-exact
torch copy of the same spans is used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

try:  # pragma: no cover - import guard
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover
    _HAS_TRITON = False

TILE_WORDS = 4096  # 32 KiB of 8-byte words per program


@dataclass(frozen=True)
class PageRegion:
    """A storage holding ``num_blocks`` contiguous pages of ``page_bytes`` from ``base``."""

    tensor: torch.Tensor  # a uint8 view over the whole storage, [num_blocks, page_bytes]
    page_bytes: int


def split_regions(
    kv_caches: Iterable[torch.Tensor], num_blocks: int
) -> tuple[list[PageRegion], list[torch.Tensor]]:
    """Block-outermost storages as page regions (once each), and the caches that are not."""
    regions: list[PageRegion] = []
    strided: list[torch.Tensor] = []
    seen: set[tuple[torch.device, int]] = set()
    for cache in kv_caches:
        storage = cache.untyped_storage()
        key = (cache.device, storage.data_ptr())
        if storage.nbytes() % num_blocks == 0 and cache.shape[0] % num_blocks == 0:
            page_bytes = storage.nbytes() // num_blocks
            block_stride = cache.stride(0) * cache.element_size() * (cache.shape[0] // num_blocks)
            if block_stride == page_bytes:
                if key not in seen:
                    seen.add(key)
                    view = torch.empty(0, dtype=torch.uint8, device=cache.device)
                    view.set_(storage)
                    regions.append(PageRegion(view.view(num_blocks, page_bytes), page_bytes))
                continue
        strided.append(cache)
    return regions, strided


if _HAS_TRITON:

    @triton.jit
    def _copy_pages_kernel(src_addrs, dst_addrs, num_words, TILE: tl.constexpr):
        page = tl.program_id(0)
        tile = tl.program_id(1)
        words = tl.load(num_words + page)
        offsets = tile * TILE + tl.arange(0, TILE)
        mask = offsets < words
        src = tl.load(src_addrs + page).to(tl.pointer_type(tl.uint64))
        dst = tl.load(dst_addrs + page).to(tl.pointer_type(tl.uint64))
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


# Triton decides at decoration time whether kernels are interpreted, so read the flag once.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def uses_triton(device: torch.device) -> bool:
    """Whether :func:`copy_pages` launches the Triton kernel for tensors on ``device``."""
    return _HAS_TRITON and (device.type == "cuda" or _INTERPRETED)


def copy_page_regions(regions: Sequence[PageRegion], pairs: Sequence[tuple[int, int]]) -> None:
    """Copy page ``src`` onto page ``dst`` in every region, in one launch per device."""
    if not pairs or not regions:
        return
    by_device: dict[torch.device, list[PageRegion]] = {}
    for region in regions:
        by_device.setdefault(region.tensor.device, []).append(region)
    for device, device_regions in by_device.items():
        if uses_triton(device) and all(r.page_bytes % 8 == 0 and r.tensor.data_ptr() % 8 == 0 for r in device_regions):
            _launch(device, device_regions, pairs)
        else:
            for region in device_regions:
                src = torch.tensor([s for s, _ in pairs], device=device)
                dst = torch.tensor([d for _, d in pairs], device=device)
                region.tensor[dst] = region.tensor[src]


def _launch(device: torch.device, regions: Sequence[PageRegion], pairs: Sequence[tuple[int, int]]) -> None:
    src_addrs, dst_addrs, words = [], [], []
    for region in regions:
        base = region.tensor.data_ptr()
        for src, dst in pairs:
            src_addrs.append(base + src * region.page_bytes)
            dst_addrs.append(base + dst * region.page_bytes)
            words.append(region.page_bytes // 8)
    table = torch.tensor([src_addrs, dst_addrs, words], dtype=torch.int64)
    table = table.to(device, non_blocking=True) if device.type == "cuda" else table
    max_tiles = triton.cdiv(max(words), TILE_WORDS)
    _copy_pages_kernel[(len(words), max_tiles)](table[0], table[1], table[2], TILE=TILE_WORDS)


def copy_pages(kv_caches: Sequence[torch.Tensor], num_blocks: int, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy block ``src`` onto block ``dst`` in every KV cache storage (see module contract)."""
    if not pairs:
        return
    regions, strided = split_regions(kv_caches, num_blocks)
    copy_page_regions(regions, pairs)
    if strided:
        from boundary_checkpoints.compat import KVCacheBlockCopy, copy_kv_cache_blocks_inplace

        copy_kv_cache_blocks_inplace(strided, num_blocks, [KVCacheBlockCopy(s, d) for s, d in pairs])
