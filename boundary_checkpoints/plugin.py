"""vLLM general-plugin entry point (``vllm.general_plugins`` -> ``boundary_checkpoints``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers). It
installs one config hook; whenever vLLM finalizes a ``VllmConfig``, :func:`apply_policy` reads
``additional_config["boundary_checkpoints"]`` (and ``VLLM_BOUNDARY_CHECKPOINTS_POLICY``), runs the
policy gate (``gate.py``), logs the decision once, and, when boundary retention is on, selects the
plugin's scheduler class (sync or async, matching vLLM's own choice) and the matching worker class
(``wiring.py``), and raises the CUDA graph ceiling where the user set none (``graph_ceiling.py``). A
``scheduler_cls`` the user configured that subclasses ``BoundaryCheckpointMixin`` is kept instead
(``--scheduler-cls``; the tests load a fault-injecting one this way). ``aligned`` and every
fallback leave the config untouched, so vLLM runs exactly as stock. Bad settings raise at startup.

:func:`register` first compares ``vllm.__version__`` with ``versions.SUPPORTED_VLLM_VERSIONS``. On
any other version it installs nothing of the plugin (``compat`` and its vLLM internals are never
imported) and only says so: one ERROR line, and a ``RuntimeError`` at startup when the policy is
explicitly ``request_boundaries`` (:func:`_register_unsupported`).
"""

from __future__ import annotations

import os

from vllm.logger import init_logger

from boundary_checkpoints import config_hook
from boundary_checkpoints.gate import decide_policy, log_decision_once
from boundary_checkpoints.graph_ceiling import raise_graph_ceiling, user_set_capture_sizes
from boundary_checkpoints.settings import ENV_POLICY, BoundaryConfig
from boundary_checkpoints.versions import check_vllm_version, installed_vllm_version, is_supported_vllm
from boundary_checkpoints.wiring import SCHEDULER_CLASSES, WORKER_CLASSES

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


def apply_policy(vllm_config, capture_sizes_set: bool = False) -> None:
    """Gate the policy for ``vllm_config`` and install the scheduler class it needs; where the user
    set no CUDA graph capture size (``capture_sizes_set``), raise the graph ceiling."""
    from boundary_checkpoints.compat import interface_mismatches

    config = BoundaryConfig.for_engine(vllm_config)
    mismatches = interface_mismatches() if config.policy != "aligned" else []
    decision = decide_policy(config, vllm_config, [f"installed vLLM differs from 0.32.0: {m}" for m in mismatches])
    log_decision_once(decision, logger)
    if decision.boundaries_enabled:
        scheduler_config = vllm_config.scheduler_config
        if scheduler_config.scheduler_cls is None or scheduler_config.scheduler_cls in SCHEDULER_CLASSES.values():
            scheduler_config.scheduler_cls = SCHEDULER_CLASSES[bool(scheduler_config.async_scheduling)]
        # else: a user-given subclass of the plugin's scheduler mixin (the gate accepted it): kept
        parallel_config = vllm_config.parallel_config
        parallel_config.worker_cls = WORKER_CLASSES.get(parallel_config.worker_cls, parallel_config.worker_cls)
        raise_graph_ceiling(vllm_config, config.graph_ceiling_tokens, capture_sizes_set, logger)


def register() -> None:
    version = installed_vllm_version()
    if not is_supported_vllm(version):
        _register_unsupported(version)
        return
    config_hook.install_vllm_config_hook(apply_policy, remember=user_set_capture_sizes)


def _register_unsupported(version: str) -> None:
    """vLLM ``version`` is not supported: leave vLLM stock and say so once, or refuse to start
    under an explicit ``request_boundaries``. ``VLLM_BOUNDARY_CHECKPOINTS_POLICY`` is known now;
    a policy in ``--additional-config`` only when vLLM finalizes its config, so the check then runs
    from the config hook (``config_hook.py``), reading only the policy."""
    if os.environ.get(ENV_POLICY):
        check_vllm_version(version, BoundaryConfig.from_additional_config(None).policy, logger)
        return
    config_hook.install_vllm_config_hook(
        lambda vllm_config, _: check_vllm_version(version, BoundaryConfig.for_engine(vllm_config).policy, logger)
    )
