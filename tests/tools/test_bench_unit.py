"""Fast tests of the bench helpers (launcher, client, demo) against stand-ins, no vLLM engine."""

from __future__ import annotations

import json
import math
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


# ---- exactness criteria (bench.probes) --------------------------------------------------------------


def _answer(tokens, rows, cached=0):
    from bc_tools.bench.probes import Answer

    return Answer(cached, list(tokens), [dict(r) for r in rows])


def _probe_row(prompt_len=145, answer_len=3, resend_cached=144, restored_cached=None, noise=0.0, first=None):
    """A row whose runs share tokens; ``noise`` shifts every restored logprob, ``first`` only the first."""
    from bc_tools.bench.probes import ProbeRow

    tokens = list(range(10, 10 + answer_len))
    cold_rows = [{t: -1.0, t + 100: -2.0} for t in tokens]

    def shifted(delta, first_delta):
        out = [{k: v + delta for k, v in row.items()} for row in cold_rows]
        out[0] = {k: v + first_delta for k, v in cold_rows[0].items()}
        return out

    restored_rows = shifted(noise, noise if first is None else first)
    committed = prompt_len + answer_len - 1
    return ProbeRow(
        prompt_len,
        producer=_answer(tokens, cold_rows),
        resend=_answer(tokens, restored_rows, resend_cached),
        restored=_answer(tokens, restored_rows, committed if restored_cached is None else restored_cached),
        cold=_answer(tokens, cold_rows),
        cold_again=_answer(tokens, shifted(noise / 2, noise / 2)),
    )


def test_position_deviation_bounds_missing_tokens_from_below():
    from bc_tools.bench.probes import position_deviation

    assert position_deviation({1: -1.0, 2: -2.0}, {1: -1.25, 2: -2.0}) == 0.25
    # token 3 is missing from the second row: there it is <= -2.0, so it moved by >= 0.5
    assert position_deviation({1: -1.0, 3: -1.5}, {1: -1.0, 2: -2.0}) == 0.5
    assert position_deviation({1: -1.0}, {}) == math.inf


def test_divergence_reports_the_cold_runs_preference():
    from bc_tools.bench.probes import divergence

    cold = _answer([1, 2, 3], [{1: -1.0}, {2: -1.0}, {3: -2.0, 4: -2.3}])
    assert divergence(_answer([1, 2, 3], cold.logprobs), cold) is None
    at, gap = divergence(_answer([1, 2, 4], cold.logprobs), cold)
    assert at == 2 and gap == pytest.approx(0.3)
    at, gap = divergence(_answer([1, 2, 7], cold.logprobs), cold)  # 7 not recorded: gap >= 3 vs 4
    assert at == 2 and gap == pytest.approx(0.3)
    assert divergence(_answer([1, 2], cold.logprobs), cold) == (2, math.inf)  # a shorter answer


def test_calibrate_scales_the_largest_reference_deviation():
    from bc_tools.bench.probes import BF16_STEP, MARGIN, calibrate

    a = _answer([1, 2], [{1: -1.0, 5: -2.0}, {2: -1.0, 5: -3.0}])
    b = _answer([1, 2], [{1: -1.1, 5: -2.0}, {2: -1.0, 5: -3.3}])
    bounds = calibrate([(a, b), (a, a)])
    assert bounds.reference_first_token == pytest.approx(0.1)
    assert bounds.reference_profile == pytest.approx((0.1, 0.3))
    assert bounds.first_token == pytest.approx(MARGIN * 0.1)
    assert bounds.tie == pytest.approx((2 * MARGIN * 0.1, 2 * MARGIN * 0.3))  # noise grows with depth
    assert bounds.tie_at(0) == bounds.tie[0] and bounds.tie_at(9) == bounds.tie[1]
    assert bounds.references == 2
    exact = calibrate([(a, a)])  # bit-identical references: the bf16 floor
    assert exact.first_token == BF16_STEP and exact.tie == (BF16_STEP, BF16_STEP)
    with pytest.raises(ValueError):
        calibrate([])
    floored = calibrate([(a, b)], reference_floor=0.2)  # a kernel path no reference pair takes
    assert floored.reference_profile == pytest.approx((0.2, 0.3))
    assert floored.first_token == pytest.approx(MARGIN * 0.2)
    assert floored.tie == pytest.approx((2 * MARGIN * 0.2, 2 * MARGIN * 0.3))


