"""The kinds of KV cache group a bundle covers, one class each: what a bundle at ``N`` holds of a
group, and how its capture runs.

Contract
--------
:class:`GroupGeometry` is a group's geometry (block size, page bytes, window, pool) and its kind's
behaviour: :meth:`GroupGeometry.bundle_blocks` plans the group's part of a bundle at ``N`` from a
request's live block table -- the blocks shared as they are, and the one block whose content must
be preserved (copied to a private block, or adopted when the producer has finished) -- or None
when the table lacks a block the bundle needs. ``core/layout.py`` builds the geometries,
``core/boundaries.py`` (:func:`plan_bundle`) assembles a bundle from them; the scheduler asks them
``is_recurrent``, ``is_ring`` and ``captured_in_forward`` instead of comparing kinds.
:class:`GroupKind` is only the tag a label and a test read.

* :class:`AttentionGroup`, page size ``B``: the ``N // B`` full pages are shared (nothing writes a
  full page again); when ``N % B != 0`` the page holding rows ``[N // B * B, N)`` is the *tail*,
  preserved. Rows ``>= N`` of that page are never read by a consumer, which writes its own rows into
  a copy-on-write page (vLLM's partial-hit path).
* :class:`WindowGroup`, page size ``B``, window ``W`` (a DFlash drafter's sliding layers,
  docs/notes/spec-decode.md §11.3): the next token at ``N`` attends rows ``[N - W + 1, N)``, so the
  pages from ``f = max(0, N - W + 1) // B`` on are planned as for an attention group and the pages
  below ``f`` are listed as null blocks, which is what vLLM gives a restored request there anyway.
  A null page at an index ``>= f`` (a *hole*: a page vLLM already freed) means no bundle.
* :class:`RecurrentGroup`, block size ``B``: the running state sits in block ``(E - 1) // B`` right
  after the step that ended at ``E`` (``state_end``: ``N``, or under speculative decoding the end of
  the producer's last step, drafts included); that block is preserved and listed at
  ``(N - 1) // B`` after null padding, as vLLM's hits do. Under in-step capture the GDN layers write
  the state after ``N`` into the bundle's block during the forward (``worker/gdn_split.py``).
* :class:`RingGroup` (the GLM-5.3-Flash indexer's tail ring, one block per request for its
  lifetime, ``core/layout.py``): right after the step that computed token ``N - 1`` the request's
  only block holds the raw keys of the pool in progress, tokens ``[N // kpool * kpool, N)``, at
  slots ``pos % slots`` (under MTP the ring has lookahead slots, and no key the producer wrote past
  ``N - 1`` wraps onto them: ``ring_span_at_boundary``); it is preserved whole and the bundle lists
  just that block. vLLM never restores this group: the scheduler copies the bundle's block into the
  consumer's own ring (contract 11).

Imports nothing of vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from boundary_checkpoints.core.checkpoint import BlockLike

GroupBlocks = tuple[tuple[BlockLike, ...], BlockLike | None]  # (shared blocks, preserved block or None)


class GroupKind(Enum):
    ATTENTION = "attention"
    WINDOW = "window"
    RECURRENT = "recurrent"
    RING = "ring"


def first_window_page(num_tokens: int, block_size: int, window: int) -> int:
    """Index of the first page a sliding-window group needs to resume at ``num_tokens``: the page
    of row ``num_tokens - window + 1``, the oldest row the next token attends (vLLM's
    ``SlidingWindowManager.get_num_skipped_tokens``); pages below it are never read again."""
    return max(0, num_tokens - window + 1) // block_size


@dataclass(frozen=True)
class GroupGeometry(ABC):
    """One KV cache group: its geometry and its kind's part of a bundle (module docstring)."""

    kind: ClassVar[GroupKind]
    is_recurrent: ClassVar[bool] = False  # holds a running state that every token overwrites
    is_ring: ClassVar[bool] = False  # the indexer tail ring, restored by the scheduler's own copy
    captured_in_forward: ClassVar[bool] = False  # in-step capture writes it during the forward

    block_size: int
    page_bytes: int
    window: int = 0  # WINDOW groups: the sliding window in tokens
    pool: int = 0  # RING groups: the indexer's pool (index_kpool); block_size is the ring's slots
    # RECURRENT groups whose kernels write a state inside a prefill chunk (vLLM's
    # num_prefill_checkpoint_blocks: Mamba2, KDA on FlashKDA): its alignment in tokens
    in_chunk_alignment: int = 0

    @property
    def label(self) -> str:
        """``kind/block`` (window groups: ``window/block w<window>``; ring groups ``ring/slots p<pool>``;
        recurrent groups with vLLM's in-chunk checkpoint ``recurrent/block c<alignment>``), as the
        startup log line shows it."""
        extra = (
            f" w{self.window}" if self.window
            else f" p{self.pool}" if self.pool
            else f" c{self.in_chunk_alignment}" if self.in_chunk_alignment
            else ""
        )  # fmt: skip
        return f"{self.kind.value}/{self.block_size}{extra}"

    @abstractmethod
    def bundle_blocks(
        self, blocks: Sequence[BlockLike], num_tokens: int, null_block: BlockLike, state_end: int
    ) -> GroupBlocks | None:
        """This group's part of a bundle at ``num_tokens`` from a request's ``blocks``, or None
        when a block it needs is missing; ``state_end``: the end of the step that wrote the state."""


