"""The player of the scheduler property tests (``tests/core/test_property_scheduler.py``).

:class:`Stream` plays one example's operations (``property_ops``) on vLLM's real scheduler with the
plugin (sync, or async with one step in flight) against ``shadow_engine.ShadowWorker``, checks the
invariants after every operation and, in :meth:`Stream.finish`, that nothing leaked;
:class:`PoolConfig` is the pool an example runs on, :class:`Totals` counts what it exercised. Not
shared with ``spec_property_checks.py`` (MTP): its player looks alike but plays and counts otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from prompts import common_prefix
from property_ops import (
    Abort,
    Branch,
    Continue,
    Fresh,
    Resend,
    Reset,
    Steps,
    pick_tracked,
    random_tokens,
    reference_output,
)
from shadow_scheduler import Driver, build_scheduler, make_request

BLOCK = 16
MAX_PROMPT = 240  # a continuation chain stops growing here, so one request always fits the pool
STEP_LIMIT = 3000  # steps to wait for requests to finish before calling the scheduler stuck


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
class Tracked:
    request: object
    prompt: list[int]
    salt: str | None
    expected: list[int]  # cold greedy output
    earlier_same_salt: list[object]  # requests of the same salt added before this one
    aborted: bool = False
    checked_cached: bool = False


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


class Stream:
    """One scheduler + shadow worker playing one example's operations, checking as it goes."""

    def __init__(self, model_dir, lag: int, config: PoolConfig) -> None:
        self.scheduler, self.worker = build_scheduler(
            model_dir,
            num_blocks=config.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_retained_fraction=config.max_retained_fraction,
            async_scheduling=bool(lag),
            scheduler_reserve_full_isl=config.reserve_full_prompt,
            prompt_capture=config.prompt_capture,
        )
        self.driver = Driver(self.scheduler, self.worker, lag=lag)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.budget = int(self.pool.num_gpu_blocks * config.max_retained_fraction)
        assert self.scheduler.checkpoint_store.max_blocks == self.budget
        self.free_before = self.pool.get_num_free_blocks()
        self.max_prompt = config.max_prompt
        self.tracked: list[Tracked] = []
        self.totals = Totals(examples=1)

    # -- operations --
    def apply(self, op) -> None:
        handler = getattr(self, f"_op_{type(op).__name__.lower()}")
        if handler(op) is False:
            self.totals.noops += 1  # nothing left to abort, or a next turn too long for the pool
        else:
            self.totals.operations += 1
        self.check()

    def _add(self, prompt, salt, max_tokens, stop_at=None) -> None:
        stop_ids: tuple[int, ...] = ()
        if stop_at is not None:
            plain = reference_output(prompt, max_tokens)
            stop_ids = (plain[min(stop_at, len(plain) - 1)],)
        request = make_request(prompt, max_tokens=max_tokens, salt=salt, stop_token_ids=list(stop_ids) or None)
        earlier = [t.request for t in self.tracked if t.salt == salt]
        expected = reference_output(prompt, max_tokens, stop_ids)
        self.tracked.append(Tracked(request, list(prompt), salt, expected, earlier))
        self.scheduler.add_request(request)
        self.totals.requests += 1

    def _op_fresh(self, op: Fresh) -> None:
        self._add(random_tokens(op.seed, op.length), op.salt, op.max_tokens, op.stop_at)

    def _op_resend(self, op: Resend):
        original = pick_tracked(self.tracked, op.which)
        if original is None:
            return False
        salt = original.salt if op.other_salt is False else op.other_salt
        self._add(original.prompt, salt, op.max_tokens)

    def _op_branch(self, op: Branch):
        original = pick_tracked(self.tracked, op.which)
        if original is None:
            return False
        prompt = original.prompt[: op.keep] + random_tokens(op.seed, op.extra)
        self._add(prompt, original.salt, op.max_tokens)

    def _op_continue(self, op: Continue):
        previous = pick_tracked(self.tracked, op.which)
        if previous is None:
            return False
        self._step_until(previous.request.is_finished)  # the client waits for the last turn
        prompt = list(previous.request.all_token_ids) + random_tokens(op.seed, op.extra)
        if len(prompt) > self.max_prompt:
            return False
        self._add(prompt, previous.salt, op.max_tokens, op.stop_at)

    def _op_abort(self, op: Abort):
        from vllm.v1.request import RequestStatus

        live = [t for t in self.tracked if not t.request.is_finished()]
        if not live:
            return False
        victim = live[op.which % len(live)]
        victim.aborted = True
        self.scheduler.finish_requests([victim.request.request_id], RequestStatus.FINISHED_ABORTED)
        self.totals.aborts += 1

    def _op_steps(self, op: Steps) -> None:
        for _ in range(op.k):
            self.driver.step()
            self.totals.steps += 1

    def _op_reset(self, op: Reset) -> None:
        assert self.scheduler.reset_prefix_cache(reset_running_requests=True), "vLLM's reset failed"
        assert len(self.scheduler.checkpoint_store) == 0 and not self.scheduler._pending
        self.totals.resets += 1

    def _step_until(self, done) -> None:
        for _ in range(STEP_LIMIT):
            if done():
                return
            self.driver.step()
            self.totals.steps += 1
        live = [(t.request.request_id, t.request.status) for t in self.tracked if not t.request.is_finished()]
        raise AssertionError(f"requests did not finish: {live}")

    # -- invariants --
    def check(self) -> None:
        stats = self.scheduler.boundary_stats()
        assert self.scheduler.checkpoint_store.budgeted_blocks <= self.budget, stats
        store = self.scheduler.checkpoint_store
        bundles = store.checkpoints()
        sizes = {block_id: size for c in bundles for block_id, (_, size) in c.held_sized_blocks().items()}
        assert (stats["checkpoints_retained"], stats["bytes_retained"]) == (len(bundles), sum(sizes.values())), stats
        self.check_provenance()
        for t in self.tracked:
            rid = t.request.request_id
            out = list(t.request.output_token_ids)
            if t.request.is_finished() and not t.aborted:
                assert out == t.expected, f"{rid}: output {out} != cold output {t.expected}"
            else:
                assert out == t.expected[: len(out)], f"{rid}: output {out} diverges from cold output {t.expected}"
            if rid in self.driver.cached_tokens and not t.checked_cached:
                t.checked_cached = True
                cached = self.driver.cached_tokens[rid]
                bound = max([common_prefix(t.prompt, r.all_token_ids) for r in t.earlier_same_salt], default=0)
                bound = min(bound, len(t.prompt) - 1)
                assert 0 <= cached <= bound, (
                    f"{rid} (salt {t.salt!r}, prompt {len(t.prompt)}) reports {cached} cached tokens; "
                    f"longest same-salt common prefix allows {bound}"
                )
                self.totals.requests_with_cached_tokens += cached > 0

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
        self._step_until(lambda: not self.scheduler.has_requests())
        self.driver.drain()
        self._step_until(lambda: not self.scheduler.has_requests())  # the drain may finish some
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
