"""vLLM's CPU worker (V1 model runner) with boundary capture copies and exact seeded sampling."""

from boundary_checkpoints.compat import cpu_worker_class
from boundary_checkpoints.worker.capture import CaptureCopyWorkerMixin
from boundary_checkpoints.worker.seeded import with_exact_discarded_draws
from boundary_checkpoints.worker.unit_choice import MatchUnitWorkerMixin

CPUWorker = cpu_worker_class()


class BoundaryCPUWorker(MatchUnitWorkerMixin, CaptureCopyWorkerMixin, CPUWorker):
    def init_device(self):
        super().init_device()  # builds self.model_runner (compat: CPUWorker.init_device)
        with_exact_discarded_draws(self.model_runner)
