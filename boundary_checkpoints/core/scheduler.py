"""vLLM scheduler subclasses that capture, publish and restore exact boundary checkpoints.

Contract (one engine step at a time; data flows scheduler -> worker -> scheduler):

1. Chunk stop: a prompt of ``P`` tokens is prefilled so that a chunk ends at ``P - 1``
   (``_mamba_block_aligned_split``); the last prompt token runs in the next step -- unless the
   prompt is captured in the step (item 2, ``prompt_capture.py`` decides per engine): then a
   prefill step that ends at ``P`` is not stopped when its part before ``P - 1`` would run as a
   prefill row of its own (it starts at 0, or holds two tokens or more); other steps that cross
   ``P - 1`` (a one-token remainder after a restore, a resumed request that runs past ``P``) are
   stopped. With ``prompt_checkpoints: false`` there is no chunk stop and no prompt capture
   (item 2); with ``prompt_checkpoint_min_tokens: N`` a step that would cross ``P - 1`` after
   computing fewer than ``N`` tokens is neither stopped nor captured in (and so, unless it
   happens to end there, captures nothing). Counters: ``prompt_stops`` (chunks the plugin ended
   at ``P - 1``; vLLM's own align-mode split also ends one there when ``P - 1`` is a multiple of
   the block), ``prompt_captures_in_step``. A chunk the plugin cuts short of the prefill's end
   keeps stock's in-chunk state of the last block boundary (KDA, Mamba2): the step's blocks are
   counted as if the prefill ended at the cut (``recording_coordinator_class``), so vLLM reserves
   the block its worker writes that state into, and a prompt sharing the prefix hits it as under
   stock.
2. Capture (prompt): at the end of the ``schedule()`` that reached ``P - 1`` the plugin plans the
   bundle, pins the pages it must preserve and takes private destination blocks; the copies ride
   the *next* ``SchedulerOutput`` (attribute ``boundary_capture_copies``, applied by the plugin's
   worker class before the model runner sees the step, see ``worker/capture.py``) and therefore
   run on every worker after the forward that produced the state and before any later forward
   touches it (workers execute steps in order). The pins on the sources are dropped when that
   ``schedule()`` returns: any reuse of those blocks is scheduled later and so runs later.
   In-step capture: the ``schedule()`` that schedules the step ending at ``P`` plans the bundle
   at ``P - 1`` from the blocks that step writes (``plan_bundle`` with ``state_end = P``: the
   recurrent source is the block that holds the state after this step) and attaches to that
   step's output the recurrent ``(source, destination)`` pairs (``boundary_in_step_captures``:
   the GDN layers write the state after ``P - 1`` into the destination during the forward,
   ``worker/gdn_split.py``) and the attention tail copies (``boundary_post_forward_copies``:
   applied right after the forward). ``ready_seq`` is that step; the source pins are dropped at
   once (this step is their last writer before the capture, and any reuse runs later).
3. Capture (response): when a request finishes STOPPED or LENGTH_CAPPED its blocks hold the state
   after ``num_computed_tokens`` once every step scheduled so far has run. The plugin adopts the
   bundle by reference (no copy: nothing writes a finished request's blocks again); its
   ``ready_seq`` is the last step scheduled before the finish. Under speculative decoding (MTP,
   DFlash) the state is the one the request's last step left whole in its column 0, which may be up to
   ``k`` tokens before the committed length (``core/boundaries.py``:
   ``speculative_response_boundary``), and under MTP every bundle records the token after its
   boundary, which a restore must share (its MTP draft row depends on it, ``core/store.py``). A request
   that finishes with one verify step in flight (async scheduling) is captured from that step
   instead: when nothing was trimmed (a stop or length cap inside accepted drafts) and the step
   carries 0 or ``k`` drafts, it leaves the state after ``num_tokens`` tokens whole in its column
   0 (``in_flight_response_boundary``); the bundle adopts that column, its ``ready_seq`` is the
   in-flight step, and it takes that step's first sampled token as its next token from the
   step's output, where it is dropped if the step accepted every draft and ended on a block
   (vLLM's post-step copy overwrote the column). Until then no restore reads it (item 6). Where
   no exact state is left the response keeps no checkpoint (``responses_spec_in_flight``). The
   recorded end of a request's last step is vLLM's optimistic count until the earlier step
   returns; the plugin takes that step's rejected drafts back from it as vLLM does. The next
   token is recorded only for drafters whose rows read it (MTP, ``core/drafters.py``); DFlash's
   context rows depend on the prefix alone, so its bundles serve any token ``N``.
4. Publication: a captured bundle enters the store only in ``update_from_output`` of step
   ``ready_seq`` (the step that ran its copies, or for adoption the last step scheduled before
   the finish -- under speculative decoding the request's step still in flight, item 3): the
   step's output exists only after every worker returned it. A producer that is
   preempted or aborted before publication publishes nothing. Until then the pending bundle owns
   one reference per block (copy destinations, adopted blocks, shared pages).
5. Lineage: when a request that resumed from a *response* checkpoint (the next turn of a
   conversation) publishes its own response checkpoint, the turn it resumed from is retired
   (``CheckpointStore.retire``): its bundles are dropped unless another live turn still owns them,
   so a conversation keeps about two states (its latest prompt and response), not two per turn,
   and every live branch (n > 1, edits of a turn) keeps its own latest turn. A turn that kept no
   prompt checkpoint of its own becomes an owner of the response it resumed from, its resend
   restore point. A turn resumed from while still pending (contract 6) is the same
   ``Checkpoint`` object once published, and it is published (or discarded) before the resuming
   request's own bundle, whose step was scheduled later.
6. Restore: ``_get_local_prefix_cache_hit`` returns the longest of the stock hit, the longest
   published checkpoint and the longest *scheduled* pending bundle (``ready_seq`` set: adopted,
   or its copies emitted by an earlier ``schedule()``; producer not preempted or aborted; not
   waiting for its in-flight step's output, item 3). A
   checkpoint hit gives every group the same ``N``. vLLM's own partial-hit copy-on-write then
   copies the checkpoint's tail page and recurrent state into the new request's private blocks
   (a restore never writes a retained block; the plugin's worker applies these copies with its
   page-copy kernel, see ``worker/capture.py``). That copy rides the step being scheduled, which
   workers run after every step scheduled before it -- the producing forward and the capture
   copies included -- so a restore from a pending bundle reads final content. The
   plugin pins a hit's blocks for the rest of the ``schedule()`` that looked it up, and vLLM
   keeps its own reference on a copy source until the copy ran, so a bundle evicted, or (still
   pending) discarded, after the lookup only drops its own references.
7. Pressure: a bundle also holds the blocks of vLLM's own block-grid hit below its boundary that
   it does not hold already (the recurrent states on the block grid, ``_grid_blocks``), and
   releases them with its own: a request whose bundle was evicted still finds the hit stock would
   have given it, since retention never left those states to age out of vLLM's free queue
   first. Retained checkpoints hold at most ``max_retained_fraction`` of the block pool. When
   an allocation does not fit, bundles that give blocks back to the pool are evicted (LRU), one at
   a time until it fits, before vLLM would have to preempt or refuse a request; bundles whose pages
   running requests share free nothing and stay. vLLM's deliberate "not this step" answer for a
   recurrent hit on a block cached in the same step is not pressure and evicts nothing.
8. Reset: a prefix-cache reset (``POST /reset_prefix_cache``, pause, sleep) drops every retained
   and pending bundle first, so vLLM's own reset finds the pool free.
9. Misses: every eligible request's lookup is counted once, as a hit or as a miss with a reason
   (``miss_<reason>`` in the counters, a debug log line each); under MTP a hit that restores a
   shorter prefix than a bundle the next-token guard refused (a next turn that continues with
   another token than the one the producer's in-flight step sampled, which then restores its
   prompt checkpoint) is also counted in ``draft_next_token_fallbacks`` (with a debug line), and
   a miss that such a bundle would have turned into a hit has reason ``draft_next_token``. A
   response that ends in an abort (a client abort, or a stop string: vLLM matches those in the
   frontend, which aborts the request in the engine) keeps no checkpoint and is counted as
   ``responses_aborted``.
10. Instruction boundary: a request whose ``sampling_params.extra_args`` holds
   ``boundary_checkpoints_instruction_tokens = N_i`` (``vllm_xargs`` on the OpenAI server; the
   plugin's frontend validates it, and computes it for chat requests from their leading
   system/developer messages, see ``frontend/serving.py``) has a prefill chunk end exactly at
   ``N_i`` (before the ``P - 1`` stop; no stop when a bundle with that key is already retained or
   pending) and a bundle of kind ``instruction`` captured there like a prompt bundle (items 2, 4).
   Later requests with the same first ``N_i`` tokens and salt restore there through the usual
   longest-prefix lookup (item 6), so a longer prompt or response checkpoint still wins. An
   instruction bundle is never retired by lineage (item 5) and is evicted after every other kind
   (budget and pressure, item 7); an instruction boundary at ``P - 1`` makes the prompt bundle
   there an instruction bundle. A value that is not an int (or is a bool) or not in ``0 < N_i <
   P`` is ignored with a warning and counted (``instruction_ignored_<reason>``); the engine never
   fails the request for it. A request without a valid value whose prompt starts with a leading
   system/developer block of the chat template gets ``N_i`` = the end of that block (or blocks),
   found from the template's markers the engine learned at startup (``core/chat_markers.py``;
   ``chat_instruction_boundary: off`` turns this off). Counters: ``instruction_requests``,
   ``instruction_from_template``, ``instruction_stops``, ``instruction_hits``.
11. Indexer tail ring (GLM-5.3-Flash; a RING group, ``core/layout.py``): a bundle holds a copy
   of the producer's whole ring block at ``N``, taken in the same step as its recurrent copy
   (items 2, 3); under MTP the ring has lookahead slots (``pos % slots``) and the producer's
   writes past ``N`` never wrap onto the open pool's keys (``docs/notes/model-families.md``
   §10), so the same copy is exact at the prompt boundary and at the response boundaries of
   item 3. vLLM never restores the ring (the group is not prefix-cacheable; a request gets one fresh
   block): for a checkpoint hit the lookup gives vLLM no block for it, and the ``schedule()`` that
   admits the request appends ``(bundle ring block, the request's new ring block)`` to the step's
   ``kv_cache_block_copies``, which the plugin's worker applies (and so never zeroes that block)
   like vLLM's own restore copies (item 6); the bundle block is pinned until that ``schedule()``
   returns, and any later reuse of it runs in a later step. Pool grid (``kpool`` is the model's
   ``index_kpool``, never the ring's slot count): a prefill step that starts
   off the pool grid (``start % kpool != 0``: after a restore at such an ``N``, or after an
   instruction stop there) is cut to one token, so each step until the next pool boundary runs as
   a decode step, which reads the ring and writes the pool it completes; a longer step would run
   the indexer's prefill path, which forms pools only from the step's own tokens and never writes
   the straddling pool. A stop at ``P - 1`` is followed by a one-token step anyway. Only prefill
   steps are cut (vLLM's own test, ``is_prefill_step``): a decode step under MTP keeps its drafts
   and runs the decode path whatever its start. A cut step runs the indexer's decode path only
   where the indexer counts every row up to its threshold as a decode: under speculative
   decoding on an indexer that needs uniform decode rows (e.g. Hopper), a one-token row beside
   verify rows runs its prefill path and writes the pool it completes from the wrong tokens, so
   ``config.speculative_reasons`` refuses speculative decoding there
   (docs/notes/model-families.md §13).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from vllm.logger import init_logger

from boundary_checkpoints.compat import (
    AsyncScheduler,
    KVCacheBlockCopy,
    KVCacheBlocks,
    KVCacheManager,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    block_grid_hit,
    platform_is_cpu,
    sampled_token_ids,
)
from boundary_checkpoints.config import WORKER_CLASSES, BoundaryConfig, BoundaryConfigError
from boundary_checkpoints.core.boundaries import (
    INSTRUCTION,
    PROMPT,
    RESPONSE,
    BundlePlan,
    GroupKind,
    in_flight_response_boundary,
    plan_bundle,
    prompt_boundary,
    response_boundary,
    speculative_response_boundary,
)
from boundary_checkpoints.core.chat_markers import chat_markers_for
from boundary_checkpoints.core.drafters import reads_next_token
from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY, instruction_boundary
from boundary_checkpoints.core.keys import CheckpointKey, make_key, parent_of, root_discriminator
from boundary_checkpoints.core.layout import describe_layout
from boundary_checkpoints.core.step_copies import CAPTURE_COPIES_ATTR, IN_STEP_CAPTURES_ATTR, POST_FORWARD_COPIES_ATTR
from boundary_checkpoints.core.store import LASTING_KINDS, Checkpoint, CheckpointStore
from boundary_checkpoints.metrics import StepCounterReporter
from boundary_checkpoints.prompt_capture import IN_STEP, OFF, STOP, PromptCaptureDecision, decide_for

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

_FINISHED_WITH_CHECKPOINT = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


_RECORDING_COORDINATORS: dict[type, type] = {}


def recording_coordinator_class(cls: type) -> type:
    """``cls`` (a KV cache coordinator class) with a ``get_num_blocks_to_allocate`` that keeps its
    last answer in ``last_num_blocks_to_allocate`` and, for a request whose chunk the plugin cut
    short of the prefill's end (``cut_prefill_ends``: request id -> the cut chunk's end, set by the
    scheduler for the ``schedule()`` in progress), counts that step's blocks as if the prefill
    ended there; one class per coordinator type. The scheduler re-classes vLLM's coordinator to it
    (see compat: KV cache coordinator).

    Why the cut end: under vLLM's default sparse retention a recurrent group whose kernels export
    a block-boundary state from inside a chunk (KDA, Mamba2: ``num_prefill_checkpoint_blocks``)
    reserves the block for that state only on the chunk that reaches the prefill's end, while the
    worker exports it from any chunk (``compute_mamba_prefill_checkpoints`` knows no prefill end).
    A prefill cut at ``P - 1`` would leave the state of the last block boundary, which stock
    caches for the next prompt sharing the prefix, unreserved (written into the null block): the
    cut chunk is the last one that can hold it, so it is the prefill's end for that count."""
    if cls not in _RECORDING_COORDINATORS:
        count_blocks = cls.get_num_blocks_to_allocate

        def get_num_blocks_to_allocate(self, *args, **kwargs):
            cut_end = self.cut_prefill_ends.get(kwargs.get("request_id"))
            if cut_end is not None and not kwargs.get("apply_admission_cap") and kwargs.get("prefill_end", 0) > cut_end:
                kwargs["prefill_end"] = cut_end
            self.last_num_blocks_to_allocate = count_blocks(self, *args, **kwargs)
            return self.last_num_blocks_to_allocate

        # Single inheritance with no new slots keeps the instance layout, so __class__ can change.
        _RECORDING_COORDINATORS[cls] = type(
            f"Recording{cls.__name__}",
            (cls,),
            {"get_num_blocks_to_allocate": get_num_blocks_to_allocate, "last_num_blocks_to_allocate": None,
             "cut_prefill_ends": MappingProxyType({})},  # the scheduler sets its own dict
        )
    return _RECORDING_COORDINATORS[cls]