def single_tie(pairs):
    from bc_tools.bench.probes import calibrate

    return calibrate(pair for length_pairs in pairs.values() for pair in length_pairs).tie


def test_calibrate_by_length_keeps_a_long_prompts_rounding_out_of_a_short_prompts_bound():
    from bc_tools.bench.probes import MARGIN, calibrate, calibrate_by_length, pairs_by_length, probe_failures

    short = _probe_row(prompt_len=145, noise=0.04)  # cold vs second cold control: 0.02 apart
    long = _probe_row(prompt_len=8193, resend_cached=8192, noise=0.4)  # 0.2 apart
    pairs = pairs_by_length([short, long])
    assert pairs == {145: [(short.cold_again, short.cold)], 8193: [(long.cold_again, long.cold)]}
    bounds = calibrate_by_length(pairs)
    assert bounds.at(145).first_token == pytest.approx(MARGIN * 0.02)
    assert bounds.at(8193).first_token == pytest.approx(MARGIN * 0.2)
    # The tie bounds keep every pair's evidence: rounding, not a corruption the first token misses.
    assert bounds.at(145).tie == bounds.at(8193).tie == single_tie(pairs)
    # One bound for both lengths is the long prompt's: it lets a short prompt's 0.1 error through.
    wrong = _probe_row(prompt_len=145, first=0.1)
    single = calibrate(pair for length_pairs in pairs.values() for pair in length_pairs)
    assert single.first_token == pytest.approx(MARGIN * 0.2)
    assert single.at(145) is single  # one Bounds serves every length
    assert [f for f in probe_failures([wrong], single) if "first-token" in f] == []
    assert any("P=145 resend: first-token" in f for f in probe_failures([wrong], bounds))
    # margin, floor and reference_floor as calibrate's, per length
    floored = calibrate_by_length(pairs, margin=1.5, reference_floor=0.1)
    assert floored.at(145).reference_first_token == pytest.approx(0.1)
    assert floored.at(145).first_token == pytest.approx(0.15)
    assert floored.at(8193).first_token == pytest.approx(1.5 * 0.2)
    exact = calibrate_by_length({1: [(short.cold, short.cold)]}, floor=0.01)
    assert exact.at(1).first_token == 0.01 and exact.at(1).tie == (0.01,) * 3
    assert set(bounds.as_dict()["by_length"]) == {"145", "8193"}


def test_calibrate_by_length_has_no_fallback_for_a_length_without_references():
    from bc_tools.bench.probes import calibrate_by_length, decode_path_pairs, pairs_by_length

    rows = [_probe_row(prompt_len=145), _probe_row(prompt_len=257, resend_cached=256)]
    rows[0].cold_decoded = rows[0].cold
    pairs = pairs_by_length(rows, pairs=lambda mine, stock: decode_path_pairs(mine))  # none at 257
    with pytest.raises(ValueError, match="prompt length 257"):
        calibrate_by_length(pairs)
    with pytest.raises(KeyError, match="prompt length 999"):
        calibrate_by_length(pairs_by_length(rows)).at(999)


def test_pairs_by_length_pairs_plugin_and_stock_rows_of_one_length():
    from bc_tools.bench.probes import pairs_by_length, reference_pairs

    plugin = [_probe_row(prompt_len=145), _probe_row(prompt_len=8193, resend_cached=8192)]
    stock = [_probe_row(prompt_len=145, resend_cached=0), _probe_row(prompt_len=8193, resend_cached=7936)]
    pairs = pairs_by_length(plugin, stock)
    assert pairs[145] == reference_pairs(plugin[:1], stock[:1])
    assert pairs[8193] == reference_pairs(plugin[1:], stock[1:])
    assert (stock[1].resend, stock[1].producer) in pairs[8193]  # the long prompt's partial hit stays its own
    assert all(pair[0] is not stock[1].resend for pair in pairs[145])


