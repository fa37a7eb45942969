"""Tests of whole ``bc-bench`` runs (``bc_tools/bench/``: ``runner``, ``slot``, ``traffic``,
``run_settings``, ``server_sets``, ``cli``) against stand-in servers, no vLLM engine: interleaved
rounds and their order, ``--turn-order``, ``--think-time``, ``--time-budget`` (rounds that fit, a
server still starting), a run killed mid-round, the launch modes, the warm-up and the
``--turn1-only`` report.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from http_stub import CompletionsStub, serve, stand_in_server
from multi_turn_bench import BLOCK_LINE, STATS_LINE, small_workload

from bc_tools.bench import cli, run_settings, runner, server_sets, slot, stats, traffic
from bc_tools.bench import workload as wl


def stand_in_argv(a: str, b: str, *options: str, plugin: str = "request_boundaries") -> list[str]:
    """``bc-bench``'s arguments against the stand-in servers at ``a`` (label ``aligned``) and ``b``
    (label ``plugin``): 40-token shared prefixes, 8-token user turns, then ``options``."""
    return ["--url", a, "--url", b, "--label", "aligned", "--label", plugin, "--model", "m", "--vocab-size", "1024",
            "-S", "40", "-U", "8", *options]  # fmt: skip


@pytest.mark.parametrize("plugin", ["request_boundaries", "auto"])
def test_interleaved_rounds_against_stand_in_servers(tmp_path, capsys, plugin):
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "result.json"
    with serve(CompletionsStub) as a, serve(CompletionsStub) as b:
        argv = stand_in_argv(a, b, "-N", "2", "-T", "3", "-A", "4", "-C", "1,2", "--repeat", "3", "--floor",
                             "--block-size", "16", "--out-json", str(out_json), "--plot", str(tmp_path / "plot.png"),
                             plugin=plugin)  # fmt: skip
        assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "## in flight 1" in printed and "## in flight 2" in printed
    assert "TTFT p50 turn 1 (fresh prompt) / stock" in printed and f"targets ({plugin} vs aligned" in printed
    result = json.loads(out_json.read_text())
    assert result["repeat"] == 3 and result["in_flight"] == [1, 2] and result["block_size"] == 16
    assert result["meta"]["argv"][0] == "bc-bench" and result["meta"]["machine"]["nproc"] >= 1
    records = result["records"]
    for level in result["levels"]:
        assert [rd["order"] for rd in level["rounds"]] == [
            ["aligned", plugin],
            [plugin, "aligned"],
            ["aligned", plugin],
        ]
        for rd in level["rounds"]:  # the order is the order the slots really ran in
            rows = [r for r in records if r["in_flight"] == level["in_flight"] and r["round"] == rd["round"]
                    and r["phase"] == "conversation"]  # fmt: skip
            first, second = rd["order"]
            assert max(r["end_s"] for r in rows if r["policy"] == first) <= min(
                r["start_s"] for r in rows if r["policy"] == second
            )
        summary = level["summary"]
        ttft = summary["policies"][plugin]["ttft_turn1_p50_s"]
        assert ttft["n"] == 3 and ttft["p25"] <= ttft["median"] <= ttft["p75"]
        assert summary["policies"]["aligned"]["requests"]["median"] == 6
        assert summary["floor"]["requests"]["median"] == 4
        assert summary["ratios"][plugin]["turn1_ttft_vs_stock"]["n"] == 3
        assert set(summary["targets"]) == set(stats.TARGETS)
        assert summary["same_answers"] == {plugin: "18/18"}
    # every (level, round, label) slot has its own salt, so no round reuses another's cache
    salts = {body["cache_salt"] for body in CompletionsStub.requests if "warmup" not in body["cache_salt"]}
    conv_salts = {s for s in salts if not s.endswith("-floor")}
    assert len(conv_salts) == 2 * 3 * 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "plot.png").exists()
    else:
        assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("turn_order", ["each", "rounds"])
def test_turn_order_rounds_sends_every_first_turn_before_any_second(tmp_path, turn_order):
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "result.json"
    with serve(CompletionsStub) as a:
        argv = ["--url", a, "--label", "aligned", "--model", "m", "--vocab-size", "1024", "-N", "4", "-T", "3",
                "-S", "40", "-U", "8", "-A", "4", "-C", "1", "--repeat", "1", "--no-floor", "--turn-order", turn_order,
                "--out-json", str(out_json)]  # fmt: skip
        assert cli.main(argv) == 0
    rows = sorted((r for r in json.loads(out_json.read_text())["records"] if r["phase"] == "conversation"),
                  key=lambda r: r["start_s"])  # fmt: skip
    turns = [r["turn"] for r in rows]
    if turn_order == "rounds":
        assert turns == [1] * 4 + [2] * 4 + [3] * 4
    else:  # one conversation at a time at 1 in flight: its turns back to back
        assert turns == [1, 2, 3] * 4
    # Either way every turn k >= 2 extends its own conversation's previous prompt and answer.
    assert all(r["boundary"] > 0 for r in rows if r["turn"] > 1)


def test_think_time_pauses_each_next_turn_by_the_same_seeded_draw_for_every_label(tmp_path):
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "result.json"
    with serve(CompletionsStub) as a, serve(CompletionsStub) as b:
        argv = ["--url", a, "--label", "aligned", "--url", b, "--label", "plugin", "--model", "m", "--vocab-size",
                "1024", "-N", "2", "-T", "3", "-S", "40", "-U", "8", "-A", "4", "-C", "2", "--repeat", "1",
                "--no-floor", "--think-time", "0.2", "--out-json", str(out_json)]  # fmt: skip
        assert cli.main(argv) == 0
    result = json.loads(out_json.read_text())
    fields = {f.name for f in dataclasses.fields(wl.Workload)}
    workload = wl.Workload(**{k: v for k, v in result["workload"].items() if k in fields})
    assert workload.think_time_s == 0.2
    rows = [r for r in result["records"] if r["phase"] == "conversation"]
    for label in ("aligned", "plugin"):
        for conversation in (0, 1):
            turns = sorted((r for r in rows if r["policy"] == label and r["conversation"] == conversation),
                           key=lambda r: r["turn"])  # fmt: skip
            assert [r["turn"] for r in turns] == [1, 2, 3]
            for before, after in zip(turns, turns[1:]):
                pause = wl.think_time(workload, conversation, after["turn"])
                assert after["start_s"] - before["end_s"] >= pause > 0, (label, conversation, after["turn"])
    # The draws: seeded per (seed, conversation, turn), none before turn 1 or without think time, mean as set.
    assert wl.think_time(workload, 0, 2) != wl.think_time(workload, 1, 2) and wl.think_time(workload, 0, 1) == 0
    assert wl.think_time(dataclasses.replace(workload, think_time_s=0.0), 0, 2) == 0
    draws = [wl.think_time(workload, c, 2) for c in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(0.2, rel=0.1)


class _JumpingClock(traffic.Clock):
    """The run's clock, plus ``offset`` seconds that the test advances (a slot "takes" that long)."""

    offset = 0.0

    def now(self) -> float:
        return super().now() + _JumpingClock.offset


