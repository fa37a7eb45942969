"""Worker-side copies: a step's capture and restore copies around the model's forward, and the
in-step prompt captures inside it.

Contract:

* Capture. The scheduler attaches ``(source block, destination block)`` pairs to the
  ``SchedulerOutput`` under :data:`CAPTURE_COPIES_ATTR`. Every worker (each TP rank holds its own
  KV cache) copies those pages before handing the step to vLLM's model runner, i.e. after every
  earlier step's forward and before this step's zeroing, copy-on-write copies and forward. That
  order is safe because capture sources are pinned pages of a running or finished request (never
  zeroed or rewritten before this point) and capture destinations are private blocks that no
  request uses and vLLM never zeroes.
* Restore. A restore is vLLM's own partial-hit copy-on-write: the scheduler lists whole-block
  copies in ``SchedulerOutput.kv_cache_block_copies`` and the runner would apply them with a
  gather/scatter per storage after zeroing the step's new blocks. The worker applies them instead,
  with the same page-copy kernel, right after the capture copies (a separate launch, so a page
  captured in this step is never read by a restore in the same launch), and hands the runner a
  shallow copy of the step without those copies and without their destinations in
  ``new_block_ids_to_zero``: a copied block is overwritten whole in every storage, so zeroing it
  first changes nothing. Sources are retained or cached blocks, never a step's new blocks.
* In-step capture (``prompt_capture: in_step``, ``worker/gdn_split.py``). The scheduler lists
  ``(slot, destination)`` block pairs under :data:`IN_STEP_CAPTURES_ATTR`: the GDN layers write
  the recurrent state after ``P - 1`` of the prompt computed in this step into the destination
  during the forward. After ``load_model`` the worker re-classes the model's GDN layers when the
  engine's configuration decides ``in_step`` (the scheduler decides from the same configuration);
  a step whose pairs no layer took (the split never ran: a FULL CUDA graph replayed it, say)
  fails with an error rather than leaving a checkpoint unwritten.
* Post-forward copies. Pages the scheduler lists under :data:`POST_FORWARD_COPIES_ATTR` (the
  attention tail page of an in-step capture, written by this step's forward) are copied right
  after the runner's ``execute_model`` returned, on the same stream, so before any later step.
* Copy times. Each launch of capture or post-forward copies is timed (:class:`CopyTimer`), and the
  timers go on the ``SchedulerOutput`` the worker was handed, under :data:`COPY_TIMES_ATTR`, for
  the scheduler's ``/metrics`` histogram (``core/step_copies.py`` says where that reaches it).

The copier (storage split and device-side region table) is built when vLLM warms the model up
(``compile_or_warm_up_model``, after the KV cache is allocated), where it compiles its kernel
variants on copies of a page onto itself (``PageCopier.warm_up``) before vLLM's own warm-up, which
arms vLLM's JIT monitor when it ends, and rebuilt whenever the
runner's KV cache tensors change. The only runner attributes read are
``model_runner.kv_caches`` and ``model_runner.kv_cache_config.num_blocks``, present in both the
V1 (CPU) and V2 (GPU) runners.
"""

from __future__ import annotations

import copy
import time

import torch
from vllm.logger import init_logger

from boundary_checkpoints.core.step_copies import (
    CAPTURE_COPIES_ATTR,
    COPY_TIMES_ATTR,
    IN_STEP_CAPTURES_ATTR,
    POST_FORWARD_COPIES_ATTR,
)
from boundary_checkpoints.worker.kernels import PageCopier

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class CopyTimer:
    """The time of one launch of capture copies: CUDA events on a GPU (read once the copies ran,
    no host sync), the host's clock elsewhere (the copies run synchronously there)."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        self._elapsed: float | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._elapsed = time.perf_counter() - self._started

    def seconds(self) -> float | None:
        """The copies' time in seconds; None while they still run on the device."""
        if self._elapsed is None and self._events is not None and self._events[1].query():
            self._elapsed = self._events[0].elapsed_time(self._events[1]) / 1000
        return self._elapsed


