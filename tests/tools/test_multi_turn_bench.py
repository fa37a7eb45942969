"""Tests of ``bc-bench`` (``bc_tools/bench/``: ``workload``, ``stats``, ``logs``, ``report``, ``traffic``,
``slot``, ``run_settings``, ``server_sets``, ``runner``, ``cli_args``, ``cli``): the pure parts, a whole
run against two stand-in servers, and one small run against real CPU servers.

The end-to-end test launches the tiny Qwen3-Next twice at once (stock ``aligned`` and
``request_boundaries``) through ``--launch``: 2 rounds, N=2, T=2, S=64, U=16, A=8, one in flight;
the chat one (``--mode chat --turn1-only``) 1 round of 3 one-turn conversations sharing a system
message shorter than one block.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from http_stub import CompletionsStub, serve, stand_in_server

from bc_tools.bench import cli, cli_args, logs, report, run_settings, runner, server_sets, slot, stats, traffic
from bc_tools.bench import workload as wl
from bc_tools.bench.stats import RequestRecord


def _workload(**kw):
    base = dict(conversations=3, turns=4, system_tokens=50, user_tokens=10, answer_tokens=6,
                concurrency=2, vocab_size=1024, seed=7)  # fmt: skip
    base.update(kw)
    return wl.Workload(**base)


# ------------------------------------------------------------------------------------------------
# statistics


def test_percentile_linear_interpolation():
    assert stats.percentile([], 50) is None
    assert stats.percentile([None, None], 50) is None
    assert stats.percentile([3.0], 95) == 3.0
    assert stats.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert stats.percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert stats.percentile([1, 2, 3, 4], 0) == 1
    assert stats.percentile([1, 2, 3, 4], 100) == 4
    assert stats.percentile([10, None, 20], 50) == pytest.approx(15)
    with pytest.raises(ValueError):
        stats.percentile([1], 101)


def test_spread_is_the_median_and_interquartile_range():
    assert stats.spread([5, 1, 4, 2, 3]) == {"median": 3, "p25": 2, "p75": 4, "n": 5}
    s = stats.spread([10, None, 20, 30, 40])
    assert (s["median"], s["p25"], s["p75"], s["n"]) == (25, 17.5, 32.5, 4)
    assert stats.spread([]) == {"median": None, "p25": None, "p75": None, "n": 0}
    rows = [{"a": 1, "b": None, "name": "x"}, {"a": 3, "b": 2.0}, None, {"a": 2}]
    agg = stats.aggregate(rows)
    assert set(agg) == {"a", "b"}  # strings are not aggregated
    assert agg["a"] == {"median": 2, "p25": 1.5, "p75": 2.5, "n": 3}
    assert agg["b"]["median"] == 2.0 and agg["b"]["n"] == 1


def _rec(policy="p", phase="conversation", conv=0, turn=1, prompt=100, cached=0, completion=8,
         boundary=0, ttft=0.1, start=0.0, end=1.0, answer=(), error=None, round_index=0):  # fmt: skip
    return RequestRecord(policy=policy, phase=phase, conversation=conv, turn=turn, prompt_tokens=prompt,
                         cached_tokens=cached, completion_tokens=completion, boundary=boundary, ttft_s=ttft,
                         latency_s=end - start, start_s=start, end_s=end, answer_ids=list(answer), error=error,
                         round=round_index)  # fmt: skip


def test_summarize_policy_ratios_throughput_quantiles_and_exact_hits():
    records = [
        _rec(turn=1, prompt=100, cached=0, ttft=0.4, start=0.0, end=1.0),
        _rec(turn=2, prompt=120, cached=107, boundary=107, ttft=0.1, start=1.0, end=2.0),
        _rec(turn=3, prompt=140, cached=128, boundary=127, ttft=0.3, start=2.0, end=4.0),
        _rec(phase="floor", turn=2, prompt=273, cached=256, boundary=256, ttft=9.0),
        _rec(phase="warmup", turn=1, prompt=999, cached=0, ttft=9.0, start=-5, end=-4),
        _rec(turn=3, conv=1, error="HTTP 500", start=0.0, end=0.5),
    ]
    s = stats.summarize_policy(records)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["prompt_tokens"] == 360 and s["cached_tokens"] == 235
    assert s["cached_ratio"] == pytest.approx(235 / 360)
    assert s["prefill_tokens"] == 125 and s["prefill_cont_tokens"] == 25
    assert s["wall_s"] == pytest.approx(4.0)
    assert s["output_throughput_tok_s"] == pytest.approx(6.0)
    assert s["ttft_all_p50_s"] == pytest.approx(0.3)
    assert s["ttft_all_p90_s"] == pytest.approx(0.38)
    assert s["ttft_all_p99_s"] == pytest.approx(0.398)
    assert s["ttft_turn1_p50_s"] == pytest.approx(0.4) and s["ttft_turn1_p99_s"] == pytest.approx(0.4)
    assert s["ttft_cont_p50_s"] == pytest.approx(0.2)
    assert s["exact_hits"] == 1 and s["later_turns"] == 2
    # time per output token after the first: (latency - ttft) / (completion - 1)
    assert records[0].tpot_s == pytest.approx((1.0 - 0.4) / 7)
    assert _rec(completion=1).tpot_s is None and _rec(ttft=None).tpot_s is None

    floor = stats.summarize_floor(records)
    assert floor["requests"] == 1 and floor["cached_as_primed"] == 1
    assert floor["ttft_p50_s"] == 9.0 and floor["mean_computed_tokens"] == 17
    assert stats.summarize_floor([_rec()]) is None


def test_round_ratios_and_targets_on_medians():
    stock = {"prefill_tokens": 1000, "prefill_cont_tokens": 800, "output_throughput_tok_s": 100.0,
             "ttft_cont_p50_s": 0.5, "ttft_turn1_p50_s": 0.2, "ttft_all_p50_s": 0.4}  # fmt: skip
    plugin = {"prefill_tokens": 250, "prefill_cont_tokens": 100, "output_throughput_tok_s": 99.0,
              "ttft_cont_p50_s": 0.105, "ttft_turn1_p50_s": 0.23, "ttft_all_p50_s": 0.12, "later_turns": 4}  # fmt: skip
    out = stats.round_ratios({"aligned": stock, "request_boundaries": plugin}, {"ttft_p50_s": 0.1})
    r = out["request_boundaries"]
    assert set(out) == {"request_boundaries"}
    assert r["turn1_ttft_vs_stock"] == pytest.approx(1.15)
    assert r["cont_ttft_vs_stock"] == pytest.approx(0.21)
    assert r["all_ttft_vs_stock"] == pytest.approx(0.3)
    assert r["prefill_cont_vs_stock"] == pytest.approx(0.125)
    assert r["prefill_vs_stock"] == pytest.approx(0.25)
    assert r["throughput_vs_stock"] == pytest.approx(0.99)
    assert r["continuation_ttft_vs_floor"] == pytest.approx(1.05)
    judged = stats.targets(stats.aggregate([r]))
    assert {k: v["passed"] for k, v in judged.items()} == {
        "continuation_ttft_vs_floor": True, "prefill_vs_stock": True, "throughput_vs_stock": True}  # fmt: skip
    worse = dict(plugin, prefill_tokens=400, output_throughput_tok_s=90.0, ttft_cont_p50_s=0.2)
    rounds = [stats.round_ratios({"aligned": stock, "request_boundaries": p}, {"ttft_p50_s": 0.1})
              ["request_boundaries"] for p in (plugin, worse, worse)]  # fmt: skip
    judged = stats.targets(stats.aggregate(rounds))  # the median is the worse round's
    assert not any(v["passed"] for v in judged.values())
    assert judged["prefill_vs_stock"]["median"] == pytest.approx(0.4)
    no_stock = stats.round_ratios({"request_boundaries": plugin}, None)["request_boundaries"]
    assert no_stock == dict.fromkeys(no_stock)
    assert all(v["passed"] is None for v in stats.targets({}).values())


# ------------------------------------------------------------------------------------------------
# workload


def test_plans_are_seeded_share_the_system_prompt_and_stay_in_range():
    w = _workload()
    plans = wl.make_plans(w)
    assert plans == wl.make_plans(w)
    assert len(plans) == 3
    assert all(p.system_ids == plans[0].system_ids for p in plans)
    assert len(plans[0].system_ids) == 50
    assert all(len(p.user_turns) == 4 and all(len(u) == 10 for u in p.user_turns) for p in plans)
    ids = [t for p in plans for u in p.user_turns for t in u] + list(plans[0].system_ids)
    assert min(ids) >= wl.FIRST_RANDOM_ID and max(ids) < 1024
    assert plans[0].user_turns != plans[1].user_turns
    # more conversations never change the earlier ones; another seed changes everything
    assert wl.make_plans(_workload(conversations=5))[:3] == plans
    other = wl.make_plans(_workload(seed=8))
    assert other[0].system_ids != plans[0].system_ids and other[0].user_turns != plans[0].user_turns
    assert wl.make_plans(_workload(system_tokens=0))[0].system_ids == ()
    with pytest.raises(ValueError):
        wl.draw_ids(random.Random(0), 3, 4)


def test_turn1_only_workload_shares_nothing():
    w = _workload(turns=1, shared_system=False, conversations=4)
    plans = wl.make_plans(w)
    assert all(len(p.user_turns) == 1 and len(p.system_ids) == 50 for p in plans)
    firsts = [wl.first_prompt(p) for p in plans]
    assert len({tuple(f[:1]) for f in firsts}) > 1  # no shared prefix between conversations
    assert all(len(f) == 60 for f in firsts)
    assert w.timed_requests(labels=2, floor=True) == 2 * 4  # one turn: no floor requests
    assert w.max_prompt_tokens() == 60


def test_in_flight_levels_drive_at_least_that_many_conversations():
    w = _workload(conversations=4)
    assert w.at_in_flight(1) == _workload(conversations=4, concurrency=1)
    assert w.at_in_flight(8).conversations == 8 and w.at_in_flight(8).concurrency == 8
    assert w.at_in_flight(8).timed_requests(labels=2, floor=True) == 2 * 8 * 4 + 2 * 8 * 3
    assert cli_args.parse_in_flight("1,8,32,64") == [1, 8, 32, 64]
    assert cli_args.parse_in_flight("8,1,8") == [8, 1]
    for bad in ("0", "", "a", "1,-2"):
        with pytest.raises(ValueError):
            cli_args.parse_in_flight(bad)


def test_round_order_alternates_who_goes_first():
    two = ["aligned", "request_boundaries"]
    assert [wl.round_order(two, r) for r in range(4)] == [two, two[::-1], two, two[::-1]]
    three = ["a", "b", "c"]
    orders = [wl.round_order(three, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert sorted(o[0] for o in orders) == three  # each label first once per cycle
    assert wl.round_order([], 3) == []


def test_prompts_across_turns_extend_the_previous_prompt_and_answer():
    w = _workload(conversations=1)
    plan = wl.make_plans(w)[0]
    prompt = wl.first_prompt(plan)
    assert prompt == list(plan.system_ids) + list(plan.user_turns[0])
    answers = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]
    for k in range(1, w.turns):
        previous = prompt
        prompt = wl.next_prompt(previous, answers[k - 1], plan.user_turns[k])
        assert prompt[: len(previous)] == previous
        assert prompt[len(previous) : len(previous) + 6] == answers[k - 1]
        assert prompt[-10:] == list(plan.user_turns[k])
        boundary = wl.exact_boundary(len(previous), len(answers[k - 1]))
        assert boundary == len(previous) + 6 - 1
        # an exact boundary hit computes the last answer token and the new user tokens
        assert len(prompt) - boundary == w.user_tokens + 1
    assert len(prompt) == w.max_prompt_tokens()
    assert w.max_sequence_tokens() == w.max_prompt_tokens() + w.answer_tokens
    assert wl.exact_boundary(80, 0) == 80


def test_floor_prompts_on_the_block_grid():
    rng = random.Random(1)
    prompt = [rng.randrange(4, 1024) for _ in range(468)]  # 400 prompt + 8 answer + 60 user
    boundary, new = 407, 61
    fp = wl.floor_prompts(prompt, boundary, new, 256)
    assert fp.prefix_len == 256
    assert fp.prime == prompt[:256] + [prompt[407]]
    assert fp.timed == prompt[:256] + prompt[407:468]
    assert len(fp.prime) == 257 and len(fp.timed) == 256 + new
    assert fp.timed[: len(fp.prime)] == fp.prime  # the timed request shares the primed prefix

    on_grid = wl.floor_prompts(prompt, 256, 61, 128)
    assert on_grid.prefix_len == 256 and on_grid.timed == prompt[:256] + prompt[256:317]

    # a boundary shorter than one block: L0 = one block, padded with filler ids
    short = wl.floor_prompts(prompt[:104], 87, 17, 256, filler=lambda k: [5] * k)
    assert short.prefix_len == 256
    assert short.prime == prompt[:87] + [5] * 169 + [prompt[87]]
    assert short.timed == prompt[:87] + [5] * 169 + prompt[87:104]
    with pytest.raises(ValueError):
        wl.floor_prompts(prompt[:104], 87, 17, 256)  # needs a filler
    with pytest.raises(ValueError):
        wl.floor_prompts(prompt, 460, 61, 256)  # tail overruns the prompt
    assert [wl.floor_prefix_len(b, 544) for b in (0, 543, 544, 2263)] == [544, 544, 544, 2176]


# ------------------------------------------------------------------------------------------------
# log parsing

STATS_LINE = (
    "(EngineCore pid=12559) INFO 11-29 17:08:0{i} [scheduler.py:382] boundary_checkpoints: hits={i}, "
    "misses=1, tokens_restored=407, published=2, duplicates=0, evictions=0, captures_dropped=0, "
    "checkpoints_retained=2, blocks_retained=9, bytes_retained={b}, captures_pending=1"
)
BLOCK_LINE = (
    "(VllmWorker-0 pid=12627) INFO 11-29 17:07:53 [interface.py:1096] Setting attention block size to "
    "{n} tokens to ensure that attention page size is >= mamba page size."
)


def test_stats_lines_last_counters_and_peak_bytes_retained(tmp_path):
    log = "\n".join([
        "(EngineCore pid=1) INFO [scheduler.py:157] boundary_checkpoints: request_boundaries active: 4 KV groups",
        STATS_LINE.format(i=1, b=0),
        "some other line bytes_retained=99999999",
        STATS_LINE.format(i=2, b=1179648),
        STATS_LINE.format(i=3, b=65536),
        "(APIServer pid=2) INFO: 127.0.0.1 - POST /v1/completions 200 OK",
    ])  # fmt: skip
    assert logs.peak_bytes_retained(log) == 1179648
    stats_ = logs.parse_boundary_stats(log)
    assert stats_["hits"] == 3 and stats_["bytes_retained"] == 65536 and stats_["captures_pending"] == 1
    assert logs.peak_bytes_retained("no stats here\nbytes_retained=5\n") is None
    assert logs.parse_boundary_stats("") is None
    assert logs.peak_bytes_retained("boundary_checkpoints: bytes_retained=42 (3 checkpoints)") == 42
    # a slot reads the log from its start offset only
    path = tmp_path / "server.log"
    path.write_text(STATS_LINE.format(i=1, b=7777777) + "\n")
    offset = logs.log_size(path)
    with open(path, "a") as fh:
        fh.write(STATS_LINE.format(i=2, b=4096) + "\n")
    assert logs.peak_bytes_retained(logs.read_text(path, offset)) == 4096
    assert logs.read_text(None) == "" and logs.read_text(tmp_path / "missing") == ""
    assert logs.log_size(None) == 0


def test_parse_block_size_and_its_precedence():
    log = "\n".join(["noise", BLOCK_LINE.format(n=544), "kv lcm block sizes 544"])
    assert logs.parse_block_size(log) == 544
    assert logs.parse_block_size(BLOCK_LINE.format(n=256) + "\n" + BLOCK_LINE.format(n=512)) == 512
    assert logs.parse_block_size("kv cache group sizes (256,)") is None
    assert logs.resolve_block_size(1088, log, []) == (1088, "--block-size")
    assert logs.resolve_block_size(None, log, ["--block-size", "64"])[0] == 544
    assert logs.resolve_block_size(None, "", ["--block-size", "64"]) == (64, "--server-arg --block-size")
    assert logs.resolve_block_size(None, "", ["--block-size=128"])[0] == 128
    assert logs.resolve_block_size(None, "", []) == (None, "unknown")


def test_server_arg_value_last_one_wins():
    argv = ["--max-model-len", "4096", "--enforce-eager", "--max-model-len", "40000"]
    assert logs.server_arg_value(argv, "--max-model-len") == "40000"
    assert logs.server_arg_value(argv + ["--max-model-len=8192"], "--max-model-len") == "8192"
    assert logs.server_arg_value(argv, "--block-size") is None
    assert cli_args.split_server_args(["--load-format dummy", "--max-model-len=40000"]) == [
        "--load-format", "dummy", "--max-model-len=40000"]  # fmt: skip


def test_plugin_logging_config_routes_plugin_lines_to_stdout(tmp_path):
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(logs.plugin_logging_config()))
    code = (
        "import json, logging, logging.config, sys;"
        f"logging.config.dictConfig(json.load(open({str(path)!r})));"
        "logging.getLogger('boundary_checkpoints.core.scheduler').info("
        "'boundary_checkpoints: hits=1, bytes_retained=4096');"
        "logging.getLogger('vllm.x').info('Setting attention block size to 256 tokens to ensure');"
        "logging.getLogger('other').info('dropped')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert logs.peak_bytes_retained(out) == 4096
    assert logs.parse_block_size(out) == 256
    assert "dropped" not in out
    env = {}
    server_sets.write_logging_config(env)
    assert json.loads(open(env["VLLM_LOGGING_CONFIG_PATH"]).read()) == logs.plugin_logging_config()
    kept = {"VLLM_LOGGING_CONFIG_PATH": "/mine.json"}
    server_sets.write_logging_config(kept)
    assert kept == {"VLLM_LOGGING_CONFIG_PATH": "/mine.json"}


# ------------------------------------------------------------------------------------------------
# tables


def test_cells_and_table_formatting():
    assert report.cell({"median": 0.2125, "p25": 0.2, "p75": 0.25, "n": 5}, report.ms) == "212 [200..250]"
    assert report.cell({"median": 0.2, "p25": 0.2, "p75": 0.2, "n": 1}, report.ms) == "200"
    assert report.cell({"median": None, "p25": None, "p75": None, "n": 0}, report.ms) == "-"
    assert report.cell(None, report.ms) == "-"
    assert report.mib(2 * 2**20) == "2.00" and report.num(None) == "-"
    text = report.format_table(["metric", "a", "bb"], [["x", "1", "22"], ["long name", "333", "4"]])
    lines = text.splitlines()
    assert lines[0] == "metric       a  bb" and lines[1] == "---------  ---  --"
    assert lines[2] == "x            1  22" and lines[3] == "long name  333   4"
    md = report.format_table(["metric", "a"], [["x", "1"]], markdown=True)
    assert md.splitlines() == ["| metric | a |", "|---|---|", "| x | 1 |"]


# ------------------------------------------------------------------------------------------------
# a whole run against two stand-in servers


def test_cli_argument_checks(capsys):
    two_urls = ["--url", "http://a", "--url", "http://b", "--model", "m"]
    bad_argvs = [[], ["--url", "http://x"], ["--url", "http://x", "--launch", "d", "--model", "m"],
                 ["--launch", "d", "--additional-config", "[1]"], ["--launch", "d", "--repeat", "0"],
                 ["--launch", "d", "--in-flight", "1,0"], two_urls + ["--label", "x"],
                 two_urls + ["--label", "x", "--label", "x"]]  # fmt: skip
    for argv in bad_argvs:
        with pytest.raises(SystemExit):
            cli_args.parse_args(argv)
    args = cli_args.parse_args(["--launch", "d", "--server-arg=--load-format dummy", "--server-arg=--no-enforce-eager"])
    assert args.policies == ["aligned", "request_boundaries"] and args.floor is None
    assert args.repeat == 5 and args.in_flight == [2]
    assert cli_args.split_server_args(args.server_arg) == ["--load-format", "dummy", "--no-enforce-eager"]
    args = cli_args.parse_args(["--launch", "d", "--turn1-only", "-T", "6", "-C", "1,8"])
    assert args.turns == 1 and args.in_flight == [1, 8]
    variant = 'fast={"policy": "request_boundaries", "prompt_checkpoints": false}'
    args = cli_args.parse_args(["--launch", "d", "--variant", variant])
    assert args.policies == ["aligned", "request_boundaries", "fast"]
    assert args.sections["fast"] == {"policy": "request_boundaries", "prompt_checkpoints": False}
    for bad in ("fast=[1]", "fast={", 'aligned={"policy": "auto"}', '={"policy": "auto"}'):
        with pytest.raises(SystemExit):
            cli_args.parse_args(["--launch", "d", "--variant", bad])
    unit = ["--variant", 'unit16={"policy": "aligned"}', "--variant-arg", "unit16=--prefix-match-unit 16"]
    assert cli_args.parse_args(["--launch", "d", *unit]).label_args == {"unit16": ["--prefix-match-unit", "16"]}
    for bad in ("nope=--x 1", "unit16=", "unit16"):  # unknown label, no flags
        with pytest.raises(SystemExit):
            cli_args.parse_args(["--launch", "d", *unit[:2], "--variant-arg", bad])
    assert cli_args.parse_args(["--url", "http://a", "--model", "m"]).label == ["server"]
    assert cli.main(["--url", "http://127.0.0.1:9", "--model", "m"]) == 2  # no vocab size
    assert "--vocab-size" in capsys.readouterr().err


def test_the_targets_judge_the_plugin_under_either_policy_name():
    assert stats.plugin_label(["aligned", "request_boundaries"]) == "request_boundaries"
    assert stats.plugin_label(["aligned", "auto"]) == "auto"
    assert stats.plugin_label(["auto", "request_boundaries"]) == "request_boundaries"
    assert stats.plugin_label(["aligned", "unit16"]) is None


@pytest.mark.parametrize("plugin", ["request_boundaries", "auto"])
def test_interleaved_rounds_against_stand_in_servers(tmp_path, capsys, plugin):
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "result.json"
    with serve(CompletionsStub) as a, serve(CompletionsStub) as b:
        argv = ["--url", a, "--url", b, "--label", "aligned", "--label", plugin, "--model", "m",
                "--vocab-size", "1024", "-N", "2", "-T", "3", "-S", "40", "-U", "8", "-A", "4", "-C", "1,2",
                "--repeat", "3", "--floor", "--block-size", "16", "--out-json", str(out_json),
                "--plot", str(tmp_path / "plot.png")]  # fmt: skip
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
        argv = ["--url", a, "--url", b, "--label", "aligned", "--label", "request_boundaries", "--model", "m",
                "--vocab-size", "1024", "-N", "2", "-T", "2", "-S", "40", "-U", "8", "-A", "4", "-C", "1,2",
                "--repeat", "3", "--time-budget", "50", "--out-json", str(out_json),
                "--plot", str(tmp_path / "plot.png")]  # fmt: skip
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
        settings = run_settings.Settings(workload=_workload(conversations=1, turns=2, system_tokens=20), labels=labels,
                                   in_flight=[1], repeat=2, run_salt="t", floor_label="aligned", warmup=1,
                                   stats_log_interval=0)  # fmt: skip
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
    workload = _workload(mode=mode, system_tokens=32, user_tokens=8)
    slot.warm_up(traffic.Target("stock", "http://x", "m"), workload, "salt", 3, timeout=5)
    assert sorted(sent) == [(c, t) for c in (-3, -2, -1) for t in (1, 2)]


def test_turn1_only_run_reports_the_first_turn_tax_only(tmp_path, capsys):
    CompletionsStub.seen, CompletionsStub.requests = {}, []
    out_json = tmp_path / "turn1.json"
    with serve(CompletionsStub) as a, serve(CompletionsStub) as b:
        argv = ["--url", a, "--url", b, "--label", "aligned", "--label", "request_boundaries", "--model", "m",
                "--vocab-size", "1024", "--turn1-only", "-N", "3", "-S", "40", "-U", "8", "-A", "2", "-C", "1",
                "--repeat", "2", "--floor", "--block-size", "16", "--markdown",
                "--out-json", str(out_json)]  # fmt: skip
        assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| TTFT p50 turn 1 (fresh prompt) / stock |" in printed and "| TTFT p50 ms, turn 1 |" in printed
    assert "turns >= 2" not in printed and "targets (" not in printed and "all turns" not in printed
    result = json.loads(out_json.read_text())
    assert result["workload"]["turns"] == 1 and result["workload"]["shared_system"] is False
    assert {r["phase"] for r in result["records"]} == {"conversation"}  # no floor without a turn 2
    assert all(r["cached_tokens"] == 0 for r in result["records"])  # nothing is shared, nothing reused
    assert result["levels"][0]["summary"]["ratios"]["request_boundaries"]["turn1_ttft_vs_stock"]["n"] == 2


def test_the_old_script_path_runs_bc_bench():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_turn.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: bc-bench")


# ------------------------------------------------------------------------------------------------
# model directories


@pytest.mark.parametrize("variant, architecture", [("dflash", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel")])
def test_write_dflash_drafter_sized_to_the_real_size_target(tmp_path, variant, architecture):
    from safetensors import safe_open

    target, drafter = tmp_path / "q24", tmp_path / "drafter"
    argv = ["--write-model", str(target), "--arch", "qwen3_next_80b_24l", "--write-dflash-drafter", str(drafter),
            "--dflash-variant", variant]  # fmt: skip
    assert cli.main(argv) == 0
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["vocab_size"]) == (2048, 16, 2, 256, 151936)  # fmt: skip
    with safe_open(str(drafter / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("layers.0.self_attn.q_proj.weight").get_shape() == [16 * 256, 2048]
    with pytest.raises(SystemExit):
        cli_args.parse_args(["--url", "http://x", "--label", "a", "--model", "m", "--write-dflash-drafter", "d"])


@pytest.mark.parametrize(
    "arch, architecture, vocab",
    [
        ("qwen3_next_80b_12l", "Qwen3NextForCausalLM", 151936),
        ("qwen3_next_80b_24l", "Qwen3NextForCausalLM", 151936),
        ("qwen3_next_80b_24l_mtp", "Qwen3NextForCausalLM", 151936),
        ("glm5_next_flash_dense", "Glm5NextForCausalLM", 154880),
        ("glm5_next_flash_dense_mtp", "Glm5NextForCausalLM", 154880),
        ("qwen35_9b", "Qwen3_5ForCausalLM", 248320),
    ],
)
def test_write_model_real_size_config_and_full_vocab_tokenizer(tmp_path, arch, architecture, vocab):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / arch
    assert cli.main(["--write-model", str(out), "--arch", arch]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [architecture]
    assert cli.model_vocab_size(str(out)) == vocab
    if arch.startswith("glm5_next_flash_dense"):  # vLLM's own reader (transformers' has no text-only auto class)
        from vllm.transformers_utils.config import get_config

        config = get_config(str(out), trust_remote_code=False).get_text_config()
        assert config.num_nextn_predict_layers == (1 if arch.endswith("_mtp") else 0)
        raw = raw.get("text_config", raw)
        assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (4096, 45, vocab)
        assert config.layer_types.count("linear_attention") == 34
        assert set(config.mlp_layer_types) == {"dense"}
        assert (config.linear_num_heads, config.linear_head_dim, config.kv_lora_rank) == (64, 128, 512)
        assert (config.index_topk, config.index_kpool, config.num_attention_heads) == (2048, 16, 64)
        assert raw["mhc"] is False and raw["mla_use_nope"] is True
        return
    config = AutoConfig.from_pretrained(str(out))
    assert config.vocab_size == vocab
    if arch.startswith("qwen3_next_80b"):
        layers, experts = (12, 512) if arch == "qwen3_next_80b_12l" else (24, 64)
        assert raw.get("num_nextn_predict_layers", 0) == (1 if arch.endswith("_mtp") else 0)
        assert (config.hidden_size, config.num_hidden_layers) == (2048, layers)
        assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 2, 256)
        assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
        dims = (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim)
        assert dims == (128, 128, 4)
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (experts, 10, 512)
        assert config.shared_expert_intermediate_size == 512
    else:
        assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (4096, 32, 12288)
        assert config.layer_types.count("full_attention") == 8
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == vocab
    ids = [4, 5, vocab - 1, 1000, vocab // 2]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids


# ------------------------------------------------------------------------------------------------
# end to end: two real CPU servers of the tiny model, up at once, two interleaved rounds


@pytest.mark.slow
def test_end_to_end_two_rounds_on_cpu_servers(tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    argv = [
        "--launch", str(tiny_model_dir), "--repeat", "2", "--conversations", "2", "--turns", "2",
        "-S", "64", "-U", "16", "-A", "8", "--in-flight", "1",
        "--log-dir", str(tmp_path / "logs"), "--out-json", str(out_json),
        "--startup-timeout", "300", "--warmup", "0",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "cached-token ratio" in printed and "targets (" in printed
    result = json.loads(out_json.read_text())
    assert result["block_size"] == 256 and result["block_size_source"].startswith("server log")
    (level,) = result["levels"]
    assert [rd["order"] for rd in level["rounds"]] == [["aligned", "request_boundaries"],
                                                       ["request_boundaries", "aligned"]]  # fmt: skip
    records = result["records"]

    def conv(policy):
        return [r for r in records if r["policy"] == policy and r["phase"] == "conversation"]

    for policy in ("aligned", "request_boundaries"):
        rows = conv(policy)
        assert len(rows) == 2 * 2 * 2 and all(r["error"] is None for r in rows)
        assert all(r["cached_tokens"] is not None and r["ttft_s"] > 0 for r in rows)
        assert all(r["completion_tokens"] == 8 and len(r["answer_ids"]) == 8 for r in rows)
        assert all(r["prompt_tokens"] == 64 + 16 + (r["turn"] - 1) * 24 for r in rows)
    # stock hits only on the 256-token block grid: every prompt here is shorter than one block
    assert all(r["cached_tokens"] % 256 == 0 for r in conv("aligned"))
    # the plugin resumes exactly at the previous turn's committed length, in every round
    later = [r for r in conv("request_boundaries") if r["turn"] == 2]
    assert len(later) == 4 and all(r["cached_tokens"] == r["boundary"] == 64 + 16 + 8 - 1 for r in later)
    summ = level["summary"]
    hits = summ["policies"]["request_boundaries"]["exact_hits"]
    assert hits == {"median": 2, "p25": 2, "p75": 2, "n": 2}
    assert summ["policies"]["aligned"]["exact_hits"]["median"] == 0
    for key in ("ttft_all_p50_s", "ttft_turn1_p90_s", "ttft_cont_p99_s", "output_throughput_tok_s",
                "prefill_tokens", "cached_ratio"):  # fmt: skip
        s = summ["policies"]["request_boundaries"][key]
        assert s["n"] == 2 and s["p25"] <= s["median"] <= s["p75"]
    peak = summ["policies"]["request_boundaries"]["peak_bytes_retained"]
    assert peak["n"] == 2 and peak["median"] > 0
    added = summ["policies"]["request_boundaries"]["retained_bytes_added"]
    assert added["n"] == 2 and 0 < added["median"] <= peak["median"]
    assert summ["policies"]["aligned"]["peak_bytes_retained"]["n"] == 0
    ratio = summ["ratios"]["request_boundaries"]["turn1_ttft_vs_stock"]
    assert ratio["n"] == 2 and ratio["median"] > 0
    # floor: primed prefix L0 = one block is cached exactly, U + 1 tokens computed, in both rounds
    floor = [r for r in records if r["phase"] == "floor"]
    assert len(floor) == 4 and all(r["policy"] == "aligned" for r in floor)
    assert all(r["boundary"] == 256 and r["cached_tokens"] == 256 and r["prompt_tokens"] == 273 for r in floor)
    assert summ["floor"]["ttft_p50_s"]["n"] == 2
    servers = result["servers"]
    assert all(s["exit_codes"] and s["exit_codes"][0] is not None for s in servers.values())
    assert servers["request_boundaries"]["boundary_stats"]["hits"] >= 4


@pytest.mark.slow
def test_chat_shared_system_first_turns_on_cpu_servers(tiny_model_dir, tmp_path, capsys):
    """``--mode chat --turn1-only``: one-turn chat conversations sharing a system message shorter
    than one block (150 words + the template's 3 tokens < 256): the plugin restores the system
    block on every first turn after the first, stock caches nothing (its grid has no full block)."""
    out_json = tmp_path / "chat.json"
    argv = [
        "--launch", str(tiny_model_dir), "--mode", "chat", "--turn1-only", "--repeat", "1",
        "-N", "3", "-S", "150", "-U", "20", "-A", "4", "--in-flight", "1",
        "--log-dir", str(tmp_path / "logs"), "--out-json", str(out_json),
        "--startup-timeout", "300", "--warmup", "0",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["block_size"] == 256 and result["workload"]["mode"] == "chat"

    def firsts(policy):
        rows = [r for r in result["records"] if r["policy"] == policy and r["phase"] == "conversation"]
        assert len(rows) == 3 and all(r["turn"] == 1 and r["error"] is None for r in rows)
        return [r["cached_tokens"] for r in sorted(rows, key=lambda r: r["conversation"])]

    system_block = 150 + 3  # "<s> system" + 150 words + "</s>", one token each on the tiny tokenizer
    assert firsts("request_boundaries") == [0, system_block, system_block]
    assert firsts("aligned") == [0, 0, 0]
    summary = result["levels"][0]["summary"]
    assert summary["turn1_cached_median"] == {"aligned": 0, "request_boundaries": system_block}
    assert summary["lost_hits"]["request_boundaries"] == {"requests": 0, "tokens_lost": 0, "compared": 3}
    assert "turn-1 cached tokens: median per policy" in printed
    assert f"aligned 0, request_boundaries {system_block}" in printed


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
    settings = run_settings.Settings(workload=_workload(conversations=1, turns=2, system_tokens=20), labels=labels,
                               in_flight=[1], repeat=2, run_salt="t", warmup=0, stats_log_interval=0,
                               time_budget_s=1.0)  # fmt: skip
    spec = server_sets.LaunchSpec(model_dir="m", model_name="m", sections={p: {"policy": p} for p in labels},
                             log_dir=tmp_path, one_by_one=True, startup_timeout=60.0)  # fmt: skip
    started = time.monotonic()
    result = runner.run_benchmark(settings, server_sets.LaunchedServers(settings, spec))
    assert time.monotonic() - started < 20  # the budget (1 s) plus the stop's grace, not the 60 s timeout
    assert result["levels"] == [] and result["stopped_early"]["phase"] == "server start"
    assert result["stopped_early"]["label"] == "aligned" and len(processes) == 1  # the second never started
    assert processes[0].poll() is not None  # stopped, not left running
