"""Minimal OpenAI-server client: ``/v1/completions`` with token-ID or text prompts, and
``/v1/chat/completions`` with messages (standard library only).

Every call sends a token-ID prompt with greedy sampling, ``ignore_eos`` and ``return_token_ids``,
so the caller gets the exact answer ids back and can build the next turn of a conversation from
ids alone. ``cached_tokens`` is read from ``usage.prompt_tokens_details.cached_tokens`` (the server
must run with ``--enable-prompt-tokens-details``).

``complete`` makes one non-streaming request (``complete_json`` returns its whole body).
``stream_complete`` streams (with ``stream_options.include_usage`` so usage still arrives in the
last chunk) and also measures TTFT: the time from sending the request to the first chunk that
carries text or token ids (a chunk with an empty choice does not count).

``chat`` sends a conversation as ``messages`` to ``/v1/chat/completions`` (greedy, with
``return_token_ids``, so the answer ids and the rendered prompt ids come back too), streaming or not,
and returns the same :class:`Completion`: ``text`` is the assistant message's content, to be sent
back as the next turn's assistant message.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


class CompletionError(RuntimeError):
    """The server answered with an HTTP error or a body we could not use."""


@dataclass
class Completion:
    """One finished completion."""

    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    finish_reason: str | None
    latency_s: float
    ttft_s: float | None = None
    usage: dict = field(default_factory=dict)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # with logprobs=k requested
    prompt_token_ids: list[int] = field(default_factory=list)  # chat: the rendered prompt (return_token_ids)
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended the answer


def build_request(
    prompt_ids: list[int] | str,
    *,
    model: str = "tiny",
    max_tokens: int = 32,
    cache_salt: str | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    stream: bool = False,
    **extra,
) -> dict:
    """The JSON body of a completion request: token-ID prompt, or a text prompt given as ``str``."""
    body = {
        "model": model,
        "prompt": prompt_ids if isinstance(prompt_ids, str) else [int(t) for t in prompt_ids],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
    }
    return _with_options(body, cache_salt, stream, extra)


COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


def _with_options(body: dict, cache_salt: str | None, stream: bool, extra: dict) -> dict:
    """``body`` with the salt, streaming with usage in the last chunk, and ``extra`` merged last."""
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def _post(base_url: str, body: dict, timeout: float, path: str = COMPLETIONS_PATH):
    request = urllib.request.Request(
        f"{base_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        detail = err.read().decode("utf-8", errors="replace")[:2000]
        raise CompletionError(f"HTTP {err.code} from {base_url}{path}: {detail}") from err


def _top_logprobs(choice: dict) -> list[dict[int, float]]:
    """Per-position top logprobs keyed by token id (needs ``return_tokens_as_token_ids``)."""
    logprobs = choice.get("logprobs") or {}
    return [
        {int(key.removeprefix("token_id:")): value for key, value in (position or {}).items()}
        for position in logprobs.get("top_logprobs") or []
    ]


def _cached_tokens(usage: dict) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def complete(base_url: str, prompt_ids: list[int], *, timeout: float = 300.0, **kwargs) -> Completion:
    """One non-streaming completion; ``kwargs`` go to ``build_request``."""
    body = build_request(prompt_ids, **kwargs)
    start = time.perf_counter()
    with _post(base_url, body, timeout) as resp:
        payload = json.load(resp)
    return _parse_completion(payload, time.perf_counter() - start, chat=False, prompt_tokens=len(prompt_ids))


def _parse_completion(payload: dict, latency: float, *, chat: bool, prompt_tokens: int) -> Completion:
    """The first choice of a non-streaming completion (``chat``: a chat completion) body;
    ``prompt_tokens``: the count when the body's usage has none."""
    try:
        choice = payload["choices"][0]
        usage = payload.get("usage") or {}
        return Completion(
            token_ids=list(choice.get("token_ids") or []),
            text=((choice.get("message") or {}).get("content") or "") if chat else choice.get("text", ""),
            prompt_tokens=usage.get("prompt_tokens", prompt_tokens),
            completion_tokens=usage.get("completion_tokens", 0),
            cached_tokens=_cached_tokens(usage),
            finish_reason=choice.get("finish_reason"),
            latency_s=latency,
            usage=usage,
            top_logprobs=_chat_top_logprobs(choice) if chat else _top_logprobs(choice),
            prompt_token_ids=list(payload.get("prompt_token_ids") or []) if chat else [],
            stop_reason=choice.get("stop_reason"),
        )
    except (KeyError, IndexError, TypeError, ValueError) as err:
        kind = "chat completion" if chat else "completion"
        raise CompletionError(f"unexpected {kind} body: {str(payload)[:2000]}") from err


