"""vLLM's CPU worker (V1 model runner) with boundary capture copies."""

from vllm.v1.worker.cpu_worker import CPUWorker

from boundary_checkpoints.worker.capture import CaptureCopyWorkerMixin


class BoundaryCPUWorker(CaptureCopyWorkerMixin, CPUWorker):
    pass
