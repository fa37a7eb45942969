"""OpenAI-server side of the instruction boundary: validate it, and compute it for chat requests.

Contract
--------
* ``/v1/completions``: a request that carries
  ``vllm_xargs: {"boundary_checkpoints_instruction_tokens": N}`` is checked against every prompt it
  renders (``0 < N < P``, ``N`` an integer); a bad value is answered with HTTP 400 (a
  ``BadRequestError`` whose ``param`` is ``vllm_xargs.boundary_checkpoints_instruction_tokens``) before
  anything reaches the engine. A valid value travels to the engine unchanged (vLLM copies
  ``vllm_xargs`` into ``sampling_params.extra_args``), where the scheduler stops a prefill chunk at
  ``N`` and keeps an instruction checkpoint there (``core/scheduler.py``, contract 10).
* ``/v1/chat/completions``: an explicit value is checked the same way. Otherwise, when the
  conversation starts with one or more ``system``/``developer`` messages and has more messages
  after them, those leading messages alone are rendered with the request's own template,
  template arguments and tools (a copy of the request with only those messages, no generation
  prompt, no final-message continuation), through the same renderer as the full prompt. Their
  token count ``N`` is passed to the engine only if those tokens are an exact prefix of the full
  rendered prompt and ``N`` is shorter than it; otherwise (a template that renders the system
  block differently depending on later messages, a render that fails, a request with reused
  prompt ids or a Harmony model) nothing is passed and the reason is counted.
* Counters (``instruction_stats``, also served at ``GET /v1/boundary_checkpoints/instruction_stats``):
  ``completions_checked``, ``rejected_<reason>``, ``chat_boundary_set``, ``chat_skipped_<reason>``.

The classes subclass vLLM's own serving classes; the endpoint plugin (``frontend/plugin.py``)
re-classes the server's serving objects to them, so every request still runs vLLM's own code
paths, with only ``render_*_request`` extended.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from vllm.logger import init_logger

from boundary_checkpoints.compat import openai_serving_classes
from boundary_checkpoints.core.instruction import (
    INSTRUCTION_TOKENS_KEY,
    REQUEST_FIELD,
    instruction_boundary,
    instruction_error,
)

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
OpenAIServingCompletion, OpenAIServingChat, ErrorResponse = openai_serving_classes()

INSTRUCTION_ROLES = ("system", "developer")
instruction_stats: Counter[str] = Counter()


def leading_instructions(messages: list[Any]) -> list[Any]:
    """The leading system/developer messages of a conversation."""
    leading = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if role not in INSTRUCTION_ROLES:
            break
        leading.append(message)
    return leading


def instruction_prefix_length(instruction_ids: list[int], prompt_ids: list[int]) -> int | None:
    """``len(instruction_ids)`` if it is a proper, non-empty token prefix of ``prompt_ids``."""
    n = len(instruction_ids)
    if 0 < n < len(prompt_ids) and list(prompt_ids[:n]) == list(instruction_ids):
        return n
    return None


def _check_explicit(serving, extra_args: dict | None, prompt_lengths: list[int]) -> ErrorResponse | None:
    for prompt_len in prompt_lengths:
        message = instruction_error(extra_args, prompt_len)
        if message is not None:
            _, reason = instruction_boundary(extra_args, prompt_len)
            instruction_stats[f"rejected_{reason}"] += 1
            return serving.create_error_response(message, param=REQUEST_FIELD)
    return None


class InstructionServingCompletion(OpenAIServingCompletion):
    """vLLM's completion serving, with the instruction boundary validated after rendering."""

    async def render_completion_request(self, request):
        result = await super().render_completion_request(request)
        if isinstance(result, ErrorResponse) or INSTRUCTION_TOKENS_KEY not in (request.vllm_xargs or {}):
            return result
        instruction_stats["completions_checked"] += 1
        error = _check_explicit(self, request.vllm_xargs, [self._extract_prompt_len(e) for e in result])
        return error if error is not None else result


class InstructionServingChat(OpenAIServingChat):
    """vLLM's chat serving, with the instruction boundary validated or computed after rendering."""

    async def render_chat_request(self, request):
        result = await super().render_chat_request(request)
        if isinstance(result, ErrorResponse):
            return result
        _, engine_inputs = result
        extra_args = request.vllm_xargs or {}
        if INSTRUCTION_TOKENS_KEY in extra_args:
            error = _check_explicit(self, extra_args, [self._extract_prompt_len(e) for e in engine_inputs])
            return error if error is not None else result
        n, reason = await self._instruction_tokens(request, engine_inputs)
        if n is None:
            if reason:
                instruction_stats[f"chat_skipped_{reason}"] += 1
                logger.debug("boundary_checkpoints: chat request: no instruction boundary (%s)", reason)
            return result
        instruction_stats["chat_boundary_set"] += 1
        request.vllm_xargs = {**extra_args, INSTRUCTION_TOKENS_KEY: n}  # read by to_sampling_params
        return result

    async def _instruction_tokens(self, request, engine_inputs) -> tuple[int | None, str]:
        """The token count of the leading instructions and, when there is none, why ("" if the
        conversation simply has no leading instructions)."""
        leading = leading_instructions(request.messages)
        if not leading or len(leading) == len(request.messages):
            return None, ""
        if len(engine_inputs) != 1:
            return None, "several_prompts"
        if getattr(self.online_renderer, "use_harmony", False):
            return None, "harmony"
        if request.kv_transfer_params:
            return None, "kv_transfer"
        prompt_ids = self._extract_prompt_components(engine_inputs[0]).token_ids
        if not prompt_ids:
            return None, "no_prompt_ids"
        instructions = request.model_copy(
            update={
                "messages": copy.deepcopy(leading),
                "add_generation_prompt": False,
                "continue_final_message": False,
                "n": 1,
            },
            deep=True,
        )
        try:
            rendered = await self.online_renderer.render_chat(instructions)
        except Exception as err:  # a template may refuse a conversation without a user turn
            logger.debug("boundary_checkpoints: rendering the leading instructions failed: %s", err)
            return None, "render_failed"
        if isinstance(rendered, ErrorResponse):
            return None, "render_failed"
        _, instruction_inputs = rendered
        if len(instruction_inputs) != 1:
            return None, "render_failed"
        instruction_ids = self._extract_prompt_components(instruction_inputs[0]).token_ids or []
        n = instruction_prefix_length(instruction_ids, prompt_ids)
        if n is None:
            return None, "not_a_prefix"
        return n, ""
