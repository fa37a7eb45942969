"""vLLM scheduler subclasses that capture, publish and restore exact boundary checkpoints.

One engine step at a time, data flows scheduler -> worker -> scheduler: the scheduler decides
where prefill chunks stop and which bundles to capture or restore, the copies ride the step's
``SchedulerOutput`` to every worker, and a captured bundle is published when that step's output
returns. The numbered contracts the code cites ("contract N") are in ``docs/design.md``,
"Scheduler contracts".
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger

from boundary_checkpoints.compat import (
    AsyncScheduler,
    KVCacheBlockCopy,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    caches_hash,
    keeps_prompt_states_between_blocks,
    mixed_batch_graph_ceiling,
    platform_is_cpu,
    reclass_instance,
    request_blocks,
    runs_restores_past_their_block,
    single_type_managers,
)
from boundary_checkpoints.core.admission import PromptAdmission
from boundary_checkpoints.core.boundaries import RESPONSE, restore_tail
from boundary_checkpoints.core.capture import CaptureMixin, PendingCapture
from boundary_checkpoints.core.chat_markers import chat_markers_for
from boundary_checkpoints.core.checkpoint import Checkpoint
from boundary_checkpoints.core.chunk_stops import ChunkStopMixin, request_is_eligible
from boundary_checkpoints.core.drafters import reads_next_token
from boundary_checkpoints.core.graph_fit import graph_fit_for
from boundary_checkpoints.core.graph_fit import startup_phrase as graph_fit_phrase
from boundary_checkpoints.core.hit_balance import HitBalance
from boundary_checkpoints.core.keys import CheckpointKey, make_key, root_discriminator
from boundary_checkpoints.core.kv_manager import PressureRelievingKVCacheManager, YieldingBlockPool, stop_counting
from boundary_checkpoints.core.layout import describe_layout
from boundary_checkpoints.core.ledger import Ledgers
from boundary_checkpoints.core.pool_snapshots import PoolGridMixin
from boundary_checkpoints.core.prefix_in_flight import PrefixInFlight, prefix_in_flight_for
from boundary_checkpoints.core.restore import RestoreMixin
from boundary_checkpoints.core.shared_hits import SharedHits, decide_together
from boundary_checkpoints.core.step_copies import CAPTURE_COPIES_ATTR, COPY_TIMES_ATTR, copy_times_reach_metrics
from boundary_checkpoints.core.step_report import StepCounterReporter
from boundary_checkpoints.core.store import CheckpointStore
from boundary_checkpoints.core.yielding import YieldingMixin
from boundary_checkpoints.gate import decide_layout, match_unit_reasons
from boundary_checkpoints.prompt_capture import END, IN_STEP, OFF, STOP, PromptCaptureDecision, decide_for, on_pool_grid
from boundary_checkpoints.settings import BoundaryConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

_FINISHED_WITH_CHECKPOINT = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class BoundaryCheckpointMixin(RestoreMixin, ChunkStopMixin, CaptureMixin, PoolGridMixin, YieldingMixin):
    """Boundary capture/restore on top of vLLM's Scheduler: ``__init__``, the step hooks, the
    request lifecycle and the stats; restore, chunk stops, capture, pool-grid snapshots and
    yielding under pressure are its bases."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.boundary_config = BoundaryConfig.for_engine(self.vllm_config)
        managers = single_type_managers(self.kv_cache_manager)
        kpool = getattr(self.vllm_config.model_config.hf_text_config, "index_kpool", None)
        geometries, reasons = describe_layout(
            self.kv_cache_config, managers, on_cpu=platform_is_cpu(), kpool=kpool, num_spec_tokens=self.num_spec_tokens
        )
        self._kpool = next((g.pool for g in geometries if g.is_ring), None)  # the indexer's pool, not the ring's slots
        vllm_keeps_prompts = self._vllm_keeps_prompts_on_grid()
        reasons = [*reasons, *match_unit_reasons(self.vllm_config, vllm_keeps_prompts_on_grid=vllm_keeps_prompts)]
        self.boundaries_active = decide_layout(
            self.boundary_config, reasons, block_aligned=self.need_mamba_block_aligned_split,
            worker_cls=self.vllm_config.parallel_config.worker_cls, logger=logger,
        )  # fmt: skip
        self._prompt_captures_on = self.boundaries_active and self.boundary_config.prompt_checkpoints
        if not self.boundaries_active:
            return
        self._geometries = geometries
        self._ring_groups = [g for g, geometry in enumerate(geometries) if geometry.is_ring]
        self._prompt_capture = decide_for(self.boundary_config, self.vllm_config)
        if self._ring_groups and IN_STEP in (self._prompt_capture.mode, self._prompt_capture.resend):
            ring = "an indexer tail ring is captured after its step"
            self._prompt_capture = PromptCaptureDecision(
                STOP if self._prompt_capture.mode == IN_STEP else self._prompt_capture.mode, ring,
                resend=STOP if self._prompt_capture.resend else "",
            )  # fmt: skip
        # Under speculative decoding every checkpoint of a pooled indexer sits on its pool grid (contract 13).
        self._grid_only = bool(self._kpool and self.num_spec_tokens)
        # vLLM's own hits land inside blocks at a finer prefix match unit (its partial hits), and its rows
        # from there may be short: the restore cuts those (RestoreMixin._without_short_rows)
        self._hits_inside_blocks = self._grid_only and keeps_prompt_states_between_blocks(self)
        if self._grid_only:
            vllm_unit = self.hash_block_size if vllm_keeps_prompts else 0
            self._prompt_capture = on_pool_grid(self._prompt_capture, vllm_unit)
            self._prompt_captures_on = self._prompt_captures_on and self._prompt_capture.mode != OFF
        self._prompt_at_end = self._prompt_captures_on and self._prompt_capture.mode == END
        p_minus_1_mode = self._prompt_capture.resend if self._prompt_at_end else self._prompt_capture.mode
        self._prompt_in_step = self._prompt_captures_on and p_minus_1_mode == IN_STEP
        # The fewest tokens a restore leaves to compute: under contract 13 a prefill row.
        self._restore_tail = restore_tail(self.num_spec_tokens) if self._grid_only else 1
        self._ring_restores: dict[str, Checkpoint] = {}  # this schedule()'s checkpoint hits (item 11)
        block_pool = self.kv_cache_manager.block_pool
        self._block_pool = block_pool
        max_blocks = int(block_pool.num_gpu_blocks * self.boundary_config.max_retained_fraction)
        self._page_bytes = tuple(g.page_bytes for g in geometries)
        borrow = self.boundary_config.retention == "borrow"
        if borrow:  # before the store binds the pool's free_blocks
            reclass_instance(block_pool, YieldingBlockPool)
        self.checkpoint_store = CheckpointStore(release=block_pool.free_blocks, max_blocks=max_blocks, borrow=borrow)
        self._pending: list[PendingCapture] = []
        self._prompt_admission = PromptAdmission(admit_all=self.boundary_config.prompt_admission == "all")
        self._hit_balance = HitBalance(
            capacity=block_pool.num_gpu_blocks,
            page_groups=[g for g, geo in enumerate(geometries) if not (geo.is_recurrent or geo.is_ring)],
            state_groups=[g for g, geo in enumerate(geometries) if geo.is_recurrent],
            is_cached=lambda block_hash, group: caches_hash(block_pool, block_hash, group),
        )
        # A checkpoint is usable only by a prompt of N + 1 tokens or more, and vLLM takes prompts
        # of at most max_model_len - 1 tokens.
        self._max_useful_tokens = self.vllm_config.model_config.max_model_len - 2
        self._lookup_pins: list[Any] = []
        self._ledgers = Ledgers()  # per request: dropped in _free_request
        self._instruction_counts: dict[str, int] = {}
        self._chat_markers = chat_markers_for(self.boundary_config, self.vllm_config)  # contract 10
        self._sched_seq = 0
        self._copy_timers: list[Any] = []  # the worker's capture-copy timers not yet reported
        self._step_counter_reporter = StepCounterReporter()
        self._processed_seq = 0
        self._next_token_guard = reads_next_token(self.vllm_config.speculative_config)
        self._state_block_size = next(g.block_size for g in geometries if g.is_recurrent)
        self._pool_snapshots = self._make_pool_snapshots()
        self._last_stats_log = time.monotonic()
        reclass_instance(self.kv_cache_manager, PressureRelievingKVCacheManager)
        self._coordinator = self.kv_cache_manager.coordinator
        self._coordinator.cut_prefill_ends = self._cut_prefill_ends = {}  # this schedule()'s cut chunks
        # this schedule()'s restored requests whose first chunk runs past their restore point's block
        self._coordinator.uncached_state_slots = self._restores_past_block = {}
        self._runs_restores_past_block = runs_restores_past_their_block(self) and not self._kpool
        self.kv_cache_manager.relieve_pressure = self._relieve_pressure
        self.kv_cache_manager.prefix_in_flight = prefix_in_flight_for(self, self.checkpoint_store.counters)
        shared_hits = SharedHits(self.kv_cache_manager, self._count_shared_hit_release)
        together, together_phrase = decide_together(self.boundary_config.shared_hits_together, platform_is_cpu())
        self.kv_cache_manager.shared_hits = shared_hits if together and shared_hits.active else None
        self._graph_fit = graph_fit_for(
            self.boundary_config.graph_fit_tokens, mixed_batch_graph_ceiling(self.vllm_config), self.num_spec_tokens,
            is_restored=self._is_restored,
            rows_behind=self._waiting_rows_behind, counters=self.checkpoint_store.counters,
        )  # fmt: skip
        self.kv_cache_manager.graph_fit = self._graph_fit
        if borrow:
            block_pool.yield_to_cache = self._yield_to_cache
            block_pool.clock = self.checkpoint_store.now
            block_pool.freed_stamps = {}
            block_pool.on_evicted = self._hit_balance.evicted
        logger.info(
            "boundary_checkpoints: request_boundaries active: %d KV groups (%s), hash block %d, "
            "retaining at most %d of %d blocks (%s), prompt checkpoints %s, chat instruction boundaries %s, "
            "capture-copy times %s%s",
            len(geometries),
            ", ".join(g.label for g in geometries),
            self.hash_block_size,
            max_blocks,
            block_pool.num_gpu_blocks,
            "private blocks only, the cache's pages borrowed; yielding to cached blocks freed within twice their "
            "median reuse distance, to older ones by age, to every one before reuse is seen or while they cost "
            "the cache more tokens than they add; prompt captures not yet copied first"
            if self.checkpoint_store.borrow
            else "every block held until evicted",
            self._prompt_capture.startup_phrase(
                self.boundary_config.prompt_checkpoint_min_tokens, self._next_token_guard
            )
            + f"; kept for {self._prompt_admission.describe()}"
            if self._prompt_captures_on
            else self._prompt_capture.describe(),
            self._chat_markers.describe(),
            copy_times_reach_metrics(self.vllm_config),
            self._pool_grid_line()
            + (PrefixInFlight.STARTUP_PHRASE if self.kv_cache_manager.prefix_in_flight else "")
            + (together_phrase if shared_hits.active else "")
            + graph_fit_phrase(self._graph_fit, self.boundary_config.graph_fit_tokens),
        )

    def _count_shared_hit_release(self) -> None:
        counters = self.checkpoint_store.counters
        counters.shared_hits_released += 1

    # ---- keys -----------------------------------------------------------------------------
    def _root(self, request: Request):
        lora = request.lora_request.lora_int_id if request.lora_request is not None else None
        return root_discriminator(request.cache_salt, lora)

    def _key(self, request: Request, num_tokens: int) -> CheckpointKey | None:
        return make_key(
            request.all_token_ids, num_tokens, request.block_hashes, self.hash_block_size, self._root(request)
        )

    def _request_blocks(self, request_id: str):
        return request_blocks(self.kv_cache_manager, request_id)

    # ---- step boundaries ------------------------------------------------------------------
    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        if self.boundaries_active:
            self._cut_prefill_ends.clear()  # each schedule() splits its chunks anew
            self._restores_past_block.clear()
        output = super().schedule(*args, **kwargs)
        if not self.boundaries_active:
            return output
        if self._cut_prefill_ends or self._restores_past_block:
            stop_counting(self._coordinator)
        if output.total_num_scheduled_tokens > 0:
            self._sched_seq += 1
        if self.num_spec_tokens:
            self._record_last_steps(output)
        copies = self._emit_pending_copies(output)
        if copies:
            setattr(output, CAPTURE_COPIES_ATTR, copies)
        self._plan_chunk_captures(output)
        all_copies = copies + self._emit_in_step_captures(output)
        if all_copies:
            self._record_capture_cost(all_copies)
        if self._pool_snapshots is not None:
            self._attach_snapshot_copies(output)
        if self._ring_restores:
            self._copy_restored_rings(output)
        if self._lookup_pins:
            self._block_pool.free_blocks(self._lookup_pins)
            self._lookup_pins = []
        return output

    def _copy_restored_rings(self, output: SchedulerOutput) -> None:
        """Append the ring copy of every request this step admits from a checkpoint (item 11)."""
        copies = list(output.kv_cache_block_copies or ())
        for request_id, hit in self._ring_restores.items():
            request = self.requests.get(request_id)
            num_scheduled = output.num_scheduled_tokens.get(request_id)
            if request is None or num_scheduled is None:
                continue  # not admitted this step
            if request.num_computed_tokens - num_scheduled != hit.num_tokens:
                continue  # admitted from another hit
            for g in self._ring_groups:
                [source] = hit.group_blocks[g]
                [destination] = request_blocks(self.kv_cache_manager, request_id)[g]
                copies.append(KVCacheBlockCopy(source.block_id, destination.block_id))
        self._ring_restores = {}
        output.kv_cache_block_copies = copies or None

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output):
        if self.boundaries_active and scheduler_output.total_num_scheduled_tokens > 0:
            self._processed_seq += 1
            if self.num_spec_tokens:
                self._settle_speculative_step(scheduler_output, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.boundaries_active:
            if self.log_stats:  # drained by make_stats, which reports nothing without
                self._copy_timers.extend(getattr(scheduler_output, COPY_TIMES_ATTR, ()))
            self._publish_ready()
            self._maybe_log_stats()
        return outputs

    # ---- request lifecycle ----------------------------------------------------------------
    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        request_id = request.request_id
        if self.boundaries_active:
            if request.status in _FINISHED_WITH_CHECKPOINT and request_is_eligible(request):
                num_tokens, state_end, in_flight = self._response_boundary(request)
                if num_tokens and self._grid_only and not self._response_on_grid(num_tokens):
                    self.checkpoint_store.counters.responses_off_pool_grid += 1
                    num_tokens = 0  # contract 13: the next turn restores the prompt checkpoint
                if num_tokens and not self._beats_vllm_state(request, num_tokens):
                    self.checkpoint_store.counters.responses_within_a_pool += 1
                    num_tokens = 0  # contract 11: vLLM's own hit recomputes the rest faster
                if num_tokens and not self._plan_response_on_pool_grid(request, num_tokens):
                    self._plan_capture(
                        request, num_tokens, RESPONSE, adopt=True, state_end=state_end, in_flight=in_flight
                    )
            else:
                if request.status == RequestStatus.FINISHED_ABORTED and request.num_output_tokens > 0:
                    self.checkpoint_store.counters.responses_aborted += 1
                if any(p.request_id == request_id for p in self._pending):
                    self._ledgers.taint(request_id)
            if self._pool_snapshots is not None:
                self._pool_snapshots.release(request_id)
        result = super()._free_request(request, delay_free_blocks)
        if self.boundaries_active:
            self._ledgers.free(request_id, captures_pending=any(p.request_id == request_id for p in self._pending))
            self._publish_ready()
        return result

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        if self.boundaries_active:
            if any(p.request_id == request.request_id for p in self._pending):
                self._ledgers.taint(request.request_id)
            self._ledgers[request.request_id].last_step = None
            if self._pool_snapshots is not None:
                self._pool_snapshots.release(request.request_id)
        super()._preempt_request(request, *args, **kwargs)

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        if self.boundaries_active:
            # Pending bundles hold block references too: vLLM's reset needs every block free.
            # A capture copy already on its way to the workers writes into a freed block
            # before any later step can reuse it (steps run in order).
            for pending in self._pending:
                if pending.ready_seq is None:  # its copies were not emitted: drop their source pins
                    self._block_pool.free_blocks(pending.plan.copy_sources())
                self._discard(pending)
            num_pending = len(self._pending)
            self._pending = []
            self._ledgers.forget_captures()
            if self._pool_snapshots is not None:
                self._pool_snapshots.release_all()
            dropped = self.checkpoint_store.clear()
            self._hit_balance.forget()
            logger.info(
                "boundary_checkpoints: prefix cache reset dropped %d checkpoints and %d pending captures",
                dropped,
                num_pending,
            )
        return super().reset_prefix_cache(*args, **kwargs)

    # ---- metrics --------------------------------------------------------------------------
    def boundary_stats(self) -> dict[str, int]:
        stats = self.checkpoint_store.counters.as_dict()
        stats["checkpoints_retained"] = len(self.checkpoint_store)
        stats["blocks_retained"] = self.checkpoint_store.retained_blocks
        stats["bytes_retained"] = self.checkpoint_store.retained_bytes
        stats["captures_pending"] = len(self._pending)
        stats["snapshot_blocks"] = self._snapshot_blocks
        stats.update(sorted(self._instruction_counts.items()))
        return stats

    def _finished_copy_seconds(self) -> list[float]:
        """The times of the capture copies that ran since the last report (oldest first)."""
        if not self._copy_timers:
            return []
        times = [timer.seconds() for timer in self._copy_timers]
        self._copy_timers = [timer for timer, seconds in zip(self._copy_timers, times) if seconds is None]
        return [seconds for seconds in times if seconds is not None]

    def _maybe_log_stats(self) -> None:
        interval = self.boundary_config.stats_log_interval_s
        now = time.monotonic()
        if interval <= 0 or now - self._last_stats_log < interval:
            return
        self._last_stats_log = now
        logger.info(
            "boundary_checkpoints: %s",
            ", ".join(f"{name}={value}" for name, value in self.boundary_stats().items()),
        )

    def _record_capture_cost(self, copies: list) -> None:
        """Count a step's capture copies (``(source, destination)`` block ids) and their bytes."""
        sizes: dict[int, int] = {}
        for pending in self._pending:
            sizes.update(pending.checkpoint.block_bytes())
        counters = self.checkpoint_store.counters
        counters.capture_steps += 1
        counters.capture_copies += len(copies)
        counters.capture_copy_bytes += sum(sizes.get(destination, 0) for _, destination in copies)

    def make_stats(self, *args, **kwargs):
        """vLLM's per-step ``SchedulerStats`` plus this step's boundary counters, on their way to
        the frontend's ``/metrics`` (``boundary_checkpoints/metrics.py``)."""
        stats = super().make_stats(*args, **kwargs)
        if stats is None or not self.boundaries_active:
            return stats
        copy_seconds = self._finished_copy_seconds()
        state = self._stats_state()
        if copy_seconds or state != self.__dict__.get("_reported_stats_state"):  # else nothing to send
            self._reported_stats_state = state
            self._step_counter_reporter.attach(stats, self.boundary_stats, copy_seconds)
        return stats

    def _stats_state(self) -> tuple[int, ...]:
        """What changes whenever a value of :meth:`boundary_stats` does (counters bump their version)."""
        store = self.checkpoint_store
        return (
            store.counters.version, len(store), store.retained_blocks, store.retained_bytes, len(self._pending),
            sum(self._instruction_counts.values()), self._snapshot_blocks,
        )  # fmt: skip


class BoundaryScheduler(BoundaryCheckpointMixin, Scheduler):
    """Synchronous vLLM scheduler with request-boundary checkpoints."""


class BoundaryAsyncScheduler(BoundaryCheckpointMixin, AsyncScheduler):
    """Async-scheduling vLLM scheduler with request-boundary checkpoints."""
