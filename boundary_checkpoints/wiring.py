"""The classes the plugin installs into vLLM, by name.

Contract
--------
* :data:`SCHEDULER_CLASSES` (by ``async_scheduling``) and :data:`WORKER_CLASSES` (stock worker ->
  the plugin's worker class extending it) are what ``plugin.apply_policy`` sets on an engine's
  config; the gate and the scheduler read them to recognise the plugin's own classes.
* :func:`extends_boundary_scheduler` says whether a scheduler class is built on the plugin's
  scheduler mixin (:data:`SCHEDULER_MIXIN`).
* Names only: importing this module imports nothing of vLLM or of the plugin, and no function here
  imports the plugin's scheduler (a class built on its mixin exists only once the mixin's module is
  loaded).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

SCHEDULER_CLASSES = {
    False: "boundary_checkpoints.core.scheduler.BoundaryScheduler",
    True: "boundary_checkpoints.core.scheduler.BoundaryAsyncScheduler",
}
WORKER_CLASSES = {
    "vllm.v1.worker.gpu_worker.Worker": "boundary_checkpoints.worker.gpu.BoundaryGPUWorker",
    "vllm.v1.worker.cpu_worker.CPUWorker": "boundary_checkpoints.worker.cpu.BoundaryCPUWorker",
}
SCHEDULER_MIXIN = "boundary_checkpoints.core.scheduler.BoundaryCheckpointMixin"


def extends_boundary_scheduler(scheduler_cls: Any) -> bool:
    """True if ``scheduler_cls`` (a class, or its ``"module.Class"`` name) subclasses the plugin's
    ``BoundaryCheckpointMixin``: such a user-given class is kept as it is. Imports a named class
    (and with it vLLM) only when called; a name that does not import counts as a foreign class."""
    cls = scheduler_cls
    if isinstance(scheduler_cls, str):
        module, _, name = scheduler_cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return False
    mixin_module, _, mixin_name = SCHEDULER_MIXIN.rpartition(".")
    mixin = getattr(sys.modules.get(mixin_module), mixin_name, None)
    return isinstance(cls, type) and isinstance(mixin, type) and issubclass(cls, mixin)
