"""Fast tests of the bench HTTP side against stand-ins, no vLLM engine: the completions client
(``bench.client``) and the demo conversation and its table (``bench.demo_conversation``,
``bench.demo_table``) against the ``http_stub`` completions stub, and the server launcher
(``bench.server``: command line, health wait, group stop) against stand-in server processes."""

from __future__ import annotations

import json
import os
import time

import pytest
from http_stub import CompletionsStub, serve, stand_in_server

from bc_tools.bench import client, demo_conversation, demo_table, server


@pytest.fixture()
def stub_url():
    CompletionsStub.seen = {}
    CompletionsStub.requests = []
    with serve(CompletionsStub) as url:
        yield url


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
    plan = demo_conversation.make_plan(turns=4, system_tokens=30, user_tokens=10, followup_tokens=6, seed=0)
    assert [len(t) for t in plan.turn_inputs] == [40, 6, 6, 6]
    assert plan.turn_inputs == demo_conversation.make_plan(4, 30, 10, 6, seed=0).turn_inputs
    results = demo_conversation.run_conversation(stub_url, plan, max_tokens=4, cache_salt="conv")
    assert [r.prompt_tokens for r in results] == [40, 50, 60, 70]
    assert [r.boundary for r in results] == [0, 43, 53, 63]
    # Each prompt extends the previous prompt by its answer ids.
    sent = [r["prompt"] for r in CompletionsStub.requests if r.get("cache_salt") == "conv"]
    for prev, nxt, res in zip(sent, sent[1:], results):
        assert nxt[: len(prev) + 4] == prev + res.answer_ids
    # The stub caches whole earlier prompts, so each turn hits the previous prompt.
    assert [r.cached_tokens for r in results] == [0, 40, 50, 60]
    assert all(r.ttft_s is not None for r in results)
    # Every turn is checked against a cold control under its own fresh salt.
    colds = [r for r in CompletionsStub.requests if r.get("cache_salt", "").startswith("conv-cold-")]
    assert [r["prompt"] for r in colds] == sent
    assert all(r.vs_cold == "identical" for r in results)


def test_table_shows_what_the_cold_comparison_measured():
    row = dict(prompt_tokens=10, boundary=0, cached_tokens=0, ttft_s=0.1, latency_s=0.2, answer_ids=[1, 2])
    results = {
        "request_boundaries": [
            demo_conversation.TurnResult(
                turn=1, vs_cold="tie", first_token_delta=0.0021, parts_at=7, cold_gap=0.0312, **row
            )
        ],  # fmt: skip
        "aligned": [demo_conversation.TurnResult(turn=1, vs_cold="identical", first_token_delta=0.0, **row)],
    }
    table = demo_table.format_table(["request_boundaries", "aligned"], results)
    header, _, line = table.splitlines()
    assert "cached plugin" in header and "TTFT ms stock" in header
    assert "dlp1 plugin" in header and "answer vs cold stock" in header
    assert line.split()[-7:] == ["0.0021", "0.0000", "parts@7", "(near-tie,", "gap", "0.031)", "same"]
    assert "DIFF" not in table
    # The legend decodes the cells the table prints.
    assert "'same'" in demo_table.LEGEND and "'parts@I (near-tie, gap G)'" in demo_table.LEGEND
    assert "'parts@I (gap G, not a near-tie)'" in demo_table.LEGEND and "'gap n/a'" in demo_table.LEGEND


def _turn(turn, boundary, cached, delta=0.0, parts_at=None, cold_gap=None):
    return demo_conversation.TurnResult(turn=turn, prompt_tokens=boundary + 61, boundary=boundary, cached_tokens=cached,
                           ttft_s=0.1, latency_s=0.2, answer_ids=[1], first_token_delta=delta, parts_at=parts_at,
                           cold_gap=cold_gap)  # fmt: skip


def test_parts_cell_says_whether_it_is_a_near_tie():
    assert demo_table._fmt_parts(_turn(1, 0, 0)) == "same"
    assert demo_table._fmt_parts(_turn(1, 0, 0, parts_at=3, cold_gap=0.0)) == "parts@3 (near-tie, gap 0.000)"
    assert demo_table._fmt_parts(_turn(1, 0, 0, parts_at=3, cold_gap=0.8123)) == "parts@3 (gap 0.812, not a near-tie)"
    assert demo_table._fmt_parts(_turn(1, 0, 0, parts_at=5)) == "parts@5 (gap n/a)"


def test_verdict_when_every_turn_restores_within_noise():
    results = [_turn(1, 0, 0, 0.0), _turn(2, 431, 431, 0.012, parts_at=3, cold_gap=0.0),
               _turn(3, 523, 523, 0.031), _turn(4, 615, 615, 0.0)]  # fmt: skip
    line = demo_table.verdict("plugin", results)
    assert line == ("verdict (plugin): every later turn (2-4) restored at its boundary; first-token deltas within "
                    "bf16 noise (largest 0.0310, turn 3; bound 0.1); answers part from the cold control only at "
                    "near-ties")  # fmt: skip