def test_round_budget_estimates_a_round_by_the_longest_so_far():
    clock = _JumpingClock()
    _JumpingClock.offset = 0.0
    budget = run_settings.RoundBudget(clock, 50.0)
    assert budget.allows(1, 0)  # the first round starts whenever time is left
    budget.finished(1, 20.0)
    _JumpingClock.offset = 20.0
    assert budget.allows(1, 1) and budget.stop is None  # 20 + 20 <= 50
    budget.finished(1, 15.0)  # the estimate keeps the longest round: 20
    _JumpingClock.offset = 31.0
    assert not budget.allows(1, 2)  # 31 + 20 > 50
    assert budget.stop["in_flight"] == 1 and budget.stop["round"] == 2 and budget.stop["expected_round_s"] == 20
    fresh = run_settings.RoundBudget(clock, 50.0)
    fresh.finished(1, 20.0)
    assert fresh.allows(8, 0) is False  # a new level's first round is estimated by the longest of any level
    assert run_settings.RoundBudget(clock, None).allows(1, 0) and run_settings.RoundBudget(clock, 60.0).allows(1, 0)
    _JumpingClock.offset = 0.0


@pytest.mark.parametrize("late_start", [False, True], ids=["two_rounds_fit", "nothing_fits"])
def test_time_budget_keeps_the_rounds_that_fit(tmp_path, capsys, monkeypatch, late_start):
    """Each slot "takes" 10 s on the run's clock, so a round of two labels takes 20 s: a 50 s
    budget lets rounds 1 and 2 start (at 0 and 20 s) and stops round 3 (40 + 20 > 50) and the next
    level; a run whose servers took the whole budget to start runs nothing and fails."""
    _JumpingClock.offset = 60.0 if late_start else 0.0
    real_slot = runner.run_slot

    def slot_taking_ten_seconds(*args, **kwargs):
        _JumpingClock.offset += 10.0
        return real_slot(*args, **kwargs)

    monkeypatch.setattr(runner, "Clock", _JumpingClock)
    monkeypatch.setattr(runner, "run_slot", slot_taking_ten_seconds)
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "result.json"
    with serve(CompletionsStub) as a, serve(CompletionsStub) as b:
        argv = stand_in_argv(a, b, "-N", "2", "-T", "2", "-A", "4", "-C", "1,2", "--repeat", "3",
                             "--time-budget", "50", "--out-json", str(out_json),
                             "--plot", str(tmp_path / "plot.png"))  # fmt: skip
        assert cli.main(argv) == (1 if late_start else 0)
    _JumpingClock.offset = 0.0
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["time_budget_s"] == 50
    if late_start:
        assert result["levels"] == [] and result["stopped_early"]["round"] == 0
        assert "rounds done: none (of 3 per level)" in printed
        return
    assert "stopped by --time-budget 50 s; rounds done: 2 at 1 in flight (of 3 per level)" in printed
    assert [lv["in_flight"] for lv in result["levels"]] == [1] and len(result["levels"][0]["rounds"]) == 2
    stop = result["stopped_early"]
    assert (stop["in_flight"], stop["round"]) == (1, 2) and stop["at_s"] + stop["expected_round_s"] > 50
    assert result["levels"][0]["summary"]["ratios"]["request_boundaries"]["turn1_ttft_vs_stock"]["n"] == 2
    assert {r["round"] for r in result["records"]} == {0, 1}


