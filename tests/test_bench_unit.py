"""Fast tests of the bench helpers (launcher, client, demo) against stand-ins, no vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from boundary_checkpoints.bench import client, demo, server

# ------------------------------------------------------------------------------------------------
# A stand-in OpenAI completions server: answer ids are a function of the prompt, cached_tokens is
# the longest prefix shared with an earlier prompt under the same cache_salt.


class _StubHandler(BaseHTTPRequestHandler):
    seen: dict[str, list[list[int]]] = {}
    requests: list[dict] = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        prompt = body["prompt"]
        if not prompt:
            data = b'{"error": {"message": "empty prompt"}}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        salt = body.get("cache_salt")
        history = type(self).seen.setdefault(salt, [])
        cached = 0
        for old in history:
            n = 0
            while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                n += 1
            cached = max(cached, n)
        history.append(prompt)
        answer = [(sum(prompt) + i) % 1000 + 4 for i in range(body["max_tokens"])]
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(answer),
            "total_tokens": len(prompt) + len(answer),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if not body.get("stream"):
            payload = {"choices": [{"text": "x", "token_ids": answer, "finish_reason": "length"}],
                       "usage": usage}  # fmt: skip
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, tok in enumerate(answer):
            last = i == len(answer) - 1
            chunk = {"choices": [{"text": "x", "token_ids": [tok],
                                  "finish_reason": "length" if last else None}], "usage": None}  # fmt: skip
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def stub_url():
    _StubHandler.seen = {}
    _StubHandler.requests = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


# ------------------------------------------------------------------------------------------------
# client


def test_request_body_has_token_prompt_and_flags():
    body = client.build_request([5, 6], max_tokens=3, cache_salt="s", stream=True)
    assert body["prompt"] == [5, 6]
    assert body["temperature"] == 0.0 and body["ignore_eos"] and body["return_token_ids"]
    assert body["cache_salt"] == "s"
    assert body["stream_options"] == {"include_usage": True}
    assert "cache_salt" not in client.build_request([1])


def test_complete_and_stream_agree(stub_url):
    prompt = list(range(10, 60))
    first = client.complete(stub_url, prompt, max_tokens=5, cache_salt="a")
    streamed = client.stream_complete(stub_url, prompt, max_tokens=5, cache_salt="a")
    assert len(first.token_ids) == 5
    assert streamed.token_ids == first.token_ids
    assert first.cached_tokens == 0 and streamed.cached_tokens == 50
    assert streamed.ttft_s is not None and streamed.ttft_s <= streamed.latency_s
    assert streamed.finish_reason == "length"


def test_http_error_is_reported(stub_url):
    with pytest.raises(client.CompletionError, match="HTTP 400.*empty prompt"):
        client.complete(stub_url, [])


# ------------------------------------------------------------------------------------------------
# demo


def test_conversation_boundaries_follow_previous_turn(stub_url):
    plan = demo.make_plan(turns=4, system_tokens=30, user_tokens=10, followup_tokens=6, seed=0)
    assert [len(t) for t in plan.turn_inputs] == [40, 6, 6, 6]
    assert plan.turn_inputs == demo.make_plan(4, 30, 10, 6, seed=0).turn_inputs
    results = demo.run_conversation(stub_url, plan, max_tokens=4, cache_salt="conv")
    assert [r.prompt_tokens for r in results] == [40, 50, 60, 70]
    assert [r.boundary for r in results] == [0, 43, 53, 63]
    # Each prompt extends the previous prompt by its answer ids.
    sent = [r["prompt"] for r in _StubHandler.requests if r.get("cache_salt") == "conv"]
    for prev, nxt, res in zip(sent, sent[1:], results):
        assert nxt[: len(prev) + 4] == prev + res.answer_ids
    # The stub caches whole earlier prompts, so each turn hits the previous prompt.
    assert [r.cached_tokens for r in results] == [0, 40, 50, 60]
    assert all(r.ttft_s is not None for r in results)
    # Every turn is checked against a cold control under its own fresh salt.
    colds = [r for r in _StubHandler.requests if r.get("cache_salt", "").startswith("conv-cold-")]
    assert [r["prompt"] for r in colds] == sent
    assert all(r.vs_cold == "identical" for r in results)


def test_table_shows_what_the_cold_comparison_measured():
    row = dict(prompt_tokens=10, boundary=0, cached_tokens=0, ttft_s=0.1, latency_s=0.2, answer_ids=[1, 2])
    results = {
        "request_boundaries": [demo.TurnResult(turn=1, vs_cold="tie", first_token_delta=0.0021, parts_at=7,
                                               cold_gap=0.0312, **row)],  # fmt: skip
        "aligned": [demo.TurnResult(turn=1, vs_cold="identical", first_token_delta=0.0, **row)],
    }
    table = demo.format_table(["request_boundaries", "aligned"], results)
    header, _, line = table.splitlines()
    assert "cached plugin" in header and "TTFT ms stock" in header
    assert "dlp1 plugin" in header and "parts stock" in header and "vs cold" not in header
    assert line.split()[-6:] == ["0.0021", "0.0000", "@7", "gap", "0.031", "-"]
    assert "DIFF" not in table


# ------------------------------------------------------------------------------------------------
# server launcher


def test_build_command_uses_module_form_and_policy():
    cmd = server.build_command("/m", 1234, additional_config=server.policy_config("aligned"))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "1234"
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {
        "boundary_checkpoints": {"policy": "aligned"}
    }
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in cmd


def test_find_free_port_is_bindable():
    import socket

    port = server.find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def _fake_server(tmp_path, code: str) -> server.ServerProcess:
    log_path = tmp_path / "fake.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return server.ServerProcess(process=proc, host="127.0.0.1", port=server.find_free_port(),
                                log_path=log_path, command=[])  # fmt: skip


def test_start_failure_reports_log_tail(tmp_path):
    fake = _fake_server(tmp_path, "print('model config is broken'); raise SystemExit(3)")
    with pytest.raises(server.ServerStartError, match="model config is broken") as info:
        server.wait_until_healthy(fake, timeout=30, poll_interval=0.05)
    assert "exited with code 3" in str(info.value)


def test_start_timeout(tmp_path):
    fake = _fake_server(tmp_path, "import time; print('still loading', flush=True); time.sleep(60)")
    ticks = []
    try:
        with pytest.raises(server.ServerStartError, match="not healthy after"):
            server.wait_until_healthy(fake, timeout=0.5, poll_interval=0.05, on_tick=ticks.append)
        assert ticks
    finally:
        server.stop_server(fake, grace=5)


def test_stop_server_kills_the_whole_group(tmp_path):
    # A "server" whose child ignores SIGTERM: the group must still be gone afterwards.
    code = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    fake = _fake_server(tmp_path, code)
    deadline = time.monotonic() + 10
    while not fake.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(fake.log_path.read_text().split()[0])
    start = time.monotonic()
    server.stop_server(fake, grace=1.0)
    assert time.monotonic() - start < 15
    assert fake.process.poll() is not None
    assert not server._group_alive(fake.pid)
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)
    server.stop_server(fake)  # idempotent


def _row(**changes):
    from boundary_checkpoints.bench.probes import ProbeRow

    fields = dict(prompt_len=145, resend_cached=144, resend_same="identical", continuation_len=259, committed=208,
                  continuation_cached=208, continuation_same="identical", cold_cached=0)
    fields.update(changes)
    return ProbeRow(**fields)


def test_probe_failures_accepts_exact_rows_with_a_few_late_near_tie_drifts():
    from boundary_checkpoints.bench.probes import probe_failures

    rows = [_row() for _ in range(18)] + [_row(continuation_same="different"), _row(resend_same="tie")]
    rows.append(_row(resend_first_token_delta=0.47, resend_first_token_same="tie"))  # batch-variant noise
    assert probe_failures(rows) == []


@pytest.mark.parametrize("bad", [
    dict(resend_cached=143),  # a resend that missed P - 1
    dict(continuation_cached=207),  # a continuation short of the committed length
    dict(cold_cached=144),  # a cold control that restored something
    dict(first_token_delta=0.2),  # a continuation's restored state is not the cold one
    dict(first_token_delta=float("inf")),  # top-k sets disjoint
    dict(resend_first_token_same="different"),  # a resend's first token is not the producer's
])
def test_probe_failures_flags_any_inexact_row(bad):
    from boundary_checkpoints.bench.probes import probe_failures

    failures = probe_failures([_row() for _ in range(9)] + [_row(**bad)])
    assert len(failures) == 1


@pytest.mark.parametrize("field", ["resend_same", "continuation_same"])
def test_probe_failures_flags_too_many_diverging_answers(field):
    from boundary_checkpoints.bench.probes import probe_failures

    rows = [_row() for _ in range(8)] + [_row(**{field: "different"}) for _ in range(2)]  # 80% agree
    assert [f for f in probe_failures(rows) if f.startswith(field)]


def test_same_greedy_output_tells_ties_from_differences():
    from boundary_checkpoints.bench.probes import same_greedy_output

    a, b = [1, 2, 3], [1, 2, 4]
    tied = [{1: -1.0}, {2: -1.0}, {3: -2.00, 4: -2.05, 9: -3.0}]
    assert same_greedy_output(a, a, tied, tied)[0] == "identical"
    assert same_greedy_output(a, b, tied, tied)[0] == "tie"
    apart = [{1: -1.0}, {2: -1.0}, {3: -2.0, 4: -2.5}]
    assert same_greedy_output(a, b, apart, tied)[0] == "different"
    missing = [{1: -1.0}, {2: -1.0}, {3: -2.0, 9: -2.01}]  # 4 not among the recorded candidates
    verdict, detail = same_greedy_output(a, b, missing, tied)
    assert verdict == "different" and detail.startswith("token 2:")
