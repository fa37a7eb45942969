"""Tests of the pure parts of ``bc-bench`` (``bc_tools/bench/``), no server: the statistics
(``stats``: percentiles, spreads, per-policy summaries, round ratios and targets), the workload
(``workload``: seeded plans, prompts across turns, floor prompts), the server-log parsing (``logs``),
the tables (``report``) and the command line (``cli_args``, ``cli``, the old script path).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from multi_turn_bench import BLOCK_LINE, STATS_LINE, small_workload

from bc_tools.bench import cli, cli_args, logs, report, server_sets, stats
from bc_tools.bench import workload as wl
from bc_tools.bench.stats import RequestRecord

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
    w = small_workload()
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
    assert wl.make_plans(small_workload(conversations=5))[:3] == plans
    other = wl.make_plans(small_workload(seed=8))
    assert other[0].system_ids != plans[0].system_ids and other[0].user_turns != plans[0].user_turns
    assert wl.make_plans(small_workload(system_tokens=0))[0].system_ids == ()
    with pytest.raises(ValueError):
        wl.draw_ids(random.Random(0), 3, 4)


def test_turn1_only_workload_shares_nothing():
    w = small_workload(turns=1, shared_system=False, conversations=4)
    plans = wl.make_plans(w)
    assert all(len(p.user_turns) == 1 and len(p.system_ids) == 50 for p in plans)
    firsts = [wl.first_prompt(p) for p in plans]
    assert len({tuple(f[:1]) for f in firsts}) > 1  # no shared prefix between conversations
    assert all(len(f) == 60 for f in firsts)
    assert w.timed_requests(labels=2, floor=True) == 2 * 4  # one turn: no floor requests
    assert w.max_prompt_tokens() == 60


def test_in_flight_levels_drive_at_least_that_many_conversations():
    w = small_workload(conversations=4)
    assert w.at_in_flight(1) == small_workload(conversations=4, concurrency=1)
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
    w = small_workload(conversations=1)
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
# command line


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


def test_the_old_script_path_runs_bc_bench():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_turn.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: bc-bench")
