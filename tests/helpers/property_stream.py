"""The player of the scheduler property tests (``tests/core/test_property_scheduler.py``).

:class:`Stream` plays one example's operations (``property_ops``) on vLLM's real scheduler with the
plugin (sync, or async with one step in flight) against ``shadow_engine.ShadowWorker``, checks the
invariants after every operation and, in :meth:`Stream.finish`, that nothing leaked;
:class:`PoolConfig` is the pool an example runs on, :class:`Totals` counts what it exercised. The
operations, the output and cached-token checks are ``property_player.OperationPlayer``'s, shared with
the MTP player (``spec_property_checks.SpecStream``); the other checks and the totals are this one's.
"""

from __future__ import annotations

from dataclasses import dataclass

from property_player import OperationPlayer
from shadow_scheduler import Driver, build_scheduler

BLOCK = 16
MAX_PROMPT = 240  # a continuation chain stops growing here, so one request always fits the pool


@dataclass(frozen=True)
class PoolConfig:
    num_blocks: int
    max_num_batched_tokens: int
    max_retained_fraction: float
    reserve_full_prompt: bool  # False: admit on the first chunk, so prefills can preempt
    prompt_capture: str = "in_step"  # or "stop" at P - 1 (BoundaryConfig.prompt_capture)
    max_num_seqs: int = 4

    @property
    def max_prompt(self) -> int:
        """Longest continuation prompt: its pages, states and capture copies must fit the pool."""
        return min(MAX_PROMPT, (self.num_blocks - 8) * BLOCK - BLOCK)


@dataclass
class Totals:
    examples: int = 0
    operations: int = 0
    noops: int = 0
    requests: int = 0
    steps: int = 0
    checkpoint_hits: int = 0
    requests_with_cached_tokens: int = 0
    restored_reads: int = 0
    evictions: int = 0
    preemptions: int = 0
    captures_dropped: int = 0
    aborts: int = 0
    resets: int = 0
    stopped_early: int = 0
    prompt_stops: int = 0
    prompt_captures_in_step: int = 0
    seconds: float = 0.0

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Stream(OperationPlayer):
    """One scheduler + shadow worker playing one example's operations, checking as it goes."""

    def __init__(self, model_dir, lag: int, config: PoolConfig) -> None:
        scheduler, worker = build_scheduler(
            model_dir,
            num_blocks=config.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_retained_fraction=config.max_retained_fraction,
            async_scheduling=bool(lag),
            scheduler_reserve_full_isl=config.reserve_full_prompt,
            prompt_capture=config.prompt_capture,
        )
        driver = Driver(scheduler, worker, lag=lag)
        super().__init__(driver, config.max_retained_fraction, config.max_prompt, Totals(examples=1))
        assert self.scheduler.checkpoint_store.max_blocks == self.budget

    def apply(self, op) -> None:
        if self.handle(op) is False:
            self.totals.noops += 1  # nothing left to abort, or a next turn too long for the pool
        else:
            self.totals.operations += 1
        self.check()

    # -- invariants --
    def check(self) -> None:
        stats = self.scheduler.boundary_stats()
        assert self.scheduler.checkpoint_store.budgeted_blocks <= self.budget, stats
        store = self.scheduler.checkpoint_store
        bundles = store.checkpoints()
        sizes = {block_id: size for c in bundles for block_id, (_, size) in c.held_sized_blocks().items()}
        assert (stats["checkpoints_retained"], stats["bytes_retained"]) == (len(bundles), sum(sizes.values())), stats
        self.check_provenance()
        self.totals.requests_with_cached_tokens += sum(cached > 0 for cached in self.check_requests())

    def check_provenance(self) -> None:
        """Every retained checkpoint is a boundary some request really reached: ``P - 1`` of a
        prompt, or the committed length of a request that finished STOPPED or LENGTH_CAPPED (an
        aborted producer publishes nothing)."""
        from boundary_checkpoints.core.keys import make_key, root_discriminator

        possible = set()
        for t in self.tracked:
            request, root = t.request, root_discriminator(t.salt, None)
            candidates = [("prompt", len(t.prompt) - 1)]
            if request.is_finished() and not t.aborted:
                candidates += [("response", request.num_tokens - 1), ("response", request.num_tokens)]
            for kind, n in candidates:
                if n > 0:
                    possible.add((kind, make_key(request.all_token_ids, n, request.block_hashes, BLOCK, root)))
        for checkpoint in self.scheduler.checkpoint_store.checkpoints():
            assert (checkpoint.kind, checkpoint.key) in possible, (
                f"{checkpoint.kind} checkpoint at {checkpoint.num_tokens} tokens matches no boundary of a request"
            )

    def finish(self) -> None:
        # Like vLLM's engine loop: keep stepping while the scheduler has requests, including
        # finished ones whose ids the next SchedulerOutput still has to carry to the workers.
        self.step_until(lambda: not self.scheduler.has_requests())
        self.driver.drain()
        self.step_until(lambda: not self.scheduler.has_requests())  # the drain may finish some
        assert all(t.request.is_finished() for t in self.tracked)
        self.check()
        for t in self.tracked:
            if not t.aborted and t.request.status.name == "FINISHED_STOPPED":
                self.totals.stopped_early += len(t.expected) < t.request.max_tokens
        stats = self.scheduler.boundary_stats()
        assert stats["captures_pending"] == 0, stats
        assert len(self.scheduler._ledgers) == 0, "a freed request left its ledger behind"
        self.totals.checkpoint_hits = stats["hits"]
        self.totals.evictions = stats["evictions"]
        self.totals.captures_dropped = stats["captures_dropped"]
        self.totals.prompt_stops = stats["prompt_stops"]
        self.totals.prompt_captures_in_step = stats["prompt_captures_in_step"]
        self.totals.restored_reads = self.worker.restored_reads
        self.totals.preemptions = sum(t.request.num_preemptions for t in self.tracked)
        assert not self.scheduler.requests, "finished requests still known to the scheduler"
        self.scheduler.checkpoint_store.clear()
        assert self.pool.get_num_free_blocks() == self.free_before, (
            f"block leak: {self.pool.get_num_free_blocks()} free after clearing, {self.free_before} before"
        )