class PressureRelievingKVCacheManager(KVCacheManager):
    """KVCacheManager that evicts retained checkpoints before refusing an allocation.

    After a refused allocation it computes the shortfall (blocks vLLM asked for, plus the
    watermark and reservation it applied, minus the free blocks) and asks ``relieve_pressure``
    to free that many; it retries after every eviction, so it stops as soon as the allocation
    fits. vLLM's deliberate "not in this step" answer (more blocks than the whole pool, used to
    defer a recurrent hit on a block cached in the same step) is no shortage and evicts nothing.
    """

    relieve_pressure: Any = None  # (shortfall) -> bool (True: a bundle was evicted), set by the scheduler

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):  # type: ignore[override]
        while True:
            blocks = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
            if blocks is not None or self.relieve_pressure is None:
                return blocks
            shortfall = self.shortfall(request, kwargs)
            if shortfall is None or not self.relieve_pressure(shortfall):
                return None

    def shortfall(self, request, kwargs) -> int | None:
        """Blocks missing for the allocation just refused; None if freeing blocks cannot help."""
        needed = self.coordinator.last_num_blocks_to_allocate
        if needed is None or needed > self.block_pool.num_gpu_blocks:
            return None
        waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if waiting and kwargs.get("has_scheduled_reqs", True):
            needed += self.watermark_blocks
        needed += kwargs.get("reserved_blocks", 0)
        return max(needed - self.block_pool.get_num_free_blocks(), 1)


