"""How retained checkpoints give blocks back when vLLM needs them (the scheduler's side of KV
pressure and of retention ``borrow``).

Contract: :class:`YieldingMixin`, a base of the boundary scheduler, answers two calls of the
plugin's KV cache manager and block pool. ``_relieve_pressure(shortfall)``, before vLLM would
preempt for want of ``shortfall`` blocks: a pool-grid snapshot goes first, then a prompt capture
whose copies have not run, else one bundle whose release frees blocks, unless releasing all of
them would still leave the shortfall. ``_yield_to_cache(n)``, before vLLM hands out ``n`` blocks
that would include blocks of its prefix cache: prompt captures whose copies have not run, then
bundles, in the order its docstring gives. ``_capture_would_thrash(n)`` tells capture whether a
new bundle's ``n`` blocks would cost vLLM's cache what the bundles now yield to, and
``_cached_ahead(n)`` which cached blocks the pool hands out next. It reads the scheduler's
``checkpoint_store``, ``_hit_balance``, ``_block_pool`` and ``_pending`` and the pool-grid and
capture mixins' ``_release_snapshot``, ``_snapshot_blocks`` and ``_drop_before_copies``.
"""

from __future__ import annotations

from itertools import islice

from boundary_checkpoints.compat import free_queue_order, get_block_hash
from boundary_checkpoints.core.boundaries import PROMPT
from boundary_checkpoints.core.capture import PendingCapture


def frees_uncached(block) -> bool:
    """A retained block whose release gives the pool a block no cache entry names (the store's
    reference is the last one)."""
    return block.ref_cnt == 1 and block.block_hash is None


class YieldingMixin:
    """Bundles and snapshots that yield to vLLM's allocations (module docstring)."""

    def _relieve_pressure(self, shortfall: int) -> bool:
        """Release a pool-grid snapshot, else give up a prompt capture whose copies have not run,
        else evict one retained bundle that gives blocks back to the pool, unless evicting every
        such bundle would still leave ``shortfall`` unmet; False when nothing was released."""
        if self._release_snapshot() or self._yield_prompt_capture():
            return True
        store = self.checkpoint_store

        def is_free(block) -> bool:  # the store's reference is the last one
            return block.ref_cnt == 1

        if store.freeable_blocks(is_free) < shortfall:
            return False
        return store.evict_to_free(is_free)

    def _yield_to_cache(self, num_blocks: int) -> None:
        """Before vLLM hands out ``num_blocks`` new blocks, while they would include blocks of its
        prefix cache: evict the least recently used bundle whose release gives back a block no
        cache entry names (freed to the free queue's head, so handed out first). Every bundle
        gives way to those cached blocks while ``_yields_to_every_cached``: before any reuse is
        seen, while the newest of them is within the bundles' reuse horizon, or while bundles cost
        more cached tokens than they serve. Otherwise only a bundle last used no later than the
        newest of those cached blocks was freed goes: older cached blocks and bundles leave in
        one least-recently-used order (a bundle is last used no earlier than the pages it borrows
        were freed, so it never outlives them). Among those
        cached blocks one that several recent requests read (``HitBalance.shared_prefix``: a
        shared prefix) outranks every bundle, whatever its age. Where every bundle gives way, a
        prompt capture whose copies have not run goes first (``_yield_prompt_capture``): it holds
        its private blocks from the step that computes the prompt's end until the next step's
        copies, while that step's allocations run. Past the horizon it stays, as a bundle used
        now would: on a warm server the free queue is mostly old cached blocks, and a resend
        still finds its prompt's checkpoint."""
        while self._snapshot_blocks and self._cached_ahead(num_blocks):  # snapshots go first
            self._release_snapshot()
        store = self.checkpoint_store
        if not len(store) and self._yieldable_prompt_capture() is None:
            return
        while True:
            cached = self._cached_ahead(num_blocks)
            if not cached:
                return
            newest = max(self._block_pool.freed_at(block) for block in cached)
            yields_to_all = self._yields_to_every_cached(newest) or any(
                self._hit_balance.shared_prefix(get_block_hash(block.block_hash)) for block in cached
            )
            if yields_to_all and self._yield_prompt_capture():
                continue
            used_by = None if yields_to_all else newest
            if not len(store) or not store.evict_to_free(frees_uncached, cause="cached", used_by=used_by):
                return

    def _yield_prompt_capture(self) -> bool:
        """Give up :meth:`_yieldable_prompt_capture`: its blocks go back, its turn keeps its
        lineage, its key is remembered as refused (``captures_yielded``). False when there is none."""
        pending = self._yieldable_prompt_capture()
        if pending is None:
            return False
        self._drop_before_copies(pending, keep_lineage=True)
        self.checkpoint_store.counters.captures_yielded += 1
        self.checkpoint_store.remember_refused(pending.key)
        return True

    def _yieldable_prompt_capture(self) -> PendingCapture | None:
        """The newest planned prompt capture whose copies have not run and that took private
        blocks (not one taken inside its step, nor one adopting its request's blocks), or None."""
        for pending in reversed(self._pending):
            if pending.kind != PROMPT or pending.ready_seq is not None or pending.in_step:
                continue
            if any(d is not s for s, d in zip(pending.plan.sources, pending.destinations, strict=True)):
                return pending  # adopted ones hold no private block to give back
        return None

    def _yields_to_every_cached(self, freed_at: int) -> bool:
        """Under retention ``borrow``: whether bundles give way to any cached block rather than
        only to those freed after their last use, given the newest block about to go was freed
        at ``freed_at``: before any reuse is seen, while that block is within the bundles' reuse
        horizon (``within_reuse_horizon``: as likely to be read again as a protected bundle, and
        it serves stock's hit), and while bundles cost more cached tokens than they served
        (``core/hit_balance.py``)."""
        return self._hit_balance.losing() or self.checkpoint_store.within_reuse_horizon(freed_at)

    def _cached_ahead(self, num_blocks: int) -> list:
        """The blocks of vLLM's prefix cache among the next ``num_blocks`` the pool hands out."""
        return [
            block for block in islice(free_queue_order(self._block_pool), num_blocks) if block.block_hash is not None
        ]

    def _capture_would_thrash(self, num_blocks: int) -> bool:
        """Under retention ``borrow``: whether ``num_blocks`` new blocks would evict blocks of
        vLLM's prefix cache (more than yielding every bundle gives back) while bundles yield to
        every cached block (:meth:`_yields_to_every_cached`: before any reuse was seen, while
        those blocks are within the bundles' reuse horizon, or while bundles cost more cached
        tokens than they served). Such a bundle is a bet on a reuse not yet seen, or would cost
        stock cached blocks as likely to be read again as itself, or loses on balance. The store
        remembers a refused key, so reuse is learned all the same."""
        store = self.checkpoint_store
        if not store.borrow:
            return False
        cached = self._cached_ahead(num_blocks)
        if len(cached) <= store.freeable_blocks(frees_uncached):
            return False
        return self._yields_to_every_cached(max(self._block_pool.freed_at(block) for block in cached))