def test_deviation_profile_stops_after_the_first_difference():
    from bc_tools.bench.probes import deviation_profile

    a = _answer([1, 2, 3], [{1: -1.0}, {2: -1.0, 9: -1.1}, {3: -1.0}])
    b = _answer([1, 9, 8], [{1: -1.0}, {9: -1.05, 2: -1.1}, {8: -9.0}])  # parts at 1; position 2 differs in context
    assert deviation_profile(a, b) == pytest.approx([0.0, 0.1])


def _bounds(first=0.05, tie=0.1):
    from bc_tools.bench.probes import Bounds

    return Bounds(first, (tie,), first / 3, (tie / 6,), 10)


def test_probe_failures_accepts_exact_rows_within_the_bounds():
    from bc_tools.bench.probes import probe_failures

    rows = [_probe_row(noise=0.04), _probe_row(prompt_len=1, resend_cached=0)]
    assert probe_failures(rows, _bounds()) == []


def test_probe_failures_accepts_a_divergence_at_a_near_tie_only():
    from bc_tools.bench.probes import probe_failures, state_failures

    row = _probe_row()
    near = [{10: -1.0, 9: -3.0}, {11: -1.0, 12: -1.05}]  # the cold run prefers 11 over 12 by 0.05
    row.producer = row.cold = _answer([10, 11], near)
    row.resend = _answer([10, 11], near, 144)
    row.restored = _answer([10, 12], [{10: -1.0, 9: -3.0}, {12: -1.0, 11: -1.04}], row.committed)
    assert probe_failures([row], _bounds(tie=0.1)) == []
    assert state_failures("c", row.restored, row.cold, _bounds(tie=0.01))  # 0.05 apart: not a tie


@pytest.mark.parametrize(
    "bad",
    [
        dict(resend_cached=143),  # a resend that missed P - 1
        dict(resend_cached=145),  # more than P - 1: not the boundary
        dict(restored_cached=146),  # a continuation short of the committed length (147)
        dict(restored_cached=148),  # or beyond it
        dict(first=0.2),  # restored first-token logprobs outside the bound
    ],
)
def test_probe_failures_flags_any_inexact_row(bad):
    from bc_tools.bench.probes import probe_failures

    assert probe_failures([_probe_row(**bad)], _bounds())


def test_probe_failures_flags_cold_runs_that_hit_and_diverging_answers():
    from bc_tools.bench.probes import probe_failures

    row = _probe_row()
    row.cold_again.cached = 128
    assert any("second cold control" in f for f in probe_failures([row], _bounds()))
    row = _probe_row()
    row.restored = _answer([10, 99, 12], row.cold.logprobs, row.committed)  # 99: not recorded by cold
    assert any("leaves its cold control at token 1" in f for f in probe_failures([row], _bounds()))


def test_reference_pairs_take_cold_pairs_stock_partial_hits_and_cold_runs_across_engines():
    from bc_tools.bench.probes import reference_pairs

    plugin = [_probe_row()]
    stock = [_probe_row(resend_cached=128, restored_cached=0)]
    pairs = reference_pairs(plugin, stock)
    assert len(pairs) == 4  # two cold pairs, stock resend (cached 128 > 0), cold controls across engines
    assert pairs[2] == (stock[0].resend, stock[0].producer)
    assert pairs[3] == (plugin[0].cold, stock[0].cold)
    stock[0].producer.tokens = [7, 7, 7]  # producers answered differently: continuations differ
    assert len(reference_pairs(plugin, stock)) == 3
    assert len(reference_pairs(plugin)) == 1
    with pytest.raises(ValueError):
        reference_pairs(plugin, [_probe_row(prompt_len=9)])


def test_probe_row_round_trips_through_json():
    from bc_tools.bench.probes import ProbeRow

    row = _probe_row(noise=0.01)
    again = ProbeRow.from_dict(json.loads(json.dumps(row.as_dict())))
    assert again == row and again.committed == 147
    # Without the optional decode-path phase the form is the one recorded before it existed.
    assert set(row.as_dict()) == {"prompt_len", "producer", "resend", "restored", "cold", "cold_again"}
    assert again.cold_decoded is None
    row.cold_decoded = row.cold
    data = json.loads(json.dumps(row.as_dict()))
    assert ProbeRow.from_dict(data) == row
    data["cold_decoded"] = None  # an explicit null reads as "did not run"
    assert ProbeRow.from_dict(data).cold_decoded is None