class CaptureCopyWorkerMixin:
    """Mixed into vLLM's worker classes (see ``worker/gpu.py`` and ``worker/cpu.py``)."""

    boundary_capture_copies_applied = 0
    boundary_restore_copies_applied = 0
    boundary_in_step_captures_applied = 0
    _page_copier: PageCopier | None = None
    _step_captures = None  # worker/gdn_split.StepCaptures once the GDN layers are re-classed

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        from boundary_checkpoints.compat import platform_is_cpu
        from boundary_checkpoints.prompt_capture import decide_for
        from boundary_checkpoints.settings import BoundaryConfig

        config = BoundaryConfig.for_engine(self.vllm_config)
        if decide_for(config, self.vllm_config).splits_in_step:
            from boundary_checkpoints.worker.gdn_split import install

            self._step_captures = install(self.vllm_config, on_cpu=platform_is_cpu())

    def compile_or_warm_up_model(self, *args, **kwargs):
        # The KV cache exists (initialize_from_config ran). Compile the copy kernel first: vLLM's
        # warm-up ends by arming its JIT monitor, which reports any compile after it as "during
        # inference" (otherwise this warm-up's own two variants are reported there).
        self._copier().warm_up()
        return super().compile_or_warm_up_model(*args, **kwargs)

    def execute_model(self, scheduler_output, *args, **kwargs):
        handed = scheduler_output
        captures = getattr(scheduler_output, CAPTURE_COPIES_ATTR, None)
        in_step = getattr(scheduler_output, IN_STEP_CAPTURES_ATTR, None)
        after = getattr(scheduler_output, POST_FORWARD_COPIES_ATTR, None)
        restores = scheduler_output.kv_cache_block_copies
        copier = self._copier() if captures or restores or after else None
        timers = []
        if captures:
            timers.append(self._timed_copy(copier, captures))
            self.boundary_capture_copies_applied += len(captures)
        if restores:
            copier.copy([(c.src_block_id, c.dst_block_id) for c in restores])
            self.boundary_restore_copies_applied += len(restores)
            copied = {c.dst_block_id for c in restores}
            scheduler_output = copy.copy(scheduler_output)
            scheduler_output.kv_cache_block_copies = None
            if scheduler_output.new_block_ids_to_zero:
                to_zero = [b for b in scheduler_output.new_block_ids_to_zero if b not in copied]
                scheduler_output.new_block_ids_to_zero = to_zero or None
        if timers or after:  # on the scheduler's own object (``core/step_copies.py``)
            setattr(handed, COPY_TIMES_ATTR, timers)
        if in_step:
            output = self._execute_with_in_step_captures(in_step, scheduler_output, *args, **kwargs)
        else:
            output = super().execute_model(scheduler_output, *args, **kwargs)
        if after:
            timers.append(self._timed_copy(copier, after))
            self.boundary_capture_copies_applied += len(after)
        return output

    def _timed_copy(self, copier: PageCopier, pairs) -> CopyTimer:
        timer = CopyTimer(self.model_runner.kv_caches[0].device)
        copier.copy(pairs)
        timer.stop()
        return timer

    def _execute_with_in_step_captures(self, pairs, scheduler_output, *args, **kwargs):
        if self._step_captures is None:
            raise RuntimeError("in-step prompt captures were scheduled, but this worker's GDN layers are vLLM's")
        self._step_captures.begin(pairs)
        try:
            output = super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            missing = self._step_captures.end()
        if missing:
            raise RuntimeError(
                f"in-step prompt captures of state blocks {missing} were not taken: no GDN layer split "
                "their rows (was the step replayed from a FULL CUDA graph?)"
            )
        self.boundary_in_step_captures_applied += len(pairs)
        return output

    def boundary_in_step_count(self) -> int:
        """In-step captures taken so far (``collective_rpc("boundary_in_step_count")``)."""
        return self.boundary_in_step_captures_applied

    def boundary_copy_counts(self) -> list[int]:
        """Capture and restore copies applied so far (``collective_rpc("boundary_copy_counts")``)."""
        return [self.boundary_capture_copies_applied, self.boundary_restore_copies_applied]

    def _copier(self) -> PageCopier:
        """The copier of the runner's current KV cache (rebuilt if vLLM reallocated it)."""
        runner = self.model_runner
        key = tuple(cache.data_ptr() for cache in runner.kv_caches)
        if self._page_copier is None or self._page_copier_key != key:
            self._page_copier = PageCopier(runner.kv_caches, runner.kv_cache_config.num_blocks)
            self._page_copier_key = key
            logger.info("boundary_checkpoints: page copies: %s", self._page_copier.describe())
        return self._page_copier
