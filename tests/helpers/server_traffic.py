"""What the server traffic tests (``e2e/test_server_traffic.py``) share: calling the dev-mode routes
of a server started with ``VLLM_SERVER_DEV_MODE=1`` (``call``, ``send_together``), reading the
plugin's counters and reset lines from its log (``last_stats``, ``wait_for_counter``,
``resets_logged``), and streaming requests that a reset, pause or sleep can abort
(``StreamingRequest``, ``start_long_requests``, ``abort_running``, ``is_aborted`` / ``is_whole``).
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from prompts import word_ids
from servers import new_salt

from bc_tools.bench.client import build_request, complete, iter_sse_events
from bc_tools.bench.server import is_healthy

STATS_RE = re.compile(r"boundary_checkpoints: (hits=\d+.*)$")
RESET_RE = re.compile(r"prefix cache reset dropped (\d+) checkpoints and (\d+) pending captures")


def sorted_choices(payload: dict) -> list[dict]:
    return sorted(payload["choices"], key=lambda c: c["index"])


def call(base_url: str, method: str, path: str, timeout: float = 300.0) -> tuple[int, str]:
    """(HTTP status, body text) of a bodyless call to a dev endpoint."""
    request = urllib.request.Request(f"{base_url}{path}", data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", errors="replace")


def log_text(server) -> str:
    return server.log_path.read_text(errors="replace")


def log_lines_about(server, request_id: str | None) -> list[str]:
    """The server log's lines that name ``request_id`` (vLLM logs it with suffixes), and the pause
    and abort lines, in order: what a failed abort check needs to tell a late pause from a lost
    abort."""
    if not request_id:
        return ["(no request id: the stream sent no event)"]
    return [line for line in log_text(server).splitlines()
            if request_id in line or "pause" in line.lower() or "abort" in line.lower()][-40:]  # fmt: skip


def last_stats(server) -> dict[str, int]:
    """The plugin's latest counters line in the server log, as a dict ({} if none yet)."""
    lines = [m.group(1) for m in map(STATS_RE.search, log_text(server).splitlines()) if m]
    if not lines:
        return {}
    return {k: int(v) for k, v in (item.split("=") for item in lines[-1].split(", "))}


def wait_for_counter(server, name: str, minimum: int, rng: random.Random) -> dict[str, int]:
    """The latest counters once ``name`` >= ``minimum`` (short requests keep the scheduler busy, so
    the line is logged), or after 60 s; the caller asserts."""
    deadline = time.monotonic() + 60
    while last_stats(server).get(name, 0) < minimum and time.monotonic() < deadline:
        complete(server.base_url, word_ids(rng, 20), cache_salt=new_salt(), max_tokens=2)
        time.sleep(0.5)
    return last_stats(server)


def resets_logged(server) -> list[tuple[int, int]]:
    """(checkpoints, pending captures) dropped by every plugin reset so far."""
    return [(int(a), int(b)) for a, b in RESET_RE.findall(log_text(server))]


def send_together(server, requests: list[dict]) -> list:
    """Send ``requests`` (``complete`` keyword arguments) so that the scheduler looks them all up in
    one step: the engine is paused (``mode=keep`` keeps every cache) until the frontend has logged
    each as added, then resumed. Sent merely from threads, a loaded machine can finish the first
    before the second reaches the engine -- and a finished edit of a turn retires that turn
    (lineage), so the late one would rightly miss."""
    added = log_text(server).count("Added request")
    status, body = call(server.base_url, "POST", "/pause?mode=keep&clear_cache=false")
    assert status == 200, body
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(complete, server.base_url, **kwargs) for kwargs in requests]
            deadline = time.monotonic() + 60
            while log_text(server).count("Added request") < added + len(requests):
                assert time.monotonic() < deadline, "the paused engine never received every request"
                time.sleep(0.05)
            status, body = call(server.base_url, "POST", "/resume")
            assert status == 200, body
            return [future.result() for future in futures]
    finally:
        call(server.base_url, "POST", "/resume")


