"""vLLM's GPU worker (Model Runner V2 or V1) with boundary capture copies."""

from vllm.v1.worker.gpu_worker import Worker

from boundary_checkpoints.worker.capture import CaptureCopyWorkerMixin


class BoundaryGPUWorker(CaptureCopyWorkerMixin, Worker):
    pass
