"""Every vLLM 0.32 internal the plugin touches, in one package, so a version bump is one package.

Contract: the rest of the plugin reaches a private vLLM internal only through a name imported from
here (``from boundary_checkpoints.compat import X``), never from vLLM or from a submodule. Public
vLLM API used elsewhere: ``vllm.logger.init_logger`` and the OpenAI server / ``vllm.LLM``.
Importing this package loads the vLLM modules its submodules import eagerly (the scheduler and
KV cache classes, ``VllmConfig``, ``AggregateStatLoggerBase``); everything else is imported on
first call. Each submodule states the names and the behaviour it relies on:

* ``scheduler``: scheduler, KV cache manager, coordinator, block pool and request internals;
* ``worker``: worker, model runner and GDN layer internals (worker processes only);
* ``engine``: engine configuration, platform, plugin loading and the re-classing of instances;
* ``frontend``: the stat logger plugin base and the OpenAI server's classes;
* ``signatures``: the 0.32.0 signatures relied on and the checks against the installed vLLM.
"""

# Each submodule's ``__all__`` is the list of what it offers; this package offers their union.
from boundary_checkpoints.compat import engine, frontend, scheduler, signatures, worker
from boundary_checkpoints.compat.engine import *  # noqa: F403
from boundary_checkpoints.compat.frontend import *  # noqa: F403
from boundary_checkpoints.compat.scheduler import *  # noqa: F403
from boundary_checkpoints.compat.signatures import *  # noqa: F403
from boundary_checkpoints.compat.worker import *  # noqa: F403

__all__ = [*engine.__all__, *frontend.__all__, *scheduler.__all__, *signatures.__all__, *worker.__all__]