def test_verdict_names_the_turns_that_missed_and_the_largest_delta():
    results = [_turn(1, 0, 0, 0.0), _turn(2, 431, 431, 0.01), _turn(3, 523, 256, 0.74),
               _turn(4, 615, 512, 0.02, parts_at=0, cold_gap=0.9), _turn(5, 707, 707, 0.0)]  # fmt: skip
    line = demo_table.verdict("plugin", results)
    assert line.startswith(
        "verdict (plugin): turns 3-4 did not restore at their boundary (cached/boundary "
        "256/523, 512/615); largest first-token delta 0.7400 (turn 3) is above bf16 noise"
    )
    assert "off a near-tie: turn 4 at token 0 (gap 0.900)" in line
    assert line != demo_table.verdict("plugin", [_turn(1, 0, 0), _turn(2, 431, 431)])
    one = demo_table.verdict("plugin", [_turn(1, 0, 0, None), _turn(2, 431, None, None)])
    assert "turn 2 did not restore at its boundary (cached/boundary -/431)" in one
    assert "no first-token logprobs" in one


def test_verdict_for_stock_counts_boundary_restores():
    results = [_turn(1, 0, 0), _turn(2, 431, 0), _turn(3, 523, 256)]
    assert demo_table.verdict("stock", results, expects_boundary=False).startswith(
        "verdict (stock): 0 of 2 later turns restored at their boundary (stock resumes on its block grid); "
        "first-token deltas within bf16 noise"
    )
    assert "a single turn" in demo_table.verdict("plugin", results[:1])


METRICS = """# HELP vllm:boundary_checkpoint_hits_total Lookups that restored a boundary checkpoint.
# TYPE vllm:boundary_checkpoint_hits_total counter
vllm:boundary_checkpoint_hits_total{engine="0",kind="prompt",model_name="tiny"} 0.0
vllm:boundary_checkpoint_hits_total{engine="0",kind="response",model_name="tiny"} 7.0
vllm:boundary_checkpoint_hits_created{engine="0",kind="response",model_name="tiny"} 1.7e+09
vllm:boundary_checkpoint_misses_total{engine="0",model_name="tiny",reason="no_checkpoint"} 10.0
vllm:boundary_checkpoint_misses_total{engine="0",model_name="tiny",reason="diverged"} 0.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 4000.0
"""


def test_server_counters_agree_with_the_table_and_the_lagging_log_line_is_labelled():
    counters = demo_conversation.parse_checkpoint_counters(METRICS)
    assert counters == {"hits": {"prompt": 0.0, "response": 7.0}, "misses": {"no_checkpoint": 10.0, "diverged": 0.0}}
    assert demo_conversation.parse_checkpoint_counters('vllm:prefix_cache_hits_total{engine="0"} 3.0\n') is None
    results = [_turn(1, 0, 0)] + [_turn(t, 300 + 92 * t, 300 + 92 * t) for t in range(2, 9)]
    line = demo_table.counter_line("plugin", results, counters, {"hits": 5, "misses": 8})
    first, second = line.splitlines()
    assert "hits=7 (response 7), the 7 turns the table shows restored at their boundary" in first
    assert "misses=10 (turn 1, the warm-up and the 8 cold controls" in first
    assert "hits=5" in second and "stats_log_interval_s = 30 s" in second and "only while the engine steps" in second
    assert "\n" not in demo_table.counter_line("plugin", results, counters, {"hits": 7})
    short = demo_table.counter_line("plugin", results[:3] + [_turn(4, 615, 256)], counters)
    assert "hits=7 (response 7) requests restored a checkpoint" in short and "the table shows 2 turns" in short
    assert "not available" in demo_table.counter_line("plugin", results, None)


def test_warmup_request_has_turn_one_shape_and_other_ids():
    plan = demo_conversation.make_plan(turns=3, system_tokens=30, user_tokens=10, followup_tokens=6, seed=0)
    warm = demo_conversation.warmup_input(plan)
    assert len(warm) == len(plan.turn_inputs[0]) and warm != plan.turn_inputs[0]
    assert all(demo_conversation.FIRST_WORD_ID <= t < demo_conversation.VOCAB_SIZE for t in warm)
    chat_plan = demo_conversation.make_chat_plan(turns=2, system_tokens=5, user_tokens=3, followup_tokens=2, seed=0)
    chat_warm = demo_conversation.warmup_input(chat_plan)
    assert [m["role"] for m in chat_warm] == ["system", "user"]
    assert [len(m["content"].split()) for m in chat_warm] == [5, 3]
    assert chat_warm != chat_plan.turn_messages[0]


def test_warm_up_sends_one_streamed_request_under_its_own_salt(stub_url):
    plan = demo_conversation.make_plan(turns=2, system_tokens=30, user_tokens=10, followup_tokens=6, seed=0)
    out = demo_conversation.warm_up(stub_url, plan, max_tokens=4)
    [sent] = CompletionsStub.requests
    assert sent["stream"] and sent["cache_salt"].startswith("bc-demo-warmup-") and len(sent["prompt"]) == 40
    assert sent["max_tokens"] == 4 and out.ttft_s is not None


# ------------------------------------------------------------------------------------------------
# server launcher


def test_build_command_uses_module_form_and_policy():
    cmd = server.build_command("/m", 1234, additional_config=server.policy_config("aligned"))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "1234"
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"boundary_checkpoints": {"policy": "aligned"}}
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in cmd


def test_find_free_port_is_bindable():
    import socket

    port = server.find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_start_failure_reports_log_tail(tmp_path):
    fake = stand_in_server(tmp_path / "fake.log", "print('model config is broken'); raise SystemExit(3)")
    with pytest.raises(server.ServerStartError, match="model config is broken") as info:
        server.wait_until_healthy(fake, timeout=30, poll_interval=0.05)
    assert "exited with code 3" in str(info.value)


def test_start_timeout(tmp_path):
    fake = stand_in_server(tmp_path / "fake.log", "import time; print('still loading', flush=True); time.sleep(60)")
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
    fake = stand_in_server(tmp_path / "fake.log", code)
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
