"""A throwaway HTTP server on 127.0.0.1 for client tests that need no vLLM (stand-in handlers, one
with vLLM's sleep-mode endpoints), and stand-in server processes for the tests of starting and
stopping one."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prompts import common_prefix


@contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free local port in a daemon thread; yields the base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def send_json(handler: BaseHTTPRequestHandler, payload: dict, status: int = 200) -> None:
    """Answer ``handler``'s request with ``payload`` as a JSON body."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def send_completion(handler: BaseHTTPRequestHandler, answer: list[int], usage: dict) -> None:
    """Answer a non-streamed completion with the token ids ``answer`` and ``usage``."""
    send_json(handler, {"choices": [{"text": "x", "token_ids": answer, "finish_reason": "length"}], "usage": usage})


def send_event_stream(handler: BaseHTTPRequestHandler, chunks: list[dict]) -> None:
    """Answer a streamed request with ``chunks`` as server-sent events, then ``[DONE]``."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    for chunk in chunks:
        handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
    handler.wfile.write(b"data: [DONE]\n\n")


def cached_prefix(history: list[list[int]], prompt: list[int]) -> int:
    """The longest prefix ``prompt`` shares with a prompt of ``history``: what a prefix cache reports."""
    return max((common_prefix(old, prompt) for old in history), default=0)


class QuietHandler(BaseHTTPRequestHandler):
    """A stand-in server's base: ``GET /health`` answers 200, anything else 404; no request log."""

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()


class CompletionsStub(QuietHandler):
    """A stand-in OpenAI completions server: answer ids are a function of the prompt, cached_tokens
    is the longest prefix shared with an earlier prompt under the same cache_salt."""

    seen: dict[str, list[list[int]]] = {}
    requests: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        prompt = body["prompt"]
        if not prompt:
            send_json(self, {"error": {"message": "empty prompt"}}, status=400)
            return
        salt = body.get("cache_salt")
        history = type(self).seen.setdefault(salt, [])
        cached = cached_prefix(history, prompt)
        history.append(prompt)
        answer = [(sum(prompt) + i) % 1000 + 4 for i in range(body["max_tokens"])]
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(answer),
            "total_tokens": len(prompt) + len(answer),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if not body.get("stream"):
            send_completion(self, answer, usage)
            return
        chunks = [
            {"choices": [{"text": "x", "token_ids": [tok], "finish_reason": "length" if last else None}], "usage": None}
            for tok, last in zip(answer, [False] * (len(answer) - 1) + [True])
        ]
        if body.get("stream_options", {}).get("include_usage"):
            chunks.append({"choices": [], "usage": usage})
        send_event_stream(self, chunks)


# What vLLM 0.32's GPU worker logs after a sleep (v1/worker/gpu_worker.py, Worker.sleep).
SLEEP_LOG_LINE = ("(EngineCore pid=7) INFO [gpu_worker.py:326] Sleep mode freed 12.5 GiB memory, 3.25 GiB memory "
                  "is still in use.")  # fmt: skip


def sleepy_stub(name: str, events: list[tuple], asleep: dict[str, bool], sleep_mode: bool = True,
                log_path=None, lag: int = 0) -> type:  # fmt: skip
    """A ``CompletionsStub`` named ``name`` with vLLM's sleep-mode endpoints (``POST /sleep?level=N``,
    ``POST /wake_up``, ``GET /is_sleeping``; all 404 without ``sleep_mode``), its own prompt history.
    ``asleep[name]`` is its state (it starts awake); ``events`` gets ``(name, "sleep" | "wake", path)``
    per switch and ``(name, "request", cache_salt, awake)`` per completion request, ``awake`` being the
    names of the servers in ``asleep`` awake at that moment. A completion sent while it sleeps
    answers HTTP 503. Each sleep appends vLLM's "Sleep mode freed ..." line to ``log_path``, if given.
    With ``lag`` a switch takes effect only after ``lag`` more ``GET /is_sleeping`` (which answer the
    old state meanwhile), as if the POST returned before the switch finished."""
    asleep[name] = False
    pending: list = [None, 0]  # the state a switch goes to, /is_sleeping answers left until it does

    class SleepyStub(CompletionsStub):
        seen: dict[str, list[list[int]]] = {}
        requests: list[dict] = []

        def _no_sleep_mode(self) -> bool:
            if not sleep_mode:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
            return not sleep_mode

        def do_GET(self):
            if self.path == "/is_sleeping":
                if self._no_sleep_mode():
                    return
                if pending[0] is not None:
                    pending[1] -= 1
                    if pending[1] < 0:
                        asleep[name], pending[0] = pending[0], None
                send_json(self, {"is_sleeping": asleep[name]})
                return
            super().do_GET()

        def do_POST(self):
            path = self.path.split("?")[0]
            if path in ("/sleep", "/wake_up"):
                if self._no_sleep_mode():
                    return
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                to_sleep = path == "/sleep"
                if lag:
                    pending[:] = [to_sleep, lag]
                else:
                    asleep[name] = to_sleep
                if to_sleep and log_path is not None:
                    with open(log_path, "a") as log:
                        log.write(f"{SLEEP_LOG_LINE}\n")
                events.append((name, "sleep" if to_sleep else "wake", self.path))
                send_json(self, {"status": "sleeping" if to_sleep else "awake"})
                return
            if asleep[name]:
                send_json(self, {"error": {"message": f"{name} is asleep"}}, status=503)
                return
            length = int(self.headers["Content-Length"])
            body = self.rfile.read(length)
            awake = sorted(n for n, state in asleep.items() if not state)
            events.append((name, "request", json.loads(body).get("cache_salt"), awake))
            stream, self.rfile = self.rfile, io.BytesIO(body)  # CompletionsStub reads the body again
            try:
                super().do_POST()
            finally:
                self.rfile = stream

    SleepyStub.__name__ = f"SleepyStub_{name}"
    return SleepyStub


def stand_in_server(log_path, code: str):
    """A ``bench.server.ServerProcess`` running ``python -c code`` in its own session, as
    ``start_server`` runs vLLM, with its output in ``log_path``; it never answers ``/health``."""
    from bc_tools.bench import server

    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return server.ServerProcess(process=proc, host="127.0.0.1", port=server.find_free_port(),
                                log_path=log_path, command=[])  # fmt: skip
