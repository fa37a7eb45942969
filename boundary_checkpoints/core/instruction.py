"""The instruction boundary: the token count of a request's leading instructions (system prompt).

Contract
--------
* A request carries its instruction boundary ``N`` in ``sampling_params.extra_args`` under
  :data:`INSTRUCTION_TOKENS_KEY`. vLLM's OpenAI server copies a request's ``vllm_xargs`` there
  (``/v1/completions`` and ``/v1/chat/completions`` alike), so a client sends
  ``"vllm_xargs": {"boundary_checkpoints_instruction_tokens": N}``; the plugin's optional frontend
  fills it in for chat requests with leading system/developer messages (``frontend/serving.py``),
  and without a value the engine finds it from the chat template's markers
  (``core/chat_markers.py``).
* ``N`` is valid for a prompt of ``P`` tokens when it is an ``int`` (never a ``bool``) with
  ``0 < N < P``: the instructions are a proper prefix of the prompt. :func:`instruction_boundary`
  returns ``(N, "")`` for a valid value, ``(None, "")`` when the key is absent, and
  ``(None, reason)`` otherwise (``not_an_integer``, ``out_of_range``); the engine then ignores the
  value and counts the reason, it never fails the request. :func:`instruction_error` words the
  same check as a client-facing message (the frontend answers it with HTTP 400).

Nothing here imports vLLM, so the module is cheap to import in every process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

INSTRUCTION_TOKENS_KEY = "boundary_checkpoints_instruction_tokens"
REQUEST_FIELD = f"vllm_xargs.{INSTRUCTION_TOKENS_KEY}"

NOT_AN_INTEGER = "not_an_integer"
OUT_OF_RANGE = "out_of_range"


def instruction_boundary(extra_args: Mapping[str, Any] | None, num_prompt_tokens: int) -> tuple[int | None, str]:
    """``(N, "")`` for a valid boundary, ``(None, "")`` if absent, ``(None, reason)`` if invalid."""
    if not extra_args or INSTRUCTION_TOKENS_KEY not in extra_args:
        return None, ""
    value = extra_args[INSTRUCTION_TOKENS_KEY]
    if isinstance(value, bool) or not isinstance(value, int):
        return None, NOT_AN_INTEGER
    if not 0 < value < num_prompt_tokens:
        return None, OUT_OF_RANGE
    return value, ""


def instruction_error(extra_args: Mapping[str, Any] | None, num_prompt_tokens: int) -> str | None:
    """Client-facing message for an invalid boundary of a ``num_prompt_tokens`` prompt, else None."""
    _, reason = instruction_boundary(extra_args, num_prompt_tokens)
    if not reason:
        return None
    value = extra_args[INSTRUCTION_TOKENS_KEY]  # type: ignore[index]
    if reason == NOT_AN_INTEGER:
        return f"{REQUEST_FIELD} must be an integer token count (got {type(value).__name__} {value!r})"
    return (
        f"{REQUEST_FIELD} must be between 1 and the prompt length minus 1 "
        f"({num_prompt_tokens - 1} for this {num_prompt_tokens}-token prompt), got {value}"
    )
