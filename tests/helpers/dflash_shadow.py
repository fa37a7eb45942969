"""The shadow engine (``spec_shadow.py``) under DFlash speculative decoding, with draft KV groups.

:class:`DFlashShadowWorker` keeps the speculative state columns of :class:`SpecShadowWorker` and
replaces the MTP draft rows with what vLLM 0.32's DFlash drafter writes (docs/notes/spec-decode.md
§11.2), in every group of kind ``"draft"`` (full attention), ``"window"`` (sliding window of
``windows[group]`` tokens) or ``"attention+draft"`` (target and draft layers in one group):

* after each step, the *context* row of every valid input row (below the committed count), a
  function of the target's state at that row alone (:func:`context_row`); rejected rows are not
  written (V2 pads them);
* the ``1 + k`` query rows (bonus and mask tokens) at the committed count and after, as junk
  (:data:`QUERY`), in every allocated, non-null page (DFlash never writes the null block);
* before each step, every context row the step's drafter reads is checked: rows below the step's
  start in full groups, rows ``[start - W + 1, start)`` in window groups (the window of the next
  token; rows below are never read). A missing page (a null block of the request's table inside
  the window) reads as nothing and fails like a wrong row.

``protected()`` (set by the test: the block ids of the published bundles) is checked on every
write of a target, context or query row: writing into a page a published bundle holds raises
:class:`ShadowMismatch` (contract: shared pages are never rewritten).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shadow_engine import MOD, ZERO, ShadowMismatch
from shadow_scheduler import build_scheduler
from spec_shadow import JUNK, SpecDriver, SpecShadowWorker

QUERY = -3  # content of a draft row written by a query token (bonus or mask)
TARGET_KINDS = ("attention", "attention+draft")
DRAFT_KINDS = ("draft", "window", "attention+draft")


def context_row(state: int) -> int:
    """A DFlash context K/V row: a function of the target's state at that row only."""
    return (state * 17 + 3) % MOD


