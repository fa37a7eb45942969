"""vLLM's GPU worker (Model Runner V2 or V1) with boundary capture copies.

Model Runner V2 (the default) samples seeded requests statelessly and needs no change; a V1 runner
is re-classed for exact seeded sampling across partial-prefill steps (``worker/seeded.py``).
"""

from boundary_checkpoints.compat import gpu_worker_class
from boundary_checkpoints.worker.capture import CaptureCopyWorkerMixin
from boundary_checkpoints.worker.seeded import with_exact_discarded_draws
from boundary_checkpoints.worker.unit_choice import MatchUnitWorkerMixin

Worker = gpu_worker_class()


class BoundaryGPUWorker(MatchUnitWorkerMixin, CaptureCopyWorkerMixin, Worker):
    def _make_model_runner(self):
        return with_exact_discarded_draws(super()._make_model_runner())
