"""One benchmark request as a record, and what every request of a run shares.

Contract: ``send`` (token ids through ``/v1/completions``) and ``send_chat`` (messages through
``/v1/chat/completions`` with ``CHAT_OPTIONS``, greedy) stream one request to a :class:`Target` and
return it as a :class:`RequestRecord` timed on the run's :class:`Clock`; a failed request (one of
``REQUEST_ERRORS``) is a record with ``error`` set, never an exception. :class:`Progress` shows
every timed request of a run, on a tqdm bar or one line each.
"""

from __future__ import annotations

import http.client
import sys
import threading
import time
from dataclasses import dataclass

from bc_tools.bench.client import Completion, CompletionError, chat, stream_complete
from bc_tools.bench.stats import RequestRecord

REQUEST_ERRORS = (CompletionError, OSError, ValueError, http.client.HTTPException)
CHAT_OPTIONS = {"ignore_eos": True, "skip_special_tokens": False}  # vLLM's extra chat parameters


class Progress:
    """One tqdm bar over every timed request (vLLM depends on tqdm); a line per request without it."""

    def __init__(self, total: int, desc: str = "bc-bench"):
        self._lock = threading.Lock()
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self._bar = None
            self._n, self._total = 0, total

    def update(self, postfix: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
                self._bar.update(1)
            else:
                self._n += 1
                print(f"  {self._n}/{self._total} {postfix}", file=sys.stderr)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class Target:
    """Where one label's requests go, and the server log to read its plugin stats from."""

    label: str
    base_url: str
    model: str
    log_path: str | None = None


class Clock:
    """Seconds since the run started, shared by every record."""

    def __init__(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0


def send(target: Target, prompt: list[int], *, max_tokens: int, salt: str, clock: Clock, timeout: float,
         **fields) -> RequestRecord:  # fmt: skip
    """One streamed request as a :class:`RequestRecord` (``fields``: phase, conversation, turn,
    boundary, in_flight, round); a failed request is a record with ``error`` set."""
    start = clock.now()
    try:
        res = stream_complete(target.base_url, prompt, model=target.model, max_tokens=max_tokens,
                              cache_salt=salt, timeout=timeout)  # fmt: skip
        error = None
    except REQUEST_ERRORS as err:
        res, error = None, f"{type(err).__name__}: {err}"[:2000]
    return _record(target, res, error, start, clock.now(), len(prompt), fields)


def send_chat(target: Target, messages: list[dict], *, max_tokens: int, salt: str, clock: Clock, timeout: float,
              **fields) -> tuple[RequestRecord, Completion | None]:  # fmt: skip
    """One streamed chat request (``CHAT_OPTIONS``, greedy) as a :class:`RequestRecord` like
    ``send``'s, with the completion (None if the request failed: the record's ``error`` says why)."""
    start = clock.now()
    try:
        res = chat(target.base_url, messages, stream=True, model=target.model, max_tokens=max_tokens,
                   cache_salt=salt, timeout=timeout, **CHAT_OPTIONS)  # fmt: skip
        error = None
    except REQUEST_ERRORS as err:
        res, error = None, f"{type(err).__name__}: {err}"[:2000]
    return _record(target, res, error, start, clock.now(), 0, fields), res


def _record(target: Target, res: Completion | None, error: str | None, start: float, end: float,
            prompt_len: int, fields: dict) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        policy=target.label, prompt_tokens=res.prompt_tokens if res else prompt_len,
        cached_tokens=res.cached_tokens if res else None, completion_tokens=res.completion_tokens if res else 0,
        ttft_s=res.ttft_s if res else None, latency_s=res.latency_s if res else end - start,
        start_s=start, end_s=end, finish_reason=res.finish_reason if res else None,
        answer_ids=res.token_ids if res else [], error=error, **fields,
    )  # fmt: skip