@dataclass
class StepRecord:
    """A request's last scheduled step under speculative decoding (contract 3)."""

    end: int  # where it ends, drafts included (vLLM's optimistic count until ``previous`` returned)
    drafts: int
    seq: int  # its step number
    previous: int | None  # the request's step before it (None: none since it was admitted or resumed)


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


def prompt_checkpoint_mode(config: BoundaryConfig, decision: PromptCaptureDecision) -> str:
    """How prompt checkpoints are taken, for the startup log line."""
    text = decision.describe()
    if config.prompt_checkpoint_min_tokens and decision.mode != OFF:
        text += f", when the prompt's last step computes >= {config.prompt_checkpoint_min_tokens} tokens"
    return text


def request_is_eligible(request: Request) -> bool:
    """Requests whose prefix is fully described by token ids, salt and LoRA identity."""
    return (
        request.sampling_params is not None
        and request.prompt_embeds is None
        and not request.mm_features
        and request.num_prompt_tokens > 0
    )


def is_prefill_step(request: Request, start: int) -> bool:
    """Whether a step from ``start`` prefills (vLLM's own test for splitting: the prompt, or output
    tokens a resumed request replays); a decode step keeps its drafts (contract 11)."""
    return start < max(request.num_prompt_tokens, request.num_tokens - 1)