@dataclass
class DFlashShadowWorker(SpecShadowWorker):
    """The speculative shadow worker with DFlash draft groups (see the module docstring)."""

    windows: dict[int, int] = field(default_factory=dict)  # group -> sliding window
    context: dict[int, list[int]] = field(default_factory=dict)  # block id -> draft rows
    protected: Callable[[], set[int]] = set
    draft_reads: int = 0  # context rows checked

    def execute(self, so):
        for block_id in so.new_block_ids_to_zero or ():
            self.context.pop(block_id, None)
        return super().execute(so)

    def _as_the_worker_knows_it(self, so):
        # Async: a request with no proposal of the worker's yet (new or restored, one prompt token
        # left, padded by vLLM to a 1 + k row next to decodes) runs its -1 placeholders, which are
        # all rejected here (the runner verifies whatever its draft buffer holds for that slot).
        for req_id, placeholders in (so.scheduled_spec_decode_tokens or {}).items():
            self.drafts.setdefault(req_id, list(placeholders))
        return super()._as_the_worker_knows_it(so)

    def _copy(self, src: int, dst: int) -> None:
        super()._copy(src, dst)
        if src in self.context:
            self.context[dst] = list(self.context[src])
        else:
            self.context.pop(dst, None)

    def _check_attention(self, req_id, req, start) -> None:
        for group, (kind, size) in enumerate(zip(self.group_kinds, self.block_sizes)):
            blocks = req.block_ids[group]
            if kind in TARGET_KINDS:
                for row in range(start):
                    page = self.rows.get(blocks[row // size], [])
                    if row % size >= len(page) or page[row % size] != req.prefix_state(row + 1):
                        raise ShadowMismatch(f"{req_id}: attention group {group} row {row} is wrong")
            if kind in DRAFT_KINDS:
                first = max(0, start - self.windows[group] + 1) if kind == "window" else 0
                for row in range(first, start):
                    page = self.context.get(blocks[row // size], [])
                    self.draft_reads += 1
                    if row % size >= len(page) or page[row % size] != context_row(req.prefix_state(row + 1)):
                        raise ShadowMismatch(f"{req_id}: draft context row {row} of group {group} is wrong")

    def _write_attention(self, req, start, end, states) -> None:
        committed = req.num_computed
        protected = self.protected()
        for group, kind in enumerate(self.group_kinds):
            if kind in TARGET_KINDS:
                for row in range(start, end):
                    page = self._page(req, group, row, self.rows, protected)
                    page[row % self.block_sizes[group]] = states[row - start] if row < committed else JUNK
            if kind in DRAFT_KINDS:
                for row in range(start, min(end, committed)):
                    page = self._page(req, group, row, self.context, protected)
                    page[row % self.block_sizes[group]] = context_row(states[row - start])
                for row in range(committed, committed + self.num_spec + 1):
                    page = self._page(req, group, row, self.context, protected)
                    if page is not None:
                        page[row % self.block_sizes[group]] = QUERY

    def _page(self, req, group: int, row: int, table: dict, protected: set[int]) -> list[int] | None:
        """The page of ``table`` that row ``row`` of ``group`` is written to (None: the null block,
        which DFlash never writes); refuses a page past the request's table or a published one."""
        size, blocks = self.block_sizes[group], req.block_ids[group]
        index = row // size
        if index >= len(blocks):
            raise ShadowMismatch(f"row {row} of group {group} lies past the request's {len(blocks)} pages")
        if blocks[index] == 0:
            return None
        if blocks[index] in protected:
            raise ShadowMismatch(f"row {row} of group {group} is written into a published bundle's page")
        return table.setdefault(blocks[index], [ZERO] * size)


# The hand-built layout of the DFlash scheduler tests: the target's attention group, a full draft
# group on pages twice as long, a sliding-window draft group, two recurrent groups.
BLOCK = 16
DRAFT_BLOCK = 32
WINDOW = 24
LAYOUT = (("attention", BLOCK), ("draft", DRAFT_BLOCK), ("window", BLOCK), ("recurrent", BLOCK),
          ("recurrent", BLOCK))  # fmt: skip


def dflash_groups(k: int, layout=LAYOUT, window: int = WINDOW) -> list:
    """vLLM ``KVCacheGroupSpec``s of ``layout`` (recurrent groups keep ``k`` speculative blocks)."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

    dtype, groups = torch.float32, []
    for i, (kind, size) in enumerate(layout):
        if kind == "recurrent":
            spec = MambaSpec(
                block_size=size, shapes=((1, 1),), dtypes=(dtype,), mamba_cache_mode="align",
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN, num_speculative_blocks=k,
            )  # fmt: skip
        elif kind == "window":
            spec = SlidingWindowSpec(block_size=size, num_kv_heads=1, head_size=1, dtype=dtype, sliding_window=window)
        else:
            spec = FullAttentionSpec(block_size=size, num_kv_heads=1, head_size=1, dtype=dtype)
        groups.append(KVCacheGroupSpec([f"{kind}.{i}"], spec))
    return groups


def write_drafter_config(path: Path, target_dir: Path) -> Path:
    """A config-only DFlash drafter (``fixtures/dflash.py``) for the config-only target in
    ``target_dir``: the scheduler reads the method and the draft count; the hand-built groups stand
    for its layers."""
    import json

    from bc_tools.fixtures.dflash import dflash_drafter_config

    path.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dflash_drafter_config(target, layer_types=("full_attention",))))
    return path


def dflash_engine(model_dir: Path, drafter: Path, k: int, accept, *, async_scheduling=False, layout=LAYOUT,
                  window: int = WINDOW, **kwargs):  # fmt: skip
    """vLLM's scheduler with the plugin, a DFlash config of ``k`` drafts, the hand-built ``layout``,
    and a :class:`DFlashShadowWorker` that protects the published bundles' pages."""
    scheduler, _ = build_scheduler(
        model_dir, num_speculative_tokens=k, drafter=drafter, async_scheduling=async_scheduling,
        kv_cache_groups=dflash_groups(k, layout, window), **kwargs,
    )  # fmt: skip
    kinds, sizes = [kind for kind, _ in layout], [size for _, size in layout]
    windows = {g: window for g, kind in enumerate(kinds) if kind == "window"}
    worker = DFlashShadowWorker(kinds, sizes, num_spec=k, accept=accept, async_scheduling=async_scheduling,
                                windows=windows)  # fmt: skip
    if getattr(scheduler, "boundaries_active", False):
        store = scheduler.checkpoint_store
        worker.protected = lambda: {b.block_id for c in store.checkpoints() for b in c.distinct_blocks()}
    return scheduler, worker, SpecDriver(scheduler, worker, lag=1 if async_scheduling else 0)