def _paged_bundle_blocks(
    blocks: Sequence[BlockLike], num_tokens: int, block_size: int, first: int, null_block: BlockLike
) -> GroupBlocks | None:
    """Pages ``[first, N // B)`` shared after ``first`` nulls, the tail page preserved; None on a hole."""
    num_full = num_tokens // block_size
    has_tail = num_tokens % block_size != 0
    needed = num_full + has_tail
    if len(blocks) < needed or any(block.is_null for block in blocks[first:needed]):
        return None  # a page is missing where the next token reads (a hole)
    return (null_block,) * first + tuple(blocks[first:num_full]), blocks[num_full] if has_tail else None


@dataclass(frozen=True)
class AttentionGroup(GroupGeometry):
    kind: ClassVar[GroupKind] = GroupKind.ATTENTION

    def bundle_blocks(self, blocks, num_tokens, null_block, state_end) -> GroupBlocks | None:
        return _paged_bundle_blocks(blocks, num_tokens, self.block_size, 0, null_block)


@dataclass(frozen=True)
class WindowGroup(GroupGeometry):
    kind: ClassVar[GroupKind] = GroupKind.WINDOW

    def bundle_blocks(self, blocks, num_tokens, null_block, state_end) -> GroupBlocks | None:
        first = first_window_page(num_tokens, self.block_size, self.window)
        return _paged_bundle_blocks(blocks, num_tokens, self.block_size, first, null_block)


@dataclass(frozen=True)
class RecurrentGroup(GroupGeometry):
    kind: ClassVar[GroupKind] = GroupKind.RECURRENT
    is_recurrent: ClassVar[bool] = True
    captured_in_forward: ClassVar[bool] = True

    def bundle_blocks(self, blocks, num_tokens, null_block, state_end) -> GroupBlocks | None:
        source_index = (state_end - 1) // self.block_size
        if len(blocks) <= source_index or blocks[source_index].is_null:
            return None
        return (null_block,) * ((num_tokens - 1) // self.block_size), blocks[source_index]


@dataclass(frozen=True)
class RingGroup(GroupGeometry):
    kind: ClassVar[GroupKind] = GroupKind.RING
    is_ring: ClassVar[bool] = True

    def bundle_blocks(self, blocks, num_tokens, null_block, state_end) -> GroupBlocks | None:
        if not blocks or blocks[0].is_null:
            return None
        return (), blocks[0]