def test_same_greedy_output_tells_ties_from_differences():
    from bc_tools.bench.probes import same_greedy_output

    a, b = [1, 2, 3], [1, 2, 4]
    tied = [{1: -1.0}, {2: -1.0}, {3: -2.00, 4: -2.05, 9: -3.0}]
    assert same_greedy_output(a, a, tied, tied)[0] == "identical"
    assert same_greedy_output(a, b, tied, tied)[0] == "tie"
    apart = [{1: -1.0}, {2: -1.0}, {3: -2.0, 4: -2.5}]
    assert same_greedy_output(b, a, tied, apart)[0] == "different"
    missing = [{1: -1.0}, {2: -1.0}, {3: -2.0, 9: -2.01}]  # 4 not among the cold run's candidates
    verdict, detail = same_greedy_output(b, a, tied, missing)
    assert verdict == "tie" and detail.startswith("token 2:")  # 4 <= -2.01: within 0.01 of 3


def test_answer_variety_is_the_median_distinct_tokens_of_the_first_labels_answers():
    from bc_tools.bench.runner import answer_variety
    from bc_tools.bench.stats import RequestRecord

    def record(policy, ids, phase="conversation"):
        return RequestRecord(policy=policy, phase=phase, conversation=0, turn=1, prompt_tokens=4, cached_tokens=0,
                             completion_tokens=len(ids), boundary=0, ttft_s=0.1, latency_s=0.2, start_s=0.0,
                             end_s=0.2, answer_ids=ids)  # fmt: skip

    records = [record("aligned", [7] * 8), record("aligned", [7, 8] * 4), record("aligned", list(range(8))),
               record("request_boundaries", list(range(8))),
               record("aligned", list(range(8)), phase="floor")]  # fmt: skip
    assert answer_variety(records, "aligned") == 2.0
    assert answer_variety(records, "request_boundaries") == 8.0
    assert answer_variety([], "aligned") is None


def test_kv_pool_bytes_reads_the_last_allotment():
    from bc_tools.bench.logs import kv_pool_bytes

    log = ("INFO [gpu_worker.py:759] Available KV cache memory: 0.50 GiB\n"
           "(EngineCore pid=2569) INFO [gpu_worker.py:759] Available KV cache memory: 28.04 GiB\n")  # fmt: skip
    assert kv_pool_bytes(log) == int(28.04 * 2**30)
    assert kv_pool_bytes("no such line") is None


def test_continuations_are_judged_against_decode_path_rounding_resends_are_not():
    from bc_tools.bench.probes import calibrate, decode_path_pairs, probe_failures, reference_pairs

    row = _probe_row(noise=0.0, first=0.08)  # every restore 0.08 off its cold control's first token
    row.resend = _answer(row.producer.tokens, row.producer.logprobs, 144)  # an exact resend
    assert decode_path_pairs([row]) == []
    row.cold_decoded = _answer(row.cold.tokens, [{k: v + 0.08 for k, v in r.items()} for r in row.cold.logprobs])
    assert decode_path_pairs([row]) == [(row.cold_decoded, row.cold)]
    bounds = calibrate(reference_pairs([row]))  # cold vs cold only: the bf16 floor
    continuation = calibrate(reference_pairs([row]) + decode_path_pairs([row]))
    assert continuation.first_token > 0.08 > bounds.first_token
    failures = probe_failures([row], bounds)
    assert len(failures) == 1 and "continuation: first-token" in failures[0]
    assert probe_failures([row], bounds, continuation) == []
    row.resend = _answer(
        row.restored.tokens, row.restored.logprobs, 144
    )  # the same shift on a resend fails: its bounds know no decode rounding
    assert [f for f in probe_failures([row], bounds, continuation) if "resend" in f]
