"""Capture: plan a bundle where a chunk or a request ends at a boundary, emit its copies with a
step, publish it once that step returned, or discard it (contracts 2-5 in ``docs/design.md``).

Contract: :class:`CaptureMixin` keeps the pending bundles (:class:`PendingCapture`); a pending
bundle owns one reference per block it will hold until it is published (the store takes them
over) or discarded (they are given back). It reads the scheduler's state that
``BoundaryCheckpointMixin.__init__`` sets, and asks ``core/yielding.py`` whether a capture's new
blocks would thrash vLLM's cache (``_capture_would_thrash``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from boundary_checkpoints.compat import (
    Request,
    SchedulerOutput,
    block_grid_hit,
    sampled_token_ids,
)
from boundary_checkpoints.core.boundaries import (
    INSTRUCTION,
    PROMPT,
    RESPONSE,
    BundlePlan,
    in_flight_response_boundary,
    plan_bundle,
    response_boundary,
    speculative_response_boundary,
)
from boundary_checkpoints.core.checkpoint import LASTING_KINDS, Checkpoint
from boundary_checkpoints.core.chunk_stops import request_is_eligible
from boundary_checkpoints.core.keys import CheckpointKey
from boundary_checkpoints.core.ledger import StepRecord
from boundary_checkpoints.core.pool_snapshots import with_state_blocks
from boundary_checkpoints.core.step_copies import IN_STEP_CAPTURES_ATTR, POST_FORWARD_COPIES_ATTR

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


@dataclass
class PendingCapture:
    """A bundle final once step ``ready_seq`` has run; published once that step returned."""

    request_id: str
    checkpoint: Checkpoint  # the bundle to publish (and to restore from once ``ready_seq`` is set)
    plan: BundlePlan
    destinations: tuple[Any, ...]  # per group: private block (or adopted source) or None
    ready_seq: int | None = None  # None: copies not emitted yet
    in_flight: StepRecord | None = None  # the step whose output settles the bundle (contract 3)
    in_step: bool = False  # taken inside the step that computes the prompt (contract 2)

    @property
    def key(self) -> CheckpointKey:
        return self.checkpoint.key

    @property
    def kind(self) -> str:
        return self.checkpoint.kind


class CaptureMixin:
    """Capture side of the boundary scheduler (module docstring)."""

    # ---- capture --------------------------------------------------------------------------
    def _record_last_steps(self, output: SchedulerOutput) -> None:
        """Keep, per scheduled request, this step's record: a response captured at finish reads
        the state the request's last step wrote."""
        drafts = output.scheduled_spec_decode_tokens
        for request_id in output.num_scheduled_tokens:
            end = self.requests[request_id].num_computed_tokens
            ledger = self._ledgers[request_id]
            previous = ledger.last_step
            ledger.last_step = StepRecord(
                end, len(drafts.get(request_id, ())), self._sched_seq, previous.seq if previous else None
            )

    def _settle_speculative_step(self, output: SchedulerOutput, model_runner_output) -> None:
        """Before vLLM processes step ``_processed_seq``: take its rejected drafts back from the
        recorded end of each request's later step (as vLLM does from ``num_computed_tokens``),
        and settle the bundles that waited for this step's output: response bundles adopted from
        it (contract 3) and, under MTP, prompt bundles at ``P`` whose guard token it sampled
        (contract 2)."""
        seq = self._processed_seq
        for request_id, drafts in output.scheduled_spec_decode_tokens.items():
            ledger = self._ledgers.get(request_id)
            record = ledger.last_step if ledger is not None else None
            sampled = sampled_token_ids(model_runner_output, request_id)
            if record is not None and record.previous == seq and sampled:
                record.end -= len(drafts) - (len(sampled) - 1)
        unsettled = []
        for pending in self._pending:
            step = pending.in_flight
            if step is None or step.seq != seq:
                continue
            sampled = sampled_token_ids(model_runner_output, pending.request_id)
            overwritten = step.drafts > 0 and len(sampled) == step.drafts + 1 and step.end % self._state_block_size == 0
            if sampled and not overwritten:
                pending.checkpoint.next_token = sampled[0] if self._next_token_guard else None
                pending.in_flight = None
            else:
                unsettled.append(pending)
        for pending in unsettled:
            self._pending.remove(pending)
            if pending.ready_seq is None:  # a prompt bundle at P whose copies were not emitted
                self._block_pool.free_blocks(pending.plan.copy_sources())
            if pending.kind == RESPONSE:
                self._discard(pending, dropped=False)
                self.checkpoint_store.counters.responses_spec_in_flight += 1
            else:
                self._discard(pending)

    def _response_boundary(self, request: Request) -> tuple[int, int | None, StepRecord | None]:
        """(N, state_end, in-flight step) of the response checkpoint of a finished request (N =
        0: none).

        Under speculative decoding the state comes from the request's last step: the one that
        finished it (``speculative_response_boundary``), or, under async scheduling, the step
        still in flight (``in_flight_response_boundary``, contract 3)."""
        if not self.num_spec_tokens:
            return response_boundary(request.num_computed_tokens, request.num_tokens), None, None
        step = self._ledgers[request.request_id].last_step
        if step is None:
            return 0, None, None
        if step.seq > self._processed_seq:
            num_tokens = in_flight_response_boundary(
                request.num_computed_tokens, request.num_tokens, step.drafts, self.num_spec_tokens
            )
            if not num_tokens:
                self.checkpoint_store.counters.responses_spec_in_flight += 1
                return 0, None, None
            return num_tokens, request.num_computed_tokens, step
        num_tokens = speculative_response_boundary(
            request.num_computed_tokens,
            request.num_tokens,
            step.end,
            step.drafts,
            self.num_spec_tokens,
            self._state_block_size,
        )
        return num_tokens, step.end, None

    def _plan_chunk_captures(self, output: SchedulerOutput) -> None:
        """Plan instruction and prompt captures of the prefill chunks that ended at one."""
        for request_id, num_scheduled in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            end = request.num_computed_tokens
            if end - num_scheduled >= request.num_prompt_tokens:
                continue  # a step past the prompt ends at no prompt or instruction boundary
            ledger = self._ledgers[request_id]
            stopped, ledger.stopped_at = ledger.stopped_at == end, None  # the plugin's P - 1 stop
            if request_is_eligible(request):
                instruction = self._instruction_target(request)
                if instruction is not None and end == instruction:
                    self._plan_capture(request, instruction, INSTRUCTION, adopt=False)
                    continue  # an instruction boundary at P - 1 is kept as the lasting kind
            if not self._prompt_captures_on:
                continue
            target, start = self._prompt_target(request), end - num_scheduled
            if target == 0 or start >= target or end < target or not request_is_eligible(request):
                continue
            at_end = target == request.num_prompt_tokens  # prompt_capture end: no stop applied the minimum
            if end == target and (not at_end or self._keeps_prompt_checkpoint(request, start)):
                self.checkpoint_store.counters.prompt_stops += stopped
                # At P under MTP the guard token is the one this step samples: settled from its output.
                in_flight = StepRecord(end, 0, self._sched_seq, None) if at_end and self._next_token_guard else None
                self._plan_capture(request, target, PROMPT, adopt=False, in_flight=in_flight)
            elif self._keeps_prompt_checkpoint(request, start) and self._captures_in_step(request, start, end):
                self._plan_capture(request, target, PROMPT, adopt=False, state_end=end, in_step=True)

    def _plan_capture(
        self,
        request: Request,
        num_tokens: int,
        kind: str,
        adopt: bool,
        state_end: int | None = None,
        in_flight: StepRecord | None = None,
        in_step: bool = False,
        state_blocks: tuple[Any, ...] | None = None,
    ) -> None:
        """Plan a bundle of ``request`` at ``num_tokens`` (its recurrent state written by the step
        that ended at ``state_end``, default ``num_tokens``); under MTP the bundle serves only
        prefixes with the same token ``num_tokens`` (its draft row ``num_tokens - 1`` was computed
        from it). ``in_flight``: the adopted state is written by that step, still in flight, whose
        output gives that token (contract 3). ``in_step``: the step being scheduled computes the
        prompt through ``state_end`` and takes the state after ``num_tokens`` inside its GDN
        layers (contract 2). ``state_blocks``: the recurrent states are those blocks' (a pool-grid
        snapshot, contract 12), not the request's own."""
        if num_tokens > self._max_useful_tokens:
            return  # no prompt vLLM accepts could resume there
        key = self._key(request, num_tokens)
        if key is None:
            return
        if key in self.checkpoint_store:
            if kind == INSTRUCTION:  # a prompt checkpoint at the same prefix becomes lasting
                self.checkpoint_store.make_lasting(key)
            return
        for pending in self._pending:
            if pending.key == key:
                if adopt and pending.ready_seq is None and not pending.in_step:
                    # Its copies wait for a next step that a finished request may never get (a
                    # prompt checkpoint at P of an answer of one token): the adopted bundle replaces it.
                    self._drop_before_copies(pending)
                    break
                if kind == INSTRUCTION:
                    pending.checkpoint.kind = INSTRUCTION
                return
        blocks = self._request_blocks(request.request_id)
        if state_blocks is not None:
            blocks = with_state_blocks(self._geometries, blocks, state_blocks, num_tokens)
        plan = plan_bundle(
            self._geometries,
            blocks,
            num_tokens,
            self._block_pool.null_block,
            state_end,
        )
        if plan is None:
            self.checkpoint_store.counters.captures_dropped += 1
            return
        sources = plan.copy_sources()
        if not adopt:
            shared = {b.block_id for group in plan.shared for b in group if not b.is_null}
            refusal = self.checkpoint_store.refusal(shared, len(sources), kind in LASTING_KINDS)
            if refusal is not None:  # refused before it takes blocks from vLLM's free queue
                counters = self.checkpoint_store.counters
                if refusal == "oversize":
                    counters.refused_oversize += 1
                else:
                    counters.refused_protected += 1
                return
        grid = self._grid_blocks(request, num_tokens, plan)
        grid_pins = [b for group in grid for b in group]
        # Out of vLLM's free queue before any fresh block is taken, so none of them is one.
        self._block_pool.touch(grid_pins)
        if adopt:
            destinations = tuple(plan.sources)  # the bundle's own reference on each source
        elif self._block_pool.get_num_free_blocks() < len(sources):
            self._block_pool.free_blocks(grid_pins)
            self.checkpoint_store.counters.captures_dropped += 1
            return
        elif self._capture_would_thrash(len(sources)):
            self.checkpoint_store.refuse_thrashing(key)
            return
        else:
            fresh = iter(self._block_pool.get_new_blocks(len(sources)))
            destinations = tuple(None if s is None else next(fresh) for s in plan.sources)
        # Adopted: the bundle's references. Copied: pins dropped once the copies are emitted.
        self._block_pool.touch(sources)
        self._block_pool.touch([b for group in plan.shared for b in group if not b.is_null])
        next_token = request.all_token_ids[num_tokens] if self._next_token_guard and in_flight is None else None
        checkpoint = Checkpoint(
            key,
            kind,
            plan.group_blocks(destinations),
            self._page_bytes,
            producer=request.request_id,
            next_token=next_token,
            grid_blocks=grid,
        )
        pending = PendingCapture(
            request.request_id, checkpoint, plan, destinations, in_flight=in_flight, in_step=in_step
        )
        if adopt:
            pending.ready_seq = self._sched_seq if in_flight is None else in_flight.seq
        self._pending.append(pending)

    def _grid_blocks(self, request: Request, num_tokens: int, plan) -> tuple[tuple, ...]:
        """Per KV group, the blocks of vLLM's own block-grid hit for ``request``'s first
        ``num_tokens`` tokens that the bundle planned by ``plan`` does not hold (contract 7). None
        under retention ``borrow``: vLLM's cache keeps them as it would without the bundle."""
        if self.checkpoint_store.borrow:
            return ()
        blocks, num_hit = block_grid_hit(self.kv_cache_manager, request.block_hashes, num_tokens)
        if not num_hit:
            return ()
        held = {b.block_id for group in plan.shared for b in group if not b.is_null}
        held |= {b.block_id for b in plan.sources if b is not None}
        return tuple(tuple(b for b in group if not b.is_null and b.block_id not in held) for group in blocks)

    def _emit_pending_copies(self, output: SchedulerOutput) -> list:
        """Attach planned capture copies to this step and drop their source pins."""
        copies: list = []
        # A 0-token step is not counted; the next counted step runs after it.
        ready_seq = self._sched_seq if output.total_num_scheduled_tokens > 0 else self._sched_seq + 1
        kept: list[PendingCapture] = []
        for pending in self._pending:
            if pending.ready_seq is not None:
                kept.append(pending)
                continue
            if self._ledgers.is_tainted(pending.request_id):
                self._discard(pending)
            else:
                for source, destination in zip(pending.plan.sources, pending.destinations, strict=True):
                    if source is not None:
                        copies.append((source.block_id, destination.block_id))
                pending.ready_seq = ready_seq
                kept.append(pending)
            self._block_pool.free_blocks(pending.plan.copy_sources())
        self._pending = kept
        return copies

    def _emit_in_step_captures(self, output: SchedulerOutput) -> list:
        """Attach the in-step captures planned for this step: recurrent ``(slot, destination)``
        pairs the GDN layers fill during the forward, and the pages copied after it (the attention
        tail, which this step writes). Their source pins are dropped: the step itself is their
        last writer before the capture. Returns every pair."""
        in_step, after = [], []
        for pending in self._pending:
            if not pending.in_step or pending.ready_seq is not None:
                continue
            for geometry, source, destination in zip(self._geometries, pending.plan.sources, pending.destinations):
                if source is not None:
                    pairs = in_step if geometry.captured_in_forward else after
                    pairs.append((source.block_id, destination.block_id))
            pending.ready_seq = self._sched_seq
            self._block_pool.free_blocks(pending.plan.copy_sources())
            self.checkpoint_store.counters.prompt_captures_in_step += 1
        if in_step:
            setattr(output, IN_STEP_CAPTURES_ATTR, in_step)
        if after:
            setattr(output, POST_FORWARD_COPIES_ATTR, after)
        return in_step + after

    def _publish_ready(self) -> None:
        if not self._pending and not self._ledgers.unsettled:
            return  # nothing to publish or settle (most decode steps)
        still_pending: list[PendingCapture] = []
        for pending in self._pending:
            if pending.ready_seq is None or pending.ready_seq > self._processed_seq:
                still_pending.append(pending)
            elif self._ledgers.is_tainted(pending.request_id):
                self._discard(pending)
            else:
                # The same object a restore may already hold as its ledger's ``restored_from`` (contract 6).
                published = self.checkpoint_store.publish(pending.checkpoint)
                source = self._ledgers.take_restored_from(pending.request_id) if pending.kind == RESPONSE else None
                own_prompts = [
                    c for c in self.checkpoint_store.checkpoints()
                    if c.kind == PROMPT and c.producer == pending.request_id
                ] if published and pending.kind == RESPONSE else []  # fmt: skip
                if published and source is not None and source.kind == RESPONSE:
                    # The conversation moved on from that turn. A resend (restored from a prompt
                    # checkpoint) is a branch and retires nothing. A turn that kept no prompt
                    # checkpoint of its own (deduplicated against a sibling's, or skipped by
                    # prompt_checkpoint_min_tokens) owns the response it resumed from: that is
                    # where a resend of its prompt restores.
                    if not own_prompts:
                        self.checkpoint_store.adopt(source, pending.request_id)
                    self.checkpoint_store.retire(source.producer)  # leaves own_prompts: they are this turn's
                # The next turn restores from this response bundle: the request's own prompt
                # bundle (a resend's) goes first under a tight budget.
                for checkpoint in own_prompts:
                    self.checkpoint_store.demote(checkpoint)
                if published:
                    logger.debug(
                        "boundary_checkpoints: published %s checkpoint of %s at %d tokens",
                        pending.kind,
                        pending.request_id,
                        pending.key.num_tokens,
                    )
        self._pending = still_pending
        self._ledgers.settle({p.request_id for p in self._pending})

    def _drop_before_copies(self, pending: PendingCapture, keep_lineage: bool = False) -> None:
        """Take back a pending bundle whose copies were not emitted: it leaves the pending list and
        gives back its source pins and its references (not counted as dropped)."""
        self._pending.remove(pending)
        self._block_pool.free_blocks(pending.plan.copy_sources())
        self._discard(pending, dropped=False, keep_lineage=keep_lineage)

    def _discard(self, pending: PendingCapture, dropped: bool = True, keep_lineage: bool = False) -> None:
        """Give a pending bundle's references back; ``dropped``: count it in ``captures_dropped``;
        ``keep_lineage``: the request's response, captured later, still follows what it restored."""
        if not keep_lineage:
            self._ledgers.take_restored_from(pending.request_id)  # no lineage to follow from it
        blocks = [b for group in pending.plan.shared for b in group if not b.is_null]
        blocks += [b for group in pending.checkpoint.grid_blocks for b in group]
        blocks += [d for d in pending.destinations if d is not None]
        self._block_pool.free_blocks(blocks)
        if dropped:
            self.checkpoint_store.counters.captures_dropped += 1