class BoundaryCheckpointMixin:
    """Boundary capture/restore on top of vLLM's Scheduler (see module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.boundary_config = BoundaryConfig.from_additional_config(self.vllm_config.additional_config)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        kpool = getattr(self.vllm_config.model_config.hf_text_config, "index_kpool", None)
        geometries, reasons = describe_layout(
            self.kv_cache_config, managers, on_cpu=platform_is_cpu(), kpool=kpool, num_spec_tokens=self.num_spec_tokens
        )
        if not self.need_mamba_block_aligned_split:
            reasons.append("recurrent state is not kept block-aligned by this scheduler")
        worker_cls = self.vllm_config.parallel_config.worker_cls
        if worker_cls not in WORKER_CLASSES.values():
            reasons.append(f"worker class {worker_cls} does not apply capture copies")
        self.boundaries_active = not reasons
        self._prompt_captures_on = self.boundaries_active and self.boundary_config.prompt_checkpoints
        if reasons:
            message = "boundary_checkpoints: KV cache layout not supported: " + "; ".join(reasons)
            if self.boundary_config.policy == "request_boundaries":
                raise BoundaryConfigError(message)
            logger.warning("%s -> falling back to aligned retention", message)
            return
        self._geometries = geometries
        self._ring_groups = [g for g, geometry in enumerate(geometries) if geometry.kind is GroupKind.RING]
        self._prompt_capture = decide_for(self.boundary_config, self.vllm_config)
        if self._prompt_capture.mode == IN_STEP and self._ring_groups:
            self._prompt_capture = PromptCaptureDecision(STOP, "an indexer tail ring is captured after its step")
        self._prompt_in_step = self._prompt_captures_on and self._prompt_capture.mode == IN_STEP
        self._kpool = geometries[self._ring_groups[0]].pool if self._ring_groups else None  # not the ring's slots
        self._ring_restores: dict[str, Checkpoint] = {}  # this schedule()'s checkpoint hits (item 11)
        block_pool = self.kv_cache_manager.block_pool
        self._block_pool = block_pool
        max_blocks = int(block_pool.num_gpu_blocks * self.boundary_config.max_retained_fraction)
        self._page_bytes = tuple(g.page_bytes for g in geometries)
        self.checkpoint_store = CheckpointStore(release=block_pool.free_blocks, max_blocks=max_blocks)
        self._pending: list[PendingCapture] = []
        # A checkpoint is usable only by a prompt of N + 1 tokens or more, and vLLM takes prompts
        # of at most max_model_len - 1 tokens.
        self._max_useful_tokens = self.vllm_config.model_config.max_model_len - 2
        self._lookup_pins: list[Any] = []
        self._counted_requests: set[str] = set()
        self._restored_from: dict[str, Checkpoint] = {}
        self._tainted: set[str] = set()
        self._instruction_targets: dict[str, int | None] = {}  # request id -> valid N_i or None
        self._instruction_counts: dict[str, int] = {}
        self._chat_markers = chat_markers_for(self.boundary_config, self.vllm_config)  # contract 10
        self._stopped_at: dict[str, int] = {}  # request id -> P - 1 where the plugin cut its next chunk
        self._sched_seq = 0
        self._processed_seq = 0
        # Speculative decoding: per running request, its last scheduled step.
        self._last_steps: dict[str, StepRecord] = {}
        self._next_token_guard = reads_next_token(self.vllm_config.speculative_config)
        self._state_block_size = next(g.block_size for g in geometries if g.kind is GroupKind.RECURRENT)
        self._last_stats_log = time.monotonic()
        self.kv_cache_manager.__class__ = PressureRelievingKVCacheManager
        coordinator = self.kv_cache_manager.coordinator
        coordinator.__class__ = recording_coordinator_class(type(coordinator))
        coordinator.cut_prefill_ends = self._cut_prefill_ends = {}  # this schedule()'s cut chunks
        self.kv_cache_manager.relieve_pressure = self._relieve_pressure
        logger.info(
            "boundary_checkpoints: request_boundaries active: %d KV groups (%s), hash block %d, "
            "retaining at most %d of %d blocks, prompt checkpoints %s, chat instruction boundaries %s",
            len(geometries),
            ", ".join(g.label for g in geometries),
            self.hash_block_size,
            max_blocks,
            block_pool.num_gpu_blocks,
            prompt_checkpoint_mode(self.boundary_config, self._prompt_capture) if self._prompt_captures_on else "off",
            self._chat_markers.describe(),
        )

    # ---- keys -----------------------------------------------------------------------------
    def _root(self, request: Request):
        lora = request.lora_request.lora_int_id if request.lora_request is not None else None
        return root_discriminator(request.cache_salt, lora)

    def _key(self, request: Request, num_tokens: int) -> CheckpointKey | None:
        return make_key(
            request.all_token_ids, num_tokens, request.block_hashes, self.hash_block_size, self._root(request)
        )

    def _request_blocks(self, request_id: str):
        managers = self.kv_cache_manager.coordinator.single_type_managers
        return [manager.req_to_blocks.get(request_id, []) for manager in managers]

    def _instruction_target(self, request: Request) -> int | None:
        """The request's instruction boundary N_i (a valid explicit value, else the end of its leading
        system block by the chat template's markers), or None; validated and counted once."""
        request_id = request.request_id
        if request_id in self._instruction_targets:
            return self._instruction_targets[request_id]
        extra_args = request.sampling_params.extra_args if request.sampling_params is not None else None
        target, reason = instruction_boundary(extra_args, request.num_prompt_tokens)
        if reason:
            self._count_instruction(f"instruction_ignored_{reason}")
            logger.warning(
                "boundary_checkpoints: request %s: instruction boundary %r ignored (%s; prompt of %d tokens)",
                request_id, extra_args.get(INSTRUCTION_TOKENS_KEY), reason,
                request.num_prompt_tokens,
            )
        if target is None and self._chat_markers.markers is not None:
            target = self._chat_markers.markers.boundary(request.prompt_token_ids)
            if target is not None:
                self._count_instruction("instruction_from_template")
        if target is not None:
            self._count_instruction("instruction_requests")
        self._instruction_targets[request_id] = target
        return target

    def _count_instruction(self, name: str) -> None:
        self._instruction_counts[name] = self._instruction_counts.get(name, 0) + 1

    # ---- restore --------------------------------------------------------------------------
    def _get_local_prefix_cache_hit(self, request: Request):
        blocks, num_hit, shared_boundary, diverged = super()._get_local_prefix_cache_hit(request)
        if not self.boundaries_active:
            return blocks, num_hit, shared_boundary, diverged
        if not request_is_eligible(request):
            self._count_lookup(request, None, "ineligible")
            return blocks, num_hit, shared_boundary, diverged
        if not self.kv_cache_manager.prefix_cache_lookup_enabled(request):
            self._count_lookup(request, None, "cache_bypassed")
            return blocks, num_hit, shared_boundary, diverged
        root = self._root(request)

        def parents(start: int):
            return parent_of(start, request.block_hashes, self.hash_block_size, root)

        hit = self.checkpoint_store.lookup(request.all_token_ids, request.num_tokens - 1, parents, self.hash_block_size)
        pending = self._scheduled_pending_hit(request)
        if pending is not None and (hit is None or pending.num_tokens > hit.num_tokens):
            hit = pending
        # A longer bundle the next-token guard refused (MTP), classified once per request.
        counting = request.request_id not in self._counted_requests
        refused = self._guard_refusal(request, parents) if counting and self._next_token_guard else None
        if hit is None or hit.num_tokens <= num_hit:
            # A request that waits for room is looked up every step; classify its miss once (the
            # classification records a regret, see CheckpointStore.miss_reason).
            if counting:
                if refused is not None and refused.num_tokens > num_hit:
                    reason = "draft_next_token"
                elif hit is not None:
                    reason = "block_grid_as_long"
                else:
                    reason = self.checkpoint_store.miss_reason(
                        request.all_token_ids, request.num_tokens - 1, parents, self.hash_block_size
                    )
                self._count_lookup(request, None, reason, num_hit)
            self._restored_from.pop(request.request_id, None)
            return blocks, num_hit, shared_boundary, diverged
        if refused is not None and refused.num_tokens > hit.num_tokens:
            self.checkpoint_store.counters.draft_next_token_fallbacks += 1
            logger.debug(
                "boundary_checkpoints: request %s restores %s checkpoint at %d tokens, not the %s checkpoint "
                "at %d tokens: its MTP draft row was computed from next token %s, this prompt has %d there",
                request.request_id, hit.kind, hit.num_tokens, refused.kind, refused.num_tokens,
                refused.next_token, request.all_token_ids[refused.num_tokens],
            )
        self._count_lookup(request, hit, "", num_hit)
        self._restored_from[request.request_id] = hit
        pins = hit.distinct_blocks()
        self._block_pool.touch(pins)
        self._lookup_pins.extend(pins)
        logger.debug(
            "boundary_checkpoints: request %s restores %s checkpoint at %d tokens (stock hit %d)",
            request.request_id, hit.kind, hit.num_tokens, num_hit,
        )
        if self._ring_groups:
            self._ring_restores[request.request_id] = hit
        blocks = tuple([] if g in self._ring_groups else list(group) for g, group in enumerate(hit.group_blocks))
        return KVCacheBlocks(blocks), hit.num_tokens, 0, False

    def _count_lookup(self, request: Request, hit: Checkpoint | None, reason: str, num_hit: int = 0) -> None:
        """Count a request's first lookup as a hit, or as a miss with ``reason``."""
        if request.request_id in self._counted_requests:
            return
        self._counted_requests.add(request.request_id)
        self.checkpoint_store.record_lookup(hit, reason)
        if hit is not None and hit.kind == INSTRUCTION:
            self._count_instruction("instruction_hits")
        if hit is None:
            logger.debug(
                "boundary_checkpoints: request %s (%d tokens) restores no checkpoint: %s (block-grid hit %d)",
                request.request_id, request.num_tokens, reason, num_hit,
            )

    def _scheduled_pending_hit(self, request: Request, guarded: bool = True) -> Checkpoint | None:
        """Longest pending bundle a restore may already read (contract 6), or None; ``guarded=False``:
        also one the next-token guard refuses."""
        best: Checkpoint | None = None
        for pending in self._pending:
            num_tokens = pending.key.num_tokens
            if pending.ready_seq is None or pending.in_flight is not None or pending.request_id in self._tainted:
                continue
            if num_tokens >= request.num_tokens:  # like the store lookup: at most num_tokens - 1
                continue
            if (best is None or num_tokens > best.num_tokens) and self._key(request, num_tokens) == pending.key:
                if not guarded or pending.checkpoint.serves(request.all_token_ids):
                    best = pending.checkpoint
        return best

    def _guard_refusal(self, request: Request, parents) -> Checkpoint | None:
        """The longest bundle (retained, or pending and readable) that holds a prefix of ``request``
        if the next-token guard refuses it (its MTP draft row ``N - 1`` was computed from another
        token ``N``), else None. The lookup restored a shorter prefix instead, or none: the caller
        counts it (``draft_next_token_fallbacks``, or the miss reason ``draft_next_token``)."""
        found = (
            self.checkpoint_store.refused_by_guard(
                request.all_token_ids, request.num_tokens - 1, parents, self.hash_block_size
            ),
            self._scheduled_pending_hit(request, guarded=False),
        )
        longest = max((c for c in found if c is not None), key=lambda c: c.num_tokens, default=None)
        return longest if longest is not None and not longest.serves(request.all_token_ids) else None

    # ---- chunk stop -----------------------------------------------------------------------
    def _mamba_block_aligned_split(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        num_new_tokens = super()._mamba_block_aligned_split(
            request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
        if not self.boundaries_active:
            return num_new_tokens
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if not is_prefill_step(request, start):
            return num_new_tokens  # a decode step: no stop applies (and this schedule() cut none)
        cut = self._boundary_split(request, start, num_new_tokens)
        if cut < num_new_tokens and not is_prefill_step(request, start + num_new_tokens):
            self._cut_prefill_ends[request.request_id] = start + cut  # vLLM's chunk reached the prefill's end
        else:
            self._cut_prefill_ends.pop(request.request_id, None)
        return cut

    def _boundary_split(self, request: Request, start: int, num_new_tokens: int) -> int:
        """The plugin's chunk stops (contract 1) applied to vLLM's prefill chunk ``[start, start +
        num_new_tokens)``: the number of tokens to schedule."""
        if self._kpool and start % self._kpool:  # a prefill step (the caller's fast path took decodes)
            return min(num_new_tokens, 1)  # off the pool grid: decode steps up to the next pool (item 11)
        if not request_is_eligible(request):
            return num_new_tokens
        instruction = self._instruction_target(request)
        if instruction is not None and start < instruction < start + num_new_tokens:
            key = self._key(request, instruction)
            if key is not None and key not in self.checkpoint_store and not any(p.key == key for p in self._pending):
                self._count_instruction("instruction_stops")
                return instruction - start
        if not self._prompt_captures_on:
            return num_new_tokens
        stop = prompt_boundary(request.num_prompt_tokens)
        if not start < stop < start + num_new_tokens or not self._keeps_prompt_checkpoint(request, start):
            return num_new_tokens
        if self._captures_in_step(request, start, start + num_new_tokens):
            return num_new_tokens
        self._stopped_at[request.request_id] = stop  # counted once the step is scheduled
        return stop - start

    def _keeps_prompt_checkpoint(self, request: Request, start: int) -> bool:
        """Whether a prefill step from ``start`` that crosses ``P - 1`` keeps the prompt checkpoint
        (``prompt_checkpoint_min_tokens``)."""
        return prompt_boundary(request.num_prompt_tokens) - start >= self.boundary_config.prompt_checkpoint_min_tokens

    def _captures_in_step(self, request: Request, start: int, end: int) -> bool:
        """Whether the prefill step ``[start, end)`` that crosses ``P - 1`` takes the prompt
        checkpoint inside itself rather than stopping there (contract 1): in-step capture is on,
        the step ends at ``P``, and the part before ``P - 1`` would run as a prefill row of its
        own (a first chunk, or two tokens or more), as it does after the stop."""
        stop = prompt_boundary(request.num_prompt_tokens)
        return self._prompt_in_step and end == request.num_prompt_tokens and (start == 0 or stop - start >= 2)

    # ---- step boundaries ------------------------------------------------------------------
    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        if self.boundaries_active:
            self._cut_prefill_ends.clear()  # each schedule() splits its chunks anew
        output = super().schedule(*args, **kwargs)
        if not self.boundaries_active:
            return output
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
        if self._ring_restores:
            self._copy_restored_rings(output)
        if self._lookup_pins:
            self._block_pool.free_blocks(self._lookup_pins)
            self._lookup_pins = []
        return output

    def _copy_restored_rings(self, output: SchedulerOutput) -> None:
        """Append the ring copy of every request this step admits from a checkpoint (item 11)."""
        managers = self.kv_cache_manager.coordinator.single_type_managers
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
                [destination] = managers[g].req_to_blocks[request_id]
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
            self._publish_ready()
            self._maybe_log_stats()
        return outputs

    # ---- capture --------------------------------------------------------------------------
    def _record_last_steps(self, output: SchedulerOutput) -> None:
        """Keep, per scheduled request, this step's record: a response captured at finish reads
        the state the request's last step wrote."""
        drafts = output.scheduled_spec_decode_tokens
        for request_id in output.num_scheduled_tokens:
            end = self.requests[request_id].num_computed_tokens
            previous = self._last_steps.get(request_id)
            self._last_steps[request_id] = StepRecord(
                end, len(drafts.get(request_id, ())), self._sched_seq, previous.seq if previous else None
            )

    def _settle_speculative_step(self, output: SchedulerOutput, model_runner_output) -> None:
        """Before vLLM processes step ``_processed_seq``: take its rejected drafts back from the
        recorded end of each request's later step (as vLLM does from ``num_computed_tokens``),
        and settle the response bundles that waited for this step's output (contract 3)."""
        seq = self._processed_seq
        for request_id, drafts in output.scheduled_spec_decode_tokens.items():
            record = self._last_steps.get(request_id)
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
            self._discard(pending, dropped=False)
            self.checkpoint_store.counters.responses_spec_in_flight += 1

    def _response_boundary(self, request: Request) -> tuple[int, int | None, StepRecord | None]:
        """(N, state_end, in-flight step) of the response checkpoint of a finished request (N =
        0: none).

        Under speculative decoding the state comes from the request's last step: the one that
        finished it (``speculative_response_boundary``), or, under async scheduling, the step
        still in flight (``in_flight_response_boundary``, contract 3)."""
        if not self.num_spec_tokens:
            return response_boundary(request.num_computed_tokens, request.num_tokens), None, None
        step = self._last_steps.get(request.request_id)
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
            request.num_computed_tokens, request.num_tokens, step.end, step.drafts, self.num_spec_tokens,
            self._state_block_size,
        )
        return num_tokens, step.end, None

    def _plan_chunk_captures(self, output: SchedulerOutput) -> None:
        """Plan instruction and prompt captures of the prefill chunks that ended at one."""
        for request_id, num_scheduled in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            end = request.num_computed_tokens
            stopped = self._stopped_at.pop(request_id, None) == end  # the plugin's P - 1 stop
            if end - num_scheduled >= request.num_prompt_tokens:
                continue  # a step past the prompt ends at no prompt or instruction boundary
            if request_is_eligible(request):
                instruction = self._instruction_target(request)
                if instruction is not None and end == instruction:
                    self._plan_capture(request, instruction, INSTRUCTION, adopt=False)
                    continue  # an instruction boundary at P - 1 is kept as the lasting kind
            if not self._prompt_captures_on:
                continue
            target, start = prompt_boundary(request.num_prompt_tokens), end - num_scheduled
            if target == 0 or start >= target or end < target or not request_is_eligible(request):
                continue
            if end == target:
                self.checkpoint_store.counters.prompt_stops += stopped
                self._plan_capture(request, target, PROMPT, adopt=False)
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
    ) -> None:
        """Plan a bundle of ``request`` at ``num_tokens`` (its recurrent state written by the step
        that ended at ``state_end``, default ``num_tokens``); under MTP the bundle serves only
        prefixes with the same token ``num_tokens`` (its draft row ``num_tokens - 1`` was computed
        from it). ``in_flight``: the adopted state is written by that step, still in flight, whose
        output gives that token (contract 3). ``in_step``: the step being scheduled computes the
        prompt through ``state_end`` and takes the state after ``num_tokens`` inside its GDN
        layers (contract 2)."""
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
                if kind == INSTRUCTION:
                    pending.checkpoint.kind = INSTRUCTION
                return
        plan = plan_bundle(
            self._geometries,
            self._request_blocks(request.request_id),
            num_tokens,
            self._block_pool.null_block,
            state_end,
        )
        if plan is None:
            self.checkpoint_store.counters.captures_dropped += 1
            return
        sources = plan.copy_sources()
        grid = self._grid_blocks(request, num_tokens, plan)
        if adopt:
            destinations = tuple(plan.sources)  # the bundle's own reference on each source
        else:
            shared = {b.block_id for group in (*plan.shared, *grid) for b in group if not b.is_null}
            refusal = self.checkpoint_store.refusal(shared, len(sources), kind in LASTING_KINDS)
            if refusal is not None:  # refused before it takes blocks from vLLM's free queue
                counters = self.checkpoint_store.counters
                if refusal == "oversize":
                    counters.refused_oversize += 1
                else:
                    counters.refused_protected += 1
                return
        grid_pins = [b for group in grid for b in group]
        # Out of vLLM's free queue before any fresh block is taken, so none of them is one.
        self._block_pool.touch(grid_pins)
        if not adopt:
            if self._block_pool.get_num_free_blocks() < len(sources):
                self._block_pool.free_blocks(grid_pins)
                self.checkpoint_store.counters.captures_dropped += 1
                return
            fresh = iter(self._block_pool.get_new_blocks(len(sources)))
            destinations = tuple(None if s is None else next(fresh) for s in plan.sources)
        # Adopted: the bundle's references. Copied: pins dropped once the copies are emitted.
        self._block_pool.touch(sources)
        self._block_pool.touch([b for group in plan.shared for b in group if not b.is_null])
        next_token = request.all_token_ids[num_tokens] if self._next_token_guard and in_flight is None else None
        checkpoint = Checkpoint(
            key, kind, plan.group_blocks(destinations), self._page_bytes, producer=request.request_id,
            next_token=next_token, grid_blocks=grid,
        )
        pending = PendingCapture(
            request.request_id, checkpoint, plan, destinations, in_flight=in_flight, in_step=in_step
        )
        if adopt:
            pending.ready_seq = self._sched_seq if in_flight is None else in_flight.seq
        self._pending.append(pending)

    def _grid_blocks(self, request: Request, num_tokens: int, plan) -> tuple[tuple, ...]:
        """Per KV group, the blocks of vLLM's own block-grid hit for ``request``'s first
        ``num_tokens`` tokens that the bundle planned by ``plan`` does not hold (contract 7)."""
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
            if pending.request_id in self._tainted:
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
                    pairs = in_step if geometry.kind is GroupKind.RECURRENT else after
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
        still_pending: list[PendingCapture] = []
        for pending in self._pending:
            if pending.ready_seq is None or pending.ready_seq > self._processed_seq:
                still_pending.append(pending)
            elif pending.request_id in self._tainted:
                self._discard(pending)
            else:
                # The same object a restore may already hold in ``_restored_from`` (contract 6).
                published = self.checkpoint_store.publish(pending.checkpoint)
                source = self._restored_from.pop(pending.request_id, None) if pending.kind == RESPONSE else None
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
                        pending.kind, pending.request_id, pending.key.num_tokens,
                    )
        self._pending = still_pending
        live = {p.request_id for p in self._pending}
        self._tainted &= live

    def _discard(self, pending: PendingCapture, dropped: bool = True) -> None:
        """Give a pending bundle's references back; ``dropped``: count it in ``captures_dropped``."""
        self._restored_from.pop(pending.request_id, None)
        blocks = [b for group in pending.plan.shared for b in group if not b.is_null]
        blocks += [b for group in pending.checkpoint.grid_blocks for b in group]
        blocks += [d for d in pending.destinations if d is not None]
        self._block_pool.free_blocks(blocks)
        if dropped:
            self.checkpoint_store.counters.captures_dropped += 1

    # ---- request lifecycle ----------------------------------------------------------------
    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        if self.boundaries_active:
            self._counted_requests.discard(request.request_id)
            self._instruction_targets.pop(request.request_id, None)
            self._stopped_at.pop(request.request_id, None)
            if request.status not in _FINISHED_WITH_CHECKPOINT:
                self._restored_from.pop(request.request_id, None)
            if request.status in _FINISHED_WITH_CHECKPOINT and request_is_eligible(request):
                num_tokens, state_end, in_flight = self._response_boundary(request)
                if num_tokens:
                    self._plan_capture(
                        request, num_tokens, RESPONSE, adopt=True, state_end=state_end, in_flight=in_flight
                    )
                if not any(p.request_id == request.request_id and p.kind == RESPONSE for p in self._pending):
                    self._restored_from.pop(request.request_id, None)
            else:
                if request.status == RequestStatus.FINISHED_ABORTED and request.num_output_tokens > 0:
                    self.checkpoint_store.counters.responses_aborted += 1
                if any(p.request_id == request.request_id for p in self._pending):
                    self._tainted.add(request.request_id)
        result = super()._free_request(request, delay_free_blocks)
        if self.boundaries_active:
            self._last_steps.pop(request.request_id, None)
            self._publish_ready()
        return result

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        if self.boundaries_active and any(p.request_id == request.request_id for p in self._pending):
            self._tainted.add(request.request_id)
        if self.boundaries_active:
            self._last_steps.pop(request.request_id, None)
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
            self._tainted.clear()
            self._restored_from.clear()
            dropped = self.checkpoint_store.clear()
            logger.info(
                "boundary_checkpoints: prefix cache reset dropped %d checkpoints and %d pending captures",
                dropped, num_pending,
            )
        return super().reset_prefix_cache(*args, **kwargs)

    def _relieve_pressure(self, shortfall: int) -> bool:
        """Evict one retained bundle that gives blocks back to the pool, unless evicting every
        such bundle would still leave ``shortfall`` unmet; False when nothing was evicted."""
        store = self.checkpoint_store

        def is_free(block) -> bool:  # the store's reference is the last one
            return block.ref_cnt == 1

        if store.freeable_blocks(is_free) < shortfall:
            return False
        return store.evict_to_free(is_free)

    # ---- metrics --------------------------------------------------------------------------
    def boundary_stats(self) -> dict[str, int]:
        stats = self.checkpoint_store.counters.as_dict()
        stats["checkpoints_retained"] = len(self.checkpoint_store)
        stats["blocks_retained"] = self.checkpoint_store.retained_blocks
        stats["bytes_retained"] = self.checkpoint_store.retained_bytes
        stats["captures_pending"] = len(self._pending)
        stats.update(sorted(self._instruction_counts.items()))
        return stats

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
        if stats is not None and self.boundaries_active:
            reporter = self.__dict__.setdefault("_step_counter_reporter", StepCounterReporter())
            reporter.attach(stats, self.boundary_stats())
        return stats


class BoundaryScheduler(BoundaryCheckpointMixin, Scheduler):
    """Synchronous vLLM scheduler with request-boundary checkpoints."""


class BoundaryAsyncScheduler(BoundaryCheckpointMixin, AsyncScheduler):
    """Async-scheduling vLLM scheduler with request-boundary checkpoints."""