def complete_json(base_url: str, prompt_ids: list[int] | str, *, timeout: float = 300.0, **kwargs) -> dict:
    """The whole JSON body of one non-streaming completion (``n`` choices, per-choice ids, stop
    fields: what :class:`Completion` does not keep); ``kwargs`` go to :func:`build_request`."""
    with _post(base_url, build_request(prompt_ids, **kwargs), timeout) as resp:
        return json.load(resp)


def iter_sse_events(resp):
    """Yield the decoded JSON of each ``data:`` line of a server-sent-events stream."""
    for raw in resp:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def stream_complete(base_url: str, prompt_ids: list[int], *, timeout: float = 300.0, **kwargs) -> Completion:
    """One streaming completion: answer ids, usage (last chunk) and TTFT."""
    body = build_request(prompt_ids, stream=True, **kwargs)
    return _read_stream(base_url, body, timeout, COMPLETIONS_PATH, len(prompt_ids), chat=False)


def _read_stream(base_url: str, body: dict, timeout: float, path: str, prompt_len: int, chat: bool) -> Completion:
    """Send a streaming request and collect its chunks into a :class:`Completion`.

    TTFT is the time to the first chunk that carries output: text (content for chat, whose first
    chunk carries only the role) or token ids. Usage comes in the last chunk
    (``stream_options.include_usage``)."""
    start = time.perf_counter()
    ttft = None
    token_ids: list[int] = []
    prompt_token_ids: list[int] = []
    text_parts: list[str] = []
    usage: dict = {}
    top_logprobs: list[dict[int, float]] = []
    finish_reason = stop_reason = None
    with _post(base_url, body, timeout, path) as resp:
        for event in iter_sse_events(resp):
            if "error" in event and "choices" not in event:
                raise CompletionError(f"stream error: {event['error']}")
            prompt_token_ids = event.get("prompt_token_ids") or prompt_token_ids
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if ttft is None and (text or choice.get("token_ids")):
                    ttft = time.perf_counter() - start
                token_ids.extend(choice.get("token_ids") or [])
                top_logprobs.extend(_chat_top_logprobs(choice) if chat else _top_logprobs(choice))
                text_parts.append(text or "")
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
                    stop_reason = choice.get("stop_reason")
            if event.get("usage"):
                usage = event["usage"]
    return Completion(
        token_ids=token_ids,
        text="".join(text_parts),
        prompt_tokens=usage.get("prompt_tokens", len(prompt_token_ids) or prompt_len),
        completion_tokens=usage.get("completion_tokens", len(token_ids)),
        cached_tokens=_cached_tokens(usage),
        finish_reason=finish_reason,
        latency_s=time.perf_counter() - start,
        ttft_s=ttft,
        usage=usage,
        top_logprobs=top_logprobs,
        prompt_token_ids=prompt_token_ids,
        stop_reason=stop_reason,
    )


# ------------------------------------------------------------------------------------------------
# /v1/chat/completions


def build_chat_request(
    messages: list[dict],
    *,
    model: str = "tiny",
    max_tokens: int = 32,
    cache_salt: str | None = None,
    temperature: float = 0.0,
    logprobs: int | None = None,
    stream: bool = False,
    **extra,
) -> dict:
    """The JSON body of a chat request: greedy by default, ``return_token_ids`` on, EOS honoured
    (chat users rarely send ``ignore_eos``). ``logprobs=k`` asks for the top-k of every position
    keyed by token id. ``extra`` (``logit_bias``, ``min_tokens``, ``chat_template``, ...) is
    merged in last."""
    body = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "return_token_ids": True,
    }
    if logprobs:
        body.update(logprobs=True, top_logprobs=logprobs, return_tokens_as_token_ids=True)
    return _with_options(body, cache_salt, stream, extra)


def _chat_top_logprobs(choice: dict) -> list[dict[int, float]]:
    """Per-position top logprobs of a chat choice keyed by token id (``return_tokens_as_token_ids``)."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return [
        {int(e["token"].removeprefix("token_id:")): e["logprob"] for e in position.get("top_logprobs") or []}
        for position in content
    ]


def chat(base_url: str, messages: list[dict], *, stream: bool = False, timeout: float = 300.0, **kwargs) -> Completion:
    """One chat completion; ``kwargs`` go to :func:`build_chat_request`.

    ``text`` is the assistant content (joined deltas when streaming), ``token_ids`` the answer ids
    (a stop token such as EOS included, as the engine committed them), ``prompt_token_ids`` the
    prompt the server rendered, ``cached_tokens`` from ``usage.prompt_tokens_details``. Streaming
    also measures TTFT (first chunk carrying content or token ids; the role-only first chunk does
    not count)."""
    body = build_chat_request(messages, stream=stream, **kwargs)
    start = time.perf_counter()
    if not stream:
        with _post(base_url, body, timeout, CHAT_PATH) as resp:
            payload = json.load(resp)
        return _parse_completion(payload, time.perf_counter() - start, chat=True, prompt_tokens=0)
    return _read_stream(base_url, body, timeout, CHAT_PATH, 0, chat=True)