class StreamingRequest(threading.Thread):
    """A streaming completion in a thread: ``started`` is set at the first token; ``token_ids``,
    ``finish_reason`` and ``error`` once it ended; ``request_id`` is the server's id of it (the
    events' ``id``, which the server log's request lines carry)."""

    def __init__(self, base_url: str, prompt: list[int], **kwargs):
        super().__init__(daemon=True)
        self.body = build_request(prompt, stream=True, **kwargs)
        self.url = f"{base_url}/v1/completions"
        self.started = threading.Event()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.request_id: str | None = None

    def run(self) -> None:
        request = urllib.request.Request(
            self.url, data=json.dumps(self.body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                for event in iter_sse_events(resp):
                    if "error" in event and "choices" not in event:
                        self.error = str(event["error"])
                    self.request_id = self.request_id or event.get("id")
                    for choice in event.get("choices") or []:
                        self.token_ids.extend(choice.get("token_ids") or [])
                        if self.token_ids:
                            self.started.set()
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
            self.error = repr(err)
        finally:
            self.started.set()


# Requests an abort must catch: on an idle machine 200 tokens take about a second; these would take
# minutes. The engine decodes on while a busy frontend (or client) falls behind with the streams it
# serves, so a control call can reach the engine late: on a CI machine all three 3000-token requests
# of the pause test once finished first, and a loaded machine delivers 200-token answers in one
# burst. So the long requests stream in chunks (start_long_requests), the abort tests retry with
# fresh requests (abort_running), and the reset test ends its long requests itself (a pause that
# aborts them).
ABORTED_MAX_TOKENS = 40_000
LONG_STREAM_INTERVAL = 50
ATTEMPTS = 3  # tries at catching requests still decoding, each with fresh requests


def start_long_requests(
    base_url: str, rng: random.Random, max_tokens: int = 200, count: int = 3
) -> list[StreamingRequest]:
    """``count`` long requests (``max_tokens``, ignore_eos), each generating before this returns.
    They stream the first token at once and then every ``LONG_STREAM_INTERVAL`` tokens (the
    request's ``stream_interval``), which keeps the frontend's work per engine step small, so that
    control calls are not held up behind the streams."""
    requests = [StreamingRequest(base_url, word_ids(rng, 300), max_tokens=max_tokens, cache_salt=new_salt(),
                                 stream_interval=LONG_STREAM_INTERVAL)
                for _ in range(count)]  # fmt: skip
    for r in requests:
        r.start()
    for r in requests:
        r.started.wait()  # its first token, or its end (the request's own socket timeout bounds it)
        assert r.token_ids, f"a long request ended before its first token: {r.error}"
    return requests


def is_aborted(r: StreamingRequest) -> bool:
    return len(r.token_ids) < ABORTED_MAX_TOKENS and (r.finish_reason == "abort" or r.error is not None)


def is_whole(r: StreamingRequest) -> bool:
    return (len(r.token_ids), r.finish_reason, r.error) == (ABORTED_MAX_TOKENS, "length", None)


def abort_running(server, rng: random.Random, abort: Callable[[], None]) -> tuple[list[StreamingRequest], int]:
    """Start three ``ABORTED_MAX_TOKENS`` requests, then ``abort()`` (a call that aborts every
    running request and leaves the engine serving again); repeated with fresh requests, at most
    ``ATTEMPTS`` times, until the call caught at least one still decoding. Every request must end
    either aborted (fewer tokens; finish reason "abort" or an error event) or whole (all tokens,
    "length": it finished before the call reached the engine). Returns the aborted requests and
    the number of attempts made (each ``abort()`` ran once per attempt)."""
    seen = []
    for attempt in range(1, ATTEMPTS + 1):
        requests = start_long_requests(server.base_url, rng, max_tokens=ABORTED_MAX_TOKENS)
        tokens_at_call = [len(r.token_ids) for r in requests]
        abort()
        join_all(requests)
        for r in requests:
            assert is_aborted(r) or is_whole(r), (
                len(r.token_ids), r.finish_reason, r.error, log_lines_about(server, r.request_id),
            )  # fmt: skip
        caught = [r for r in requests if is_aborted(r)]
        if caught:
            return caught, attempt
        seen.append(tokens_at_call)
    pytest.fail(f"in {ATTEMPTS} attempts the abort never found a request still decoding; tokens each "
                f"had received when the call was sent: {seen}")  # fmt: skip


def join_all(requests: list[StreamingRequest]) -> None:
    for r in requests:
        r.join(300)
        assert not r.is_alive()


def retained_prompt(base_url: str, rng: random.Random) -> tuple[list[int], str]:
    """A prompt whose P - 1 checkpoint is retained right now (its resend hit it)."""
    prompt, salt = word_ids(rng, 300), new_salt()
    assert complete(base_url, prompt, cache_salt=salt, max_tokens=2).cached_tokens == 0
    assert complete(base_url, prompt, cache_salt=salt, max_tokens=2).cached_tokens == len(prompt) - 1
    return prompt, salt


def check_cache_emptied_then_working(base_url: str, rng: random.Random, old: tuple[list[int], str]) -> None:
    """The checkpoint retained before the reset is gone; a fresh prompt, then its resend, hits P - 1."""
    assert is_healthy(base_url)
    old_prompt, old_salt = old
    assert complete(base_url, old_prompt, cache_salt=old_salt, max_tokens=2).cached_tokens == 0
    retained_prompt(base_url, rng)


def pick_stop(early: list[int], other: list[int], lowest: int = 2) -> int | None:
    """The first index i >= lowest whose token first occurs at i in ``early`` and never in ``other``."""
    for i in range(lowest, len(early)):
        if early[i] not in early[:i] and early[i] not in other:
            return i
    return None
