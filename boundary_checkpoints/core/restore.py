"""Restore: the longest retained or readable pending bundle a request shares (contract 6 in
``docs/design.md``).

Contract: :class:`RestoreMixin` answers vLLM's ``_get_local_prefix_cache_hit`` with the longest of
vLLM's own block-grid hit, the store's hit and a scheduled pending bundle, gives every KV group the
same ``N``, pins the hit for the ``schedule()`` that looked it up, and counts each request's
lookup once, as a hit or as a miss with a reason. For the graph-fit rule (``core/graph_fit.py``)
it sizes the waiting requests' restores from the store without a lookup (nothing counted or
touched).
"""

from __future__ import annotations

from vllm.logger import init_logger

from boundary_checkpoints.compat import (
    KVCacheBlocks,
    Request,
    RequestStatus,
    block_grid_hit,
    drops_eagle_block,
)
from boundary_checkpoints.core.boundaries import (
    INSTRUCTION,
    PROMPT,
)
from boundary_checkpoints.core.checkpoint import Checkpoint
from boundary_checkpoints.core.chunk_stops import request_is_eligible
from boundary_checkpoints.core.graph_fit import waiting_rows
from boundary_checkpoints.core.keys import parent_of
from boundary_checkpoints.core.kinds import MissReason

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class RestoreMixin:
    """Restore side of the boundary scheduler (module docstring)."""

    # ---- restore --------------------------------------------------------------------------
    def _get_local_prefix_cache_hit(self, request: Request):
        blocks, num_hit, shared_boundary, diverged = super()._get_local_prefix_cache_hit(request)
        if not self.boundaries_active:
            return blocks, num_hit, shared_boundary, diverged
        if self._hits_inside_blocks and num_hit % self.cache_config.block_size:
            blocks, num_hit = self._without_short_rows(request, blocks, num_hit)
        barred = self._barred_from_restore(request)
        if barred is not None:
            self._count_lookup(request, None, barred)
            return blocks, num_hit, shared_boundary, diverged
        parents = self._parents(request)
        pending = self._scheduled_pending_hit(request)
        ledger = self._ledgers[request.request_id]
        counting = not ledger.counted
        # A longer bundle the next-token guard refused (MTP), looked for once per request.
        guarding = counting and self._next_token_guard
        pending_any = self._scheduled_pending_hit(request, guarded=False) if guarding else None
        # A request that waits for room is looked up every step; its miss is classified once (the
        # classification records a regret, core/store_query.py), and only when no pending bundle
        # serves it or was refused in place of a hit longer than vLLM's.
        answer = self.checkpoint_store.query(
            request.all_token_ids,
            request.num_tokens - self._restore_tail,  # contract 13: a prefill row after the restore
            parents,
            self.hash_block_size,
            with_refusal=guarding,
            classify_miss=counting and pending is None and (pending_any is None or pending_any.num_tokens <= num_hit),
            stock_hit=num_hit,
            without_row_rule=request.num_tokens - 1,
        )
        hit = answer.hit
        if pending is not None and (hit is None or pending.num_tokens > hit.num_tokens):
            hit = pending
        # at a finer prefix match unit vLLM also stops at its prompt checkpoint after a restore
        cut_short = hit is not None and self._hits_inside_blocks and self._runs_short_rows_from(request, hit.num_tokens)
        if cut_short:
            hit = None
        short_of_a_pool = (
            hit is not None and hit.num_tokens > num_hit and not self._reaches_a_pool_past(hit.num_tokens, num_hit)
        )
        if short_of_a_pool:
            hit = None
        refused = self._guard_refusal(request, answer.refused, pending_any) if guarding else None
        if hit is None or hit.num_tokens <= num_hit:
            if counting:
                if refused is not None and refused.num_tokens > num_hit:
                    reason = MissReason.DRAFT_NEXT_TOKEN
                elif cut_short:
                    reason = MissReason.SHORT_ROW
                elif short_of_a_pool:
                    reason = MissReason.WITHIN_A_POOL
                elif hit is not None:
                    reason = MissReason.BLOCK_GRID_AS_LONG
                else:
                    reason = answer.miss_reason
                self._count_lookup(request, None, reason, num_hit)
                self._observe_first_lookup(request, parents, num_hit, num_hit, None)
            ledger.restored_from = None
            return blocks, num_hit, shared_boundary, diverged
        if refused is not None and refused.num_tokens > hit.num_tokens:
            self.checkpoint_store.counters.draft_next_token_fallbacks += 1
            logger.debug(
                "boundary_checkpoints: request %s restores %s checkpoint at %d tokens, not the %s checkpoint "
                "at %d tokens: its MTP draft row was computed from next token %s, this prompt has %d there",
                request.request_id,
                hit.kind,
                hit.num_tokens,
                refused.kind,
                refused.num_tokens,
                refused.next_token,
                request.all_token_ids[refused.num_tokens],
            )
        if counting:
            self._observe_first_lookup(request, parents, num_hit, hit.num_tokens, hit)
        self._count_lookup(request, hit, None, num_hit)
        ledger.restored_from = hit
        pins = hit.distinct_blocks()
        self._block_pool.touch(pins)
        self._lookup_pins.extend(pins)
        logger.debug(
            "boundary_checkpoints: request %s restores %s checkpoint at %d tokens (stock hit %d)",
            request.request_id,
            hit.kind,
            hit.num_tokens,
            num_hit,
        )
        if self._ring_groups:
            self._ring_restores[request.request_id] = hit
        blocks = tuple([] if g in self._ring_groups else list(group) for g, group in enumerate(hit.group_blocks))
        return KVCacheBlocks(blocks), hit.num_tokens, 0, False

    def _parents(self, request: Request):
        """``start`` -> the key parent of ``request``'s tail from ``start`` (the store's lookups)."""
        root = self._root(request)
        return lambda start: parent_of(start, request.block_hashes, self.hash_block_size, root)

    def _barred_from_restore(self, request: Request) -> MissReason | None:
        """Why no bundle may serve ``request`` (a prefix not described by token ids alone, or a request
        that bypasses the prefix cache), or None."""
        if not request_is_eligible(request):
            return MissReason.INELIGIBLE
        if not self.kv_cache_manager.prefix_cache_lookup_enabled(request):
            return MissReason.CACHE_BYPASSED
        return None

    def _is_restored(self, request: Request) -> bool:
        """Whether this ``schedule()``'s lookup gave ``request`` a bundle's hit."""
        ledger = self._ledgers.get(request.request_id)
        return ledger is not None and ledger.restored_from is not None

    def _tokens_after_restore(self, request: Request) -> int | None:
        """The tokens a waiting ``request`` would compute from the store's hit, read without a lookup
        (nothing counted or touched); None without one."""
        if request.status != RequestStatus.WAITING or self._barred_from_restore(request) is not None:
            return None
        limit = request.num_tokens - self._restore_tail
        hit = self.checkpoint_store.peek(request.all_token_ids, limit, self._parents(request), self.hash_block_size)
        return None if hit is None else request.num_tokens - hit.num_tokens

    def _waiting_rows_behind(self, request: Request) -> list[int | None]:
        """The tokens of the waiting requests after ``request`` that could still start now (``core/graph_fit.py``)."""
        waiting = iter(self.waiting)
        if not any(queued is request for queued in waiting):
            return [None]  # not in the queue the rule reads: unknown
        limit = max(self.max_num_running_reqs - len(self.running) - 1, 0)
        return waiting_rows(waiting, limit, self._tokens_after_restore)

    def _without_short_rows(self, request: Request, blocks: KVCacheBlocks, num_hit: int) -> tuple[KVCacheBlocks, int]:
        """vLLM's hit ``num_hit`` inside a block, or where vLLM's own split from there would run a
        prefill row as short as a verify row (contract 13), its longest hit at a block boundary
        below from which none would (``compat.block_grid_hit``, looked up one hash block past the
        boundary where lookups drop a hit's last one for the drafter; none: 0). Each retry ends a
        block lower, so it ends; a request's first lookup that lowers counts ``vllm_hits_lowered``."""
        block_size = self.cache_config.block_size
        past = self.hash_block_size if drops_eagle_block(self) else 0
        lowered = False
        while num_hit % block_size and self._runs_short_rows_from(request, num_hit):
            lowered = True
            boundary = num_hit // block_size * block_size
            found, num_hit = (
                block_grid_hit(self.kv_cache_manager, request.block_hashes, boundary + past) if boundary else ((), 0)
            )
            if not num_hit or num_hit > boundary:
                blocks, num_hit = KVCacheBlocks(tuple([] for _ in self.kv_cache_config.kv_cache_groups)), 0
                break
            blocks = KVCacheBlocks(found)
        if lowered and not self._ledgers[request.request_id].counted:
            self.checkpoint_store.counters.vllm_hits_lowered += 1
        return blocks, num_hit

    def _observe_first_lookup(
        self, request: Request, parents, stock_hit: int, served: int, hit: Checkpoint | None
    ) -> None:
        """Tell prompt admission (``core/admission.py``) what a request's first lookup found (a
        prompt checkpoint restored, or a prompt that kept none and would have served it further),
        and the hit balance (``core/hit_balance.py``) what it served against vLLM's own hit."""
        if self.checkpoint_store.borrow:
            beyond, short = self._hit_balance.observe(
                request.block_hashes, self.hash_block_size, stock_hit, served, request.num_tokens - 1,
                horizon=self.checkpoint_store.retained_blocks,
            )  # fmt: skip
            counters = self.checkpoint_store.counters  # a zero added would still bump its version
            if beyond:
                counters.tokens_beyond_stock += beyond
            if short:
                counters.stock_tokens_lost += short
        if self._prompt_captures_on:
            self._prompt_admission.observe_lookup(
                request.all_token_ids,
                request.num_tokens - self._restore_tail,
                parents,
                self.hash_block_size,
                served,
                restored_prompt=hit is not None and hit.kind == PROMPT,
            )

    def _count_lookup(
        self, request: Request, hit: Checkpoint | None, reason: MissReason | None, num_hit: int = 0
    ) -> None:
        """Count a request's first lookup as a hit, or as a miss with ``reason``."""
        ledger = self._ledgers[request.request_id]
        if ledger.counted:
            return
        ledger.counted = True
        self.checkpoint_store.record_lookup(hit, reason)
        if hit is not None and hit.kind == INSTRUCTION:
            self._count_instruction("instruction_hits")
        if hit is None:
            logger.debug(
                "boundary_checkpoints: request %s (%d tokens) restores no checkpoint: %s (block-grid hit %d)",
                request.request_id,
                request.num_tokens,
                reason,
                num_hit,
            )

    def _scheduled_pending_hit(self, request: Request, guarded: bool = True) -> Checkpoint | None:
        """Longest pending bundle a restore may already read (contract 6), or None; ``guarded=False``:
        also one the next-token guard refuses."""
        best: Checkpoint | None = None
        for pending in self._pending:
            num_tokens = pending.key.num_tokens
            if (
                pending.ready_seq is None
                or pending.in_flight is not None
                or self._ledgers.is_tainted(pending.request_id)
            ):
                continue
            if num_tokens > request.num_tokens - self._restore_tail:  # as the store lookup
                continue
            if (best is None or num_tokens > best.num_tokens) and self._key(request, num_tokens) == pending.key:
                if not guarded or pending.checkpoint.serves(request.all_token_ids):
                    best = pending.checkpoint
        return best

    def _guard_refusal(
        self, request: Request, store_refused: Checkpoint | None, pending_any: Checkpoint | None
    ) -> Checkpoint | None:
        """The longer of the store's refusal and the longest readable pending bundle
        (``_scheduled_pending_hit(guarded=False)``) if the next-token guard refuses it (its MTP
        draft row ``N - 1`` was computed from another token ``N``), else None. The lookup restored
        a shorter prefix instead, or none: the caller counts it (``draft_next_token_fallbacks``, or
        the miss reason ``draft_next_token``)."""
        found = (store_refused, pending_any)
        longest = max((c for c in found if c is not None), key=lambda c: c.num_tokens, default=None)
        return longest if longest is not None and not longest.serves(request.all_token_ids) else None