def test_a_run_killed_mid_round_leaves_the_rounds_it_finished(tmp_path, capsys, monkeypatch):
    """A SIGTERM (``interrupt_on_termination`` turns it into ``KeyboardInterrupt``) in round 3's
    first slot: ``--out-json`` holds rounds 1 and 2, summarized, marked incomplete, and no record of
    round 3; a run that finishes writes ``complete`` true."""
    real_slot = runner.run_slot

    def slot_killed_in_round_three(servers, label, workload, plans, round_index, *args):
        if round_index == 2:
            raise KeyboardInterrupt("signal 15")
        return real_slot(servers, label, workload, plans, round_index, *args)

    monkeypatch.setattr(runner, "run_slot", slot_killed_in_round_three)
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "result.json"
    with serve(CompletionsStub) as a, serve(CompletionsStub) as b:
        argv = stand_in_argv(a, b, "-N", "2", "-T", "2", "-A", "4", "-C", "1", "--repeat", "3",
                             "--out-json", str(out_json))  # fmt: skip
        assert cli.main(argv) == 130
        assert "2 rounds done are in" in capsys.readouterr().err
        killed = json.loads(out_json.read_text())
        assert killed["complete"] is False and killed["meta"]["argv"][0] == "bc-bench"
        assert [len(lv["rounds"]) for lv in killed["levels"]] == [2]
        assert killed["levels"][0]["summary"]["ratios"]["request_boundaries"]["turn1_ttft_vs_stock"]["n"] == 2
        assert {r["round"] for r in killed["records"]} == {0, 1}
        monkeypatch.setattr(runner, "run_slot", real_slot)
        assert cli.main(argv) == 0
    finished = json.loads(out_json.read_text())
    assert finished["complete"] is True and {r["round"] for r in finished["records"]} == {0, 1, 2}
    assert not out_json.with_name(out_json.name + ".tmp").exists()


