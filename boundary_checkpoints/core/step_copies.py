"""The copies a scheduler step hands its workers: attribute names on vLLM's ``SchedulerOutput``.

Contract: the scheduler (``core/scheduler.py``) sets these attributes on the ``SchedulerOutput``
of a step that needs them, and the plugin's worker classes (``worker/capture.py``) read them;
an absent attribute means no such copies. Each holds a list of ``(source block, destination
block)`` pairs of scheduler block ids, applied in every KV cache group of every worker:

* :data:`CAPTURE_COPIES_ATTR`: before the step's forward (and before vLLM's zeroing and its own
  copy-on-write copies): pages and states captured at a boundary an earlier step computed;
* :data:`IN_STEP_CAPTURES_ATTR`: during the forward, ``(state slot, destination)`` pairs the GDN
  layers split at ``P - 1`` (``worker/gdn_split.py``);
* :data:`POST_FORWARD_COPIES_ATTR`: right after the forward: pages the forward wrote (the
  attention tail page of an in-step capture).

The worker sets :data:`COPY_TIMES_ATTR` on the ``SchedulerOutput`` it was handed: a list of
timers (``seconds()``: the copies' time, None while they still run), one per launch of capture
copies. The scheduler reads it in ``update_from_output``. Only a worker in the engine core's own
process (vLLM's ``UniProcExecutor``: one GPU) hands back the same object; behind vLLM's
multiprocess executor (the CPU engine, tensor parallelism) the attribute stays on the worker's copy.

They live here, on the scheduler side, so that the scheduler never imports worker code.
"""

CAPTURE_COPIES_ATTR = "boundary_capture_copies"
IN_STEP_CAPTURES_ATTR = "boundary_in_step_captures"
POST_FORWARD_COPIES_ATTR = "boundary_post_forward_copies"
COPY_TIMES_ATTR = "boundary_copy_times"
IN_PROCESS_EXECUTORS = ("uni", "external_launcher")  # the worker runs in the engine core's process


def copy_times_reach_metrics(vllm_config) -> str:
    """For the startup line: whether the worker's copy timers reach the scheduler, and why."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend in IN_PROCESS_EXECUTORS:
        return "on /metrics (the worker runs in the engine core's process)"
    name = getattr(backend, "__name__", backend)
    return f"not on /metrics (executor {name}: the worker is another process)"
