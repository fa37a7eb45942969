"""Fast tests of the chat client and the demo's chat mode and cold-control columns against a
stand-in ``/v1/chat/completions`` server (no vLLM engine)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import pytest
from http_stub import send_json, serve

from bc_tools.bench import client, demo, demo_conversation, demo_table
from bc_tools.bench.client import Completion

EOS = 2


def _render(messages: list[dict]) -> list[str]:
    """The tiny model's template, as words (one token per word)."""
    words = []
    for message in messages:
        words += ["<s>", message["role"], *message["content"].split(), "</s>"]
    return words + ["<s>", "assistant"]


class _ChatStub(BaseHTTPRequestHandler):
    """Renders messages like the tiny template, answers ``max_tokens`` words derived from the
    prompt (the last one EOS when the prompt length is even), and reports as cached the longest
    prefix shared with an earlier prompt + answer under the same salt, minus one."""

    seen: dict[str, list[list[str]]] = {}
    requests: list[dict] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        prompt = _render(body["messages"])
        history = type(self).seen.setdefault(body.get("cache_salt"), [])
        cached = 0
        for old in history:
            n = next((i for i, (a, b) in enumerate(zip(old, prompt)) if a != b), min(len(old), len(prompt)))
            cached = max(cached, min(n, len(old) - 1))
        ids = [100 + (len(prompt) * 7 + i) % 900 for i in range(body["max_tokens"])]
        eos = len(prompt) % 2 == 0
        if eos:
            ids[-1] = EOS
        words = [f"w{t}" for t in ids if t != EOS]
        history.append(prompt + words + (["</s>"] if eos else []))
        prompt_ids = list(range(len(prompt)))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        top = [
            {
                "token": f"token_id:{t}",
                "logprob": -0.5,
                "top_logprobs": [
                    {"token": f"token_id:{t}", "logprob": -0.5},
                    {"token": "token_id:9", "logprob": -0.75},
                ],
            }
            for t in ids
        ]
        finish = "stop" if eos else "length"
        if not body.get("stream"):
            payload = {"prompt_token_ids": prompt_ids, "usage": usage, "choices": [{
                "message": {"role": "assistant", "content": " ".join(words)}, "token_ids": ids,
                "finish_reason": finish, "stop_reason": None, "logprobs": {"content": top}}]}  # fmt: skip
            send_json(self, payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"prompt_token_ids": prompt_ids, "choices": [{"delta": {"role": "assistant", "content": ""}}]}]
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            chunks.append({"choices": [{"delta": {"content": "" if t == EOS else f" w{t}"}, "token_ids": [t],
                                        "logprobs": {"content": [top[i]]},
                                        "finish_reason": finish if last else None}]})  # fmt: skip
        chunks.append({"choices": [], "usage": usage})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def chat_url():
    _ChatStub.seen = {}
    _ChatStub.requests = []
    with serve(_ChatStub) as url:
        yield url


def test_chat_request_body():
    body = client.build_chat_request([{"role": "user", "content": "w9"}], max_tokens=3, cache_salt="s",
                                     logprobs=2, stream=True, logit_bias={"0": -100})  # fmt: skip
    assert body["messages"] == [{"role": "user", "content": "w9"}]
    assert body["temperature"] == 0.0 and body["return_token_ids"] and "ignore_eos" not in body
    assert body["logprobs"] is True and body["top_logprobs"] == 2 and body["return_tokens_as_token_ids"]
    assert body["stream_options"] == {"include_usage": True} and body["logit_bias"] == {"0": -100}
    assert "cache_salt" not in client.build_chat_request([])


def test_text_prompt_body():
    assert client.build_request("w8 w9")["prompt"] == "w8 w9"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_returns_text_ids_usage_and_logprobs(chat_url, stream):
    messages = [{"role": "user", "content": "w10 w11 w12 w13"}]  # 9 words rendered: odd, ends on length
    out = client.chat(chat_url, messages, stream=stream, max_tokens=4, logprobs=2, cache_salt="c")
    assert out.prompt_tokens == 9 and out.prompt_token_ids == list(range(9))
    assert len(out.token_ids) == out.completion_tokens == 4 and out.cached_tokens == 0
    assert out.text.split() == [f"w{t}" for t in out.token_ids]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.top_logprobs[0] == {out.token_ids[0]: -0.5, 9: -0.75}
    assert (out.ttft_s is not None) == stream


