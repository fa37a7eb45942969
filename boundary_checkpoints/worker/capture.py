"""Worker-side half of capture: apply the step's boundary capture copies before the model runs.

Contract: the scheduler attaches ``(source block, destination block)`` pairs to the
``SchedulerOutput`` under :data:`CAPTURE_COPIES_ATTR`. Every worker (each TP rank holds its own
KV cache) copies those pages with :func:`~boundary_checkpoints.worker.kernels.copy_pages` before
handing the step to vLLM's model runner, i.e. after every earlier step's forward and before this
step's zeroing, copy-on-write copies and forward. That order is safe because capture sources are
pinned pages of a running or finished request (never zeroed or rewritten before this point) and
capture destinations are private blocks no request uses. Restores need no worker code: they use
vLLM's own partial-hit copy-on-write, which the runner applies after zeroing.

The copier (storage split and base addresses) is built on first use and rebuilt whenever the
runner's KV cache tensors change. The only runner attributes read are ``model_runner.kv_caches`` and
``model_runner.kv_cache_config.num_blocks``, present in both the V1 (CPU) and V2 (GPU) runners.
"""

from __future__ import annotations

from boundary_checkpoints.worker.kernels import PageCopier

CAPTURE_COPIES_ATTR = "boundary_capture_copies"


class CaptureCopyWorkerMixin:
    """Mixed into vLLM's worker classes (see ``worker/gpu.py`` and ``worker/cpu.py``)."""

    boundary_capture_copies_applied = 0
    _page_copier: PageCopier | None = None

    def execute_model(self, scheduler_output, *args, **kwargs):
        pairs = getattr(scheduler_output, CAPTURE_COPIES_ATTR, None)
        if pairs:
            self._copier().copy(pairs)
            self.boundary_capture_copies_applied += len(pairs)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def _copier(self) -> PageCopier:
        """The copier of the runner's current KV cache (rebuilt if vLLM reallocated it)."""
        runner = self.model_runner
        key = tuple(cache.data_ptr() for cache in runner.kv_caches)
        if self._page_copier is None or self._page_copier_key != key:
            self._page_copier = PageCopier(runner.kv_caches, runner.kv_cache_config.num_blocks)
            self._page_copier_key = key
        return self._page_copier
