"""Worker-side copies: apply a step's capture and restore copies with one kernel before the model runs.

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

The copier (storage split and device-side region table) is built on first use and rebuilt
whenever the runner's KV cache tensors change. The only runner attributes read are
``model_runner.kv_caches`` and ``model_runner.kv_cache_config.num_blocks``, present in both the
V1 (CPU) and V2 (GPU) runners.
"""

from __future__ import annotations

import copy

from boundary_checkpoints.worker.kernels import PageCopier

CAPTURE_COPIES_ATTR = "boundary_capture_copies"


class CaptureCopyWorkerMixin:
    """Mixed into vLLM's worker classes (see ``worker/gpu.py`` and ``worker/cpu.py``)."""

    boundary_capture_copies_applied = 0
    boundary_restore_copies_applied = 0
    _page_copier: PageCopier | None = None

    def execute_model(self, scheduler_output, *args, **kwargs):
        captures = getattr(scheduler_output, CAPTURE_COPIES_ATTR, None)
        restores = scheduler_output.kv_cache_block_copies
        copier = self._copier() if captures or restores else None
        if captures:
            copier.copy(captures)
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
        return super().execute_model(scheduler_output, *args, **kwargs)

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
        return self._page_copier
