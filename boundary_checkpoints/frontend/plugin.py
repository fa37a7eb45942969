"""vLLM endpoint-plugin entry point (``vllm.endpoint_plugins`` -> ``boundary_checkpoints``).

vLLM loads endpoint plugins in the API server process only, and only those named in the
``VLLM_PLUGINS`` allowlist: ``VLLM_PLUGINS=boundary_checkpoints`` enables this one together with
the general plugin of the same name (an allowlist also filters general plugins, so name it
there). Without it the engine still honours a valid instruction boundary sent in ``vllm_xargs``,
ignores (and counts) a bad one, and computes chat requests' boundaries itself from the chat
template's markers (``core/chat_markers.py``), but nothing answers a bad value with HTTP 400.

:meth:`BoundaryEndpointPlugin.init_state` re-classes the server's completion and chat serving
objects to the subclasses in ``frontend/serving.py`` (``__class__`` assignment, as the scheduler
does for vLLM's KV cache manager; no vLLM function is replaced), so vLLM's own routes, handlers
and error responses stay in place. It adds one route, ``GET
/v1/boundary_checkpoints/instruction_stats`` (the frontend's counters as JSON).
"""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

STATS_PATH = "/v1/boundary_checkpoints/instruction_stats"


class BoundaryEndpointPlugin:
    name = "boundary_checkpoints"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        from fastapi.responses import JSONResponse

        from boundary_checkpoints.frontend.serving import instruction_stats

        async def stats() -> JSONResponse:
            return JSONResponse(dict(sorted(instruction_stats.items())))

        app.add_api_route(STATS_PATH, stats, methods=["GET"])

    async def init_state(self, engine_client, state, args) -> None:
        from boundary_checkpoints.compat import frontend_interface_mismatches, openai_serving_classes, reclass_instance

        mismatches = frontend_interface_mismatches()
        if mismatches:
            logger.warning(
                "boundary_checkpoints: vLLM's OpenAI frontend differs from 0.32.0 (%s): instruction "
                "boundaries are neither validated nor computed in the frontend",
                "; ".join(mismatches),
            )
            return
        from boundary_checkpoints.frontend.serving import InstructionServingChat, InstructionServingCompletion

        OpenAIServingCompletion, OpenAIServingChat, _ = openai_serving_classes()

        for attr, stock, ours in (
            ("openai_serving_completion", OpenAIServingCompletion, InstructionServingCompletion),
            ("openai_serving_chat", OpenAIServingChat, InstructionServingChat),
        ):
            serving = getattr(state, attr, None)
            if serving is None:
                continue
            if type(serving) is not stock:
                logger.warning(
                    "boundary_checkpoints: %s is a %s, not vLLM's %s: instruction boundaries are not validated there",
                    attr,
                    type(serving).__name__,
                    stock.__name__,
                )
                continue
            reclass_instance(serving, ours)  # a subclass with no new state: vLLM's handler, extended
        logger.info("boundary_checkpoints: frontend validates and computes instruction boundaries")
