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

import numpy as np
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


class PageCopier:
    """Copies pages of a fixed set of KV cache tensors; built once per KV cache allocation.

    The storage split and the per-region base addresses are computed here once, so a step's copy
    only builds its address table (vectorized) and launches: host work stays in the microseconds
    that a multi-MiB page copy takes on the device.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], num_blocks: int) -> None:
        self.num_blocks = num_blocks
        regions, self.strided = split_regions(kv_caches, num_blocks)
        self.triton_regions: dict[torch.device, list[PageRegion]] = {}
        self.torch_regions: list[PageRegion] = []
        for region in regions:
            aligned = region.page_bytes % 8 == 0 and region.tensor.data_ptr() % 8 == 0
            if aligned and uses_triton(region.tensor.device):
                self.triton_regions.setdefault(region.tensor.device, []).append(region)
            else:
                self.torch_regions.append(region)
        self._tables = {
            device: (
                np.array([r.tensor.data_ptr() for r in group], dtype=np.int64),
                np.array([r.page_bytes for r in group], dtype=np.int64),
            )
            for device, group in self.triton_regions.items()
        }

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        ids = np.asarray(pairs, dtype=np.int64)
        for device, (bases, page_bytes) in self._tables.items():
            src = (bases[:, None] + ids[None, :, 0] * page_bytes[:, None]).ravel()
            dst = (bases[:, None] + ids[None, :, 1] * page_bytes[:, None]).ravel()
            words = np.repeat(page_bytes // 8, len(ids))
            table = torch.from_numpy(np.stack([src, dst, words]))
            if device.type == "cuda":
                table = table.to(device)  # a few hundred bytes; pinning would cost more
            max_tiles = triton.cdiv(int(words.max()), TILE_WORDS)
            _copy_pages_kernel[(len(words), max_tiles)](table[0], table[1], table[2], TILE=TILE_WORDS, num_warps=8)
        if self.torch_regions:
            device = self.torch_regions[0].tensor.device
            src = torch.as_tensor(ids[:, 0], device=device)
            dst = torch.as_tensor(ids[:, 1], device=device)
            for region in self.torch_regions:
                region.tensor[dst] = region.tensor[src]
        if self.strided:
            from boundary_checkpoints.compat import KVCacheBlockCopy, copy_kv_cache_blocks_inplace

            copies = [KVCacheBlockCopy(int(s), int(d)) for s, d in ids]
            copy_kv_cache_blocks_inplace(self.strided, self.num_blocks, copies)


def copy_pages(kv_caches: Sequence[torch.Tensor], num_blocks: int, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy block ``src`` onto block ``dst`` in every KV cache storage (see module contract)."""
    PageCopier(kv_caches, num_blocks).copy(pairs)