@pytest.mark.parametrize("mode", ["together", "one_by_one", "relaunch"])
def test_launched_servers_together_or_one_per_slot(tmp_path, monkeypatch, mode):
    """The launch modes with stand-in servers: together, both start before the first slot and stop
    at the end (``one_by_one``: the second starts only once the first is healthy); with
    ``relaunch``, each slot starts and stops its own server, in round order."""
    relaunch = mode == "relaunch"
    from bc_tools.bench import server as server_mod

    events = []
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    with serve(CompletionsStub) as url:

        class Fake:
            def __init__(self, model, log_path, **kw):
                self.base_url, self.log_path, self.command = url, Path(log_path), ["fake"]
                self.label = kw["additional_config"]["boundary_checkpoints"]["policy"]
                assert kw["extra_args"] == (["--prefix-match-unit", "16"] if self.label == "aligned" else [])
                self.log_path.write_text(STATS_LINE.format(i=1, b=4096) + "\n" + BLOCK_LINE.format(n=16) + "\n")
                events.append(("start", self.label))

        def stop(server):
            events.append(("stop", server.label))
            return 0

        monkeypatch.setattr(server_mod, "start_server", lambda model, log_path, **kw: Fake(model, log_path, **kw))

        def healthy(server, timeout):
            events.append(("healthy", server.label))
            return 0.5

        monkeypatch.setattr(server_mod, "wait_until_healthy", healthy)
        monkeypatch.setattr(server_mod, "stop_server", stop)
        monkeypatch.setattr(server_mod, "find_free_port", lambda host: 1)
        labels = ["aligned", "request_boundaries"]
        settings = run_settings.Settings(workload=small_workload(conversations=1, turns=2, system_tokens=20),
                                         labels=labels, in_flight=[1], repeat=2, run_salt="t", floor_label="aligned",
                                         warmup=1, stats_log_interval=0)  # fmt: skip
        spec = server_sets.LaunchSpec(model_dir="m", model_name="m", sections={p: {"policy": p} for p in labels},
                                 label_args={"aligned": ["--prefix-match-unit", "16"]}, log_dir=tmp_path,
                                 relaunch=relaunch, one_by_one=mode == "one_by_one")  # fmt: skip
        result = runner.run_benchmark(settings, server_sets.LaunchedServers(settings, spec))
    startup = [event for event in events if event[0] in ("start", "healthy")][:4]
    if mode == "one_by_one":
        assert startup == [("start", "aligned"), ("healthy", "aligned"), ("start", "request_boundaries"),
                           ("healthy", "request_boundaries")]  # fmt: skip
    elif mode == "together":
        assert startup == [("start", "aligned"), ("start", "request_boundaries"), ("healthy", "aligned"),
                           ("healthy", "request_boundaries")]  # fmt: skip
    events = [event for event in events if event[0] != "healthy"]
    if relaunch:
        assert events == [("start", "aligned"), ("stop", "aligned"), ("start", "request_boundaries"),
                          ("stop", "request_boundaries"), ("start", "request_boundaries"),
                          ("stop", "request_boundaries"), ("start", "aligned"), ("stop", "aligned")]  # fmt: skip
    else:
        assert events == [("start", "aligned"), ("start", "request_boundaries"), ("stop", "aligned"),
                          ("stop", "request_boundaries")]  # fmt: skip
    starts = 2 if relaunch else 1
    assert all(len(info["ready_s"]) == starts and info["exit_codes"] == [0] * starts
               for info in result["servers"].values())  # fmt: skip
    warmups = [b for b in CompletionsStub.requests if "warmup" in b["cache_salt"]]
    assert len(warmups) == 2 * 2 * starts  # one 2-turn warm-up conversation per server start
    assert result["block_size"] == 16 and result["floor_policy"] == "aligned"
    assert len([r for r in result["records"] if r["phase"] == "floor"]) == 2  # one per round