def test_demo_chat_conversation_sends_the_answers_back(chat_url):
    plan = demo_conversation.make_chat_plan(turns=4, system_tokens=5, user_tokens=3, followup_tokens=2, seed=0)
    assert [m["role"] for m in plan.turn_messages[0]] == ["system", "user"]
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in plan.turn_messages[1:])
    results = demo_conversation.run_chat_conversation(chat_url, plan, max_tokens=3, cache_salt="conv")
    sent = [r for r in _ChatStub.requests if r.get("cache_salt") == "conv"]
    for prev, nxt in zip(sent, sent[1:]):
        assert nxt["messages"][: len(prev["messages"])] == prev["messages"]
        assert nxt["messages"][len(prev["messages"])]["role"] == "assistant"
        assert nxt["skip_special_tokens"] is False and nxt["stream"]
    # Boundary of turn k + 1 = turn k's prompt + answer ids - 1; the stub hits exactly there.
    for prev, res in zip(results, results[1:]):
        assert res.boundary == prev.prompt_tokens + len(prev.answer_ids) - 1 == res.cached_tokens
    assert {len(r.answer_ids) for r in results} == {3}
    assert all(r.first_token_delta == 0.0 and r.parts_at is None for r in results)
    table = demo_table.format_table(["request_boundaries"], {"request_boundaries": results})
    assert "dlp1 plugin" in table.splitlines()[0]


def _completion(ids, logprobs):
    return Completion(token_ids=ids, text="", prompt_tokens=1, completion_tokens=len(ids), cached_tokens=0,
                      finish_reason="length", latency_s=0.0, top_logprobs=logprobs)  # fmt: skip


def test_compare_with_cold_reports_delta_and_where_answers_part():
    cold_lp = [{5: -0.10, 6: -2.0}, {7: -1.00, 8: -1.02}, {9: -0.3, 4: -1.3}]
    out_lp = [{5: -0.11, 6: -2.05}, {8: -1.00, 7: -1.01}, {9: -0.3, 4: -1.3}]
    measured = demo_conversation.compare_with_cold(_completion([5, 8, 9], out_lp), _completion([5, 7, 9], cold_lp))
    assert measured["first_token_delta"] == pytest.approx(0.05)
    assert measured["parts_at"] == 1 and measured["cold_gap"] == pytest.approx(0.02)
    assert measured["vs_cold"] == "tie"
    same = demo_conversation.compare_with_cold(_completion([5, 7], cold_lp[:2]), _completion([5, 7], cold_lp[:2]))
    assert same == dict(vs_cold="identical", first_token_delta=0.0, parts_at=None, cold_gap=None)
    no_logprobs = demo_conversation.compare_with_cold(_completion([5], []), _completion([6], []))
    assert no_logprobs == dict(vs_cold="different", first_token_delta=None, parts_at=0, cold_gap=None)
    shorter = demo_conversation.compare_with_cold(_completion([5], cold_lp[:1]), _completion([5, 7], cold_lp[:2]))
    assert shorter["parts_at"] == 1 and shorter["cold_gap"] == pytest.approx(0.02)


def test_demo_parses_mode():
    assert demo.parse_args([]).mode == "tokens"
    assert demo.parse_args(["--mode", "chat", "--turns", "3"]).mode == "chat"
    with pytest.raises(SystemExit):
        demo.parse_args(["--mode", "json"])


def test_chat_warm_up_is_one_streamed_chat_request_of_turn_one_shape(chat_url):
    plan = demo_conversation.make_chat_plan(turns=3, system_tokens=5, user_tokens=3, followup_tokens=2, seed=0)
    out = demo_conversation.warm_up(chat_url, plan, max_tokens=3)
    [sent] = _ChatStub.requests
    assert sent["stream"] and sent["cache_salt"].startswith("bc-demo-warmup-") and sent["skip_special_tokens"] is False
    assert [(m["role"], len(m["content"].split())) for m in sent["messages"]] == [("system", 5), ("user", 3)]
    assert sent["messages"] != plan.turn_messages[0] and out.ttft_s is not None
    # The conversation after it restores nothing from the warm-up (its own salt).
    results = demo_conversation.run_chat_conversation(chat_url, plan, max_tokens=3, cache_salt="conv")
    assert results[0].cached_tokens == 0
