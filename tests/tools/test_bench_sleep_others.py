"""``bc-bench --sleep-others`` against stand-in servers with vLLM's sleep-mode endpoints (no vLLM):
only the slot's server is awake while its requests run, a woken server is warmed up again before
its slot, launched servers get sleep mode's flag and environment and start one by one (each asleep
before the next starts), the option excludes ``--relaunch``, and a server without the endpoints
stops the run with what to fix."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest
from http_stub import serve, sleepy_stub

from bc_tools.bench import cli, cli_args, run_settings, runner, server_sets, sleep_mode
from bc_tools.bench import workload as wl

LABELS = ["aligned", "request_boundaries"]
# Rounds alternate who goes first: aligned, rb | rb, aligned | aligned, rb. A switch precedes every
# slot whose label differs from the previous slot's: slots 0, 1, 3 and 5 of the 6.
SWITCHES = [("request_boundaries", "sleep"), ("aligned", "wake"), ("aligned", "sleep"), ("request_boundaries", "wake"),
            ("request_boundaries", "sleep"), ("aligned", "wake"), ("aligned", "sleep"),
            ("request_boundaries", "wake")]  # fmt: skip
WORKLOAD = ["--vocab-size", "1024", "-N", "1", "-T", "2", "-S", "20", "-U", "8", "-A", "4", "-C", "1", "--repeat", "3",
            "--no-floor"]  # fmt: skip


def _switches(events):
    return [(name, kind) for name, kind, *_ in events if kind in ("sleep", "wake")]


def _check_one_awake_and_warm_after_wake(events):
    """Every request found its own server the only one awake, and the first requests to a server
    after each wake are a warm-up conversation (2 turns) before any timed one, with a salt no
    earlier warm-up of that server used (a repeated prompt would count as reuse)."""
    requests = [e for e in events if e[1] == "request"]
    assert requests and all(awake == [name] for name, _, _, awake in requests), requests
    woken_at = [i for i, e in enumerate(events) if e[1] == "wake"]
    for i in woken_at:
        name = events[i][0]
        after = [e[2] for e in events[i + 1 :] if e[1] == "request" and e[0] == name][:3]
        assert ["-warmup-" in salt for salt in after] == [True, True, False], (name, after)
    warmups = [e for e in requests if "-warmup-" in e[2]]
    assert len(warmups) == 2 * len(woken_at)  # one 2-turn warm-up conversation per wake, no more
    salts = [(name, salt) for name, _, salt, _ in warmups]
    assert len(set(salts)) == len(salts) // 2, salts  # both turns of one warm-up share its salt


def test_url_servers_sleep_all_but_the_slots_and_warm_up_after_each_wake(tmp_path, capsys):
    events: list[tuple] = []
    asleep: dict[str, bool] = {}
    out_json = tmp_path / "result.json"
    # Each switch finishes two /is_sleeping polls after its POST: the run must wait for it.
    stubs = [sleepy_stub(label, events, asleep, lag=2) for label in LABELS]
    with serve(stubs[0]) as a, serve(stubs[1]) as b:
        argv = ["--url", a, "--url", b, "--label", "aligned", "--label", "request_boundaries", "--model", "m",
                *WORKLOAD, "--sleep-others", "--out-json", str(out_json)]  # fmt: skip
        assert cli.main(argv) == 0
    assert _switches(events) == SWITCHES
    assert all(path == "/sleep?level=1" for _, kind, path, *_ in events if kind == "sleep")
    _check_one_awake_and_warm_after_wake(events)
    printed = capsys.readouterr().out
    assert "sleep-others: wake " in printed and "(n=4)" in printed
    assert "left asleep: aligned" in printed  # the run leaves --url servers as they are, one awake
    result = json.loads(out_json.read_text())
    assert result["sleep_others"] is True
    slots = {label: result["servers"][label]["sleep_others"] for label in LABELS}
    slot_indices = {label: [e["slot"] for e in slots[label]] for label in LABELS}
    assert slot_indices == {"aligned": [0, 3, 4], "request_boundaries": [1, 2, 5]}
    woke = {label: [e["wake_s"] is not None for e in slots[label]] for label in LABELS}
    assert woke == {"aligned": [True, True, False], "request_boundaries": [True, False, True]}
    assert all((e["warmup_s"] is not None) == (e["wake_s"] is not None) for label in LABELS for e in slots[label])
    assert [list(e["sleep_s"]) for e in slots["aligned"]] == [["request_boundaries"], ["request_boundaries"], []]
    assert all(s["s"] >= 0 for e in slots["aligned"] for s in e["sleep_s"].values())


def test_without_sleep_others_nothing_sleeps(tmp_path):
    events: list[tuple] = []
    asleep: dict[str, bool] = {}
    stubs = [sleepy_stub(label, events, asleep) for label in LABELS]
    with serve(stubs[0]) as a, serve(stubs[1]) as b:
        argv = ["--url", a, "--url", b, "--label", "aligned", "--label", "request_boundaries", "--model", "m",
                *WORKLOAD]  # fmt: skip
        assert cli.main(argv) == 0
    assert _switches(events) == []
    assert len([e for e in events if e[1] == "request" and "-warmup-" in e[2]]) == 2 * 2  # once per server


def test_a_server_without_sleep_mode_stops_the_run_naming_the_flag_and_variable(tmp_path, capsys):
    events: list[tuple] = []
    asleep: dict[str, bool] = {}
    with ExitStack() as stack:
        urls = [stack.enter_context(serve(sleepy_stub(label, events, asleep, sleep_mode=False))) for label in LABELS]
        argv = ["--url", urls[0], "--url", urls[1], "--label", LABELS[0], "--label", LABELS[1], "--model", "m",
                *WORKLOAD, "--sleep-others"]  # fmt: skip
        assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "[request_boundaries]" in err and "/sleep?level=1 answered 404" in err
    assert "--enable-sleep-mode" in err and "VLLM_SERVER_DEV_MODE=1" in err
    assert [e for e in events if e[1] == "request"] == []  # no slot ran with both servers awake


def test_sleep_others_excludes_relaunch(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_args.parse_args(["--launch", "d", "--relaunch", "--sleep-others"])
    assert exc.value.code == 2
    assert "--sleep-others and --relaunch are mutually exclusive" in capsys.readouterr().err
    assert cli_args.parse_args(["--launch", "d", "--sleep-others"]).sleep_others
    assert cli_args.parse_args(["--url", "http://a", "--model", "m", "--sleep-others"]).sleep_others


def _launched(tmp_path, sleep_others, **spec_kw):
    settings = run_settings.Settings(workload=wl.Workload(conversations=1, turns=2, system_tokens=20, user_tokens=8,
                                                          answer_tokens=4, concurrency=1, vocab_size=1024, seed=0),
                                     labels=LABELS, in_flight=[1], repeat=3, run_salt="t", warmup=1,
                                     stats_log_interval=0, sleep_others=sleep_others)  # fmt: skip
    spec = server_sets.LaunchSpec(model_dir="m", model_name="m", sections={p: {"policy": p} for p in LABELS},
                                  log_dir=tmp_path, **spec_kw)  # fmt: skip
    return settings, server_sets.LaunchedServers(settings, spec)


def test_launch_options_add_the_sleep_flag_and_dev_mode(tmp_path):
    spec_kw = dict(server_args=["--load-format", "dummy"], label_args={"aligned": ["--prefix-match-unit", "16"]},
                   env={"A": "1"})  # fmt: skip
    _, plain = _launched(tmp_path, False, **spec_kw)
    assert plain.launch_options("aligned") == (["--load-format", "dummy", "--prefix-match-unit", "16"], {"A": "1"})
    _, sleepy = _launched(tmp_path, True, **spec_kw)
    args, env = sleepy.launch_options("aligned")
    assert args == ["--load-format", "dummy", "--prefix-match-unit", "16", "--enable-sleep-mode"]
    assert env == {"A": "1", "VLLM_SERVER_DEV_MODE": "1"}
    assert sleepy.launch_options("request_boundaries") == (["--load-format", "dummy", "--enable-sleep-mode"], env)
    assert sleepy.spec.env == {"A": "1"}  # the spec is not changed


def _fake_launches(stack, monkeypatch, tmp_path, events, asleep):
    """Stand-in servers behind ``server.start_server`` (sleep-mode stubs, one per label); the keyword
    arguments of each start, by label."""
    from bc_tools.bench import server as server_mod

    logs = {label: tmp_path / f"server_{label}.log" for label in LABELS}
    launched = {}
    urls = {label: stack.enter_context(serve(sleepy_stub(label, events, asleep, log_path=logs[label])))
            for label in LABELS}  # fmt: skip

    class Fake:
        def __init__(self, model, log_path, **kw):
            self.label = kw["additional_config"]["boundary_checkpoints"]["policy"]
            self.base_url, self.log_path, self.command = urls[self.label], Path(log_path), ["fake"]
            self.log_path.write_text("")
            launched[self.label] = kw
            asleep[self.label] = False  # a server starts awake
            events.append((self.label, "start"))

    def healthy(server, timeout):
        events.append((server.label, "healthy"))
        return 0.5

    monkeypatch.setattr(server_mod, "start_server", lambda model, log_path, **kw: Fake(model, log_path, **kw))
    monkeypatch.setattr(server_mod, "wait_until_healthy", healthy)
    monkeypatch.setattr(server_mod, "stop_server", lambda server: events.append((server.label, "stop")) or 0)
    monkeypatch.setattr(server_mod, "find_free_port", lambda host: 1)
    return launched


def test_launched_servers_start_one_by_one_each_asleep_before_the_next(tmp_path, monkeypatch):
    events: list[tuple] = []
    asleep: dict[str, bool] = {}
    with ExitStack() as stack:
        launched = _fake_launches(stack, monkeypatch, tmp_path, events, asleep)
        settings, servers = _launched(tmp_path, True)
        result = runner.run_benchmark(settings, servers)
    for kw in launched.values():
        assert kw["extra_args"][-1] == "--enable-sleep-mode" and kw["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    startup = [(name, kind) for name, kind, *_ in events if kind != "request"][:5]
    assert startup == [("aligned", "start"), ("aligned", "healthy"), ("aligned", "sleep"),
                       ("request_boundaries", "start"), ("request_boundaries", "healthy")]  # fmt: skip
    # The last server started is awake: the first slot (aligned's) puts it to sleep and wakes aligned.
    assert _switches(events) == [("aligned", "sleep"), *SWITCHES]
    _check_one_awake_and_warm_after_wake(events)
    assert [name for name, kind, *_ in events if kind == "stop"] == LABELS
    info = result["servers"]
    assert info["aligned"]["startup_sleep"] == {"s": pytest.approx(0, abs=5), "freed_gib": 12.5, "gpu_in_use_gib": 3.25}
    assert "startup_sleep" not in info["request_boundaries"]
    first = info["aligned"]["sleep_others"][0]
    assert first["slot"] == 0 and first["wake_s"] is not None and first["warmup_s"] is not None
    assert first["sleep_s"]["request_boundaries"]["freed_gib"] == 12.5  # read from the server's log
    assert sum(e["wake_s"] is not None for label in LABELS for e in info[label]["sleep_others"]) == 4


def test_sleep_memory_reads_the_workers_line():
    from http_stub import SLEEP_LOG_LINE

    assert sleep_mode.sleep_memory("x\n" + SLEEP_LOG_LINE + "\n") == {"freed_gib": 12.5, "gpu_in_use_gib": 3.25}
    assert sleep_mode.sleep_memory("no such line") is None


def test_kept_servers_are_adopted_asleep_by_the_next_run_of_the_same_launch(tmp_path, monkeypatch):
    """--keep-servers: the first run stops nothing and records its servers; the next run of the same
    launch starts none, puts the one left awake to sleep, and runs the same switches as a run whose
    servers were all asleep; one whose server is gone puts the kept one to sleep before starting
    it; a run of another launch gets none of them."""
    from bc_tools.bench import kept_servers

    store: dict = {}
    monkeypatch.setattr(kept_servers, "save", lambda path, key, running: store.update(key=key, servers=dict(running)))
    monkeypatch.setattr(kept_servers, "adopt",
                        lambda path, key: dict(store["servers"]) if store.get("key") == key else {})  # fmt: skip
    runs = []
    with ExitStack() as stack:
        events: list[tuple] = []
        asleep: dict[str, bool] = {}
        _fake_launches(stack, monkeypatch, tmp_path, events, asleep)
        for run in range(3):
            if run == 2:  # aligned's kept server is gone: rb, left awake, must sleep before aligned starts
                store["servers"].pop("aligned")
            settings, servers = _launched(tmp_path, True, keep_file=tmp_path / "kept.json")
            start = len(events)
            runs.append((runner.run_benchmark(settings, servers), events[start:]))
        other_key = _launched(tmp_path, True, keep_file=tmp_path / "kept.json", server_args=["--x"])[1]._launch_key()
    (first, first_events), (second, second_events), (_, third_events) = runs
    third = [(name, kind) for name, kind, *_ in third_events if kind in ("start", "sleep")]
    assert third[:2] == [("request_boundaries", "sleep"), ("aligned", "start")], third
    assert [name for name, kind, *_ in first_events if kind == "start"] == LABELS
    assert [e for e in first_events + second_events if e[1] == "stop"] == []  # left running
    assert [name for name, kind, *_ in second_events if kind == "start"] == []
    assert _switches(second_events) == SWITCHES  # the awake one put to sleep, then as ever
    _check_one_awake_and_warm_after_wake(second_events)
    assert all(second["servers"][label]["kept"] for label in LABELS)
    assert not any(first["servers"][label].get("kept") for label in LABELS)
    assert store["key"] != other_key  # another launch adopts nothing


def test_kept_servers_file_adopts_live_groups_and_stops_them_for_another_launch(tmp_path, capsys):
    import subprocess
    import sys
    import threading

    from bc_tools.bench import kept_servers
    from bc_tools.bench import server as server_mod

    def detached():
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        threading.Thread(target=process.wait, daemon=True).start()  # reaped at exit, as init reaps a kept one
        return server_mod.ServerProcess(process=process, host="127.0.0.1", port=1, log_path=tmp_path / "l",
                                        command=["x"])  # fmt: skip

    path = tmp_path / "kept.json"
    live, dead = detached(), detached()
    dead.process.kill()
    dead.process.wait(timeout=30)
    kept_servers.save(path, "k1", {"a": live, "b": dead})
    adopted = kept_servers.adopt(path, "k1")
    assert list(adopted) == ["a"] and adopted["a"].pid == live.pid and adopted["a"].running()
    assert kept_servers.adopt(path, "k2") == {}  # another launch: stopped, file gone
    assert not path.exists() and live.process.wait(timeout=30) is not None and not live.running()
    again = detached()  # from a shell: python -m bc_tools.bench.kept_servers --stop FILE
    kept_servers.save(path, "k1", {"a": again})
    assert kept_servers.main(["--stop", str(path)]) == 0 and not path.exists()
    assert again.process.wait(timeout=30) is not None
    assert "kept servers stopped: a" in capsys.readouterr().out
    assert kept_servers.launch_key({"env": {"VLLM_LOGGING_CONFIG_PATH": "/t/1"}}) == kept_servers.launch_key(
        {"env": {"VLLM_LOGGING_CONFIG_PATH": "/t/2"}})  # fmt: skip


def test_keep_servers_needs_launch_and_sleep_others(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_args.parse_args(["--launch", "d", "--keep-servers", "f"])
    assert exc.value.code == 2 and "--keep-servers needs --launch and --sleep-others" in capsys.readouterr().err
    assert cli_args.parse_args(["--launch", "d", "--sleep-others", "--keep-servers", "f"]).keep_servers == "f"
