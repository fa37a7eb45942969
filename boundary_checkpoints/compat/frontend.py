"""vLLM 0.32's frontend internals: the stat logger plugin base and the OpenAI server's classes.

Contract: ``AggregateStatLoggerBase`` is imported eagerly (``metrics.py`` subclasses it at import
time); the OpenAI server's classes are imported on first call of :func:`openai_serving_classes`,
in the API server process only. Names and the behaviour relied on:

* ``AggregateStatLoggerBase`` (v1/metrics/loggers.py) and the ``vllm.stat_logger_plugins`` entry
  point group: subclassed by the plugin's stat logger. Relied on: ``StatLoggerManager`` builds
  plugin loggers before vLLM's logging and Prometheus loggers and calls ``record`` on them in
  that order with the same stats object; ``log_engine_initialized`` runs after every logger is
  built; ``PrometheusStatLogger.__init__`` unregisters every default-registry collector whose name
  starts with ``vllm:``; ``/metrics`` serves ``prometheus_client``'s default registry.
* OpenAI frontend: ``OpenAIServingCompletion`` and ``OpenAIServingChat`` (the endpoint plugin
  re-classes the instances at ``state.openai_serving_completion`` / ``state.openai_serving_chat``
  to subclasses in ``frontend/serving.py``), whose ``render_completion_request(request)`` and
  ``render_chat_request(request)`` return the engine inputs (or an ``ErrorResponse``), with
  ``_extract_prompt_len``, ``_extract_prompt_components``, ``create_error_response`` and
  ``online_renderer.render_chat``; ``ErrorResponse``. :func:`frontend_interface_mismatches`
  checks these before the plugin installs its subclasses.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

__all__ = ["AggregateStatLoggerBase", "openai_serving_classes"]


def openai_serving_classes():
    """``(OpenAIServingCompletion, OpenAIServingChat, ErrorResponse)`` of vLLM's OpenAI frontend,
    imported on first call (only the API server process needs them)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    return OpenAIServingCompletion, OpenAIServingChat, ErrorResponse