@pytest.mark.parametrize("mode", ["tokens", "chat"])
def test_warm_up_sends_its_conversations_at_once(monkeypatch, mode):
    """Every warm-up conversation's first turn is in flight before any returns (the barrier lets
    none through until all three wait), so the timed slots meet no batch shape it left out."""
    first_turns = threading.Barrier(3, timeout=20)
    sent = []

    def fake_send(target, prompt, **fields):
        if fields["turn"] == 1:
            first_turns.wait()
        sent.append((fields["conversation"], fields["turn"]))
        return SimpleNamespace(error=None, answer_ids=[5, 6])

    def fake_send_chat(target, messages, **fields):
        return fake_send(target, messages, **fields), SimpleNamespace(text="an answer")

    monkeypatch.setattr(slot, "send", fake_send)
    monkeypatch.setattr(slot, "send_chat", fake_send_chat)
    workload = small_workload(mode=mode, system_tokens=32, user_tokens=8)
    slot.warm_up(traffic.Target("stock", "http://x", "m"), workload, "salt", 3, timeout=5)
    assert sorted(sent) == [(c, t) for c in (-3, -2, -1) for t in (1, 2)]


def test_turn1_only_run_reports_the_first_turn_tax_only(tmp_path, capsys):
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "turn1.json"
    with serve(CompletionsStub) as a, serve(CompletionsStub) as b:
        argv = stand_in_argv(a, b, "--turn1-only", "-N", "3", "-A", "2", "-C", "1", "--repeat", "2", "--floor",
                             "--block-size", "16", "--markdown", "--out-json", str(out_json))  # fmt: skip
        assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| TTFT p50 turn 1 (fresh prompt) / stock |" in printed and "| TTFT p50 ms, turn 1 |" in printed
    assert "turns >= 2" not in printed and "targets (" not in printed and "all turns" not in printed
    result = json.loads(out_json.read_text())
    assert result["workload"]["turns"] == 1 and result["workload"]["shared_system"] is False
    assert {r["phase"] for r in result["records"]} == {"conversation"}  # no floor without a turn 2
    assert all(r["cached_tokens"] == 0 for r in result["records"])  # nothing is shared, nothing reused
    assert result["levels"][0]["summary"]["ratios"]["request_boundaries"]["turn1_ttft_vs_stock"]["n"] == 2


def test_time_budget_stops_a_server_still_starting(tmp_path, monkeypatch):
    """A launched server that is not healthy when the time budget ends is stopped with the others,
    and the run ends at the budget with ``stopped_early`` naming it, instead of waiting out the
    startup timeout (on the GPU host an outer ``timeout`` then cut the run and the server, in its
    own session, outlived it and held the GPU's memory)."""
    import time

    from bc_tools.bench import server as server_mod

    processes = []

    def never_healthy(model, log_path, **kw):
        stand_in = stand_in_server(log_path, "import time; time.sleep(120)")
        processes.append(stand_in.process)
        return stand_in

    monkeypatch.setattr(server_mod, "start_server", never_healthy)
    labels = ["aligned", "request_boundaries"]
    settings = run_settings.Settings(workload=small_workload(conversations=1, turns=2, system_tokens=20),
                                     labels=labels, in_flight=[1], repeat=2, run_salt="t", warmup=0,
                                     stats_log_interval=0, time_budget_s=1.0)  # fmt: skip
    spec = server_sets.LaunchSpec(model_dir="m", model_name="m", sections={p: {"policy": p} for p in labels},
                             log_dir=tmp_path, one_by_one=True, startup_timeout=60.0)  # fmt: skip
    started = time.monotonic()
    result = runner.run_benchmark(settings, server_sets.LaunchedServers(settings, spec))
    assert time.monotonic() - started < 20  # the budget (1 s) plus the stop's grace, not the 60 s timeout
    assert result["levels"] == [] and result["stopped_early"]["phase"] == "server start"
    assert result["stopped_early"]["label"] == "aligned" and len(processes) == 1  # the second never started
    assert processes[0].poll() is not None  # stopped, not left running
