"""Fast tests of bc-bench's speculative decoding metrics (``bench/{slot_metrics,runner,stats,report}.py``): the
``/metrics`` counters read around each slot, the mean acceptance length, decode throughput, their
spreads over rounds and ratios to stock, and the report rows and target they add. No vLLM engine."""

from __future__ import annotations

import threading

import pytest
from http_stub import CompletionsStub, serve

from bc_tools.bench import report, run_settings, runner, server_sets, slot_metrics, stats, traffic
from bc_tools.bench import workload as wl
from bc_tools.bench.stats import PLUGIN_POLICY, STOCK_POLICY, RequestRecord

# What vLLM 0.32.0 exposes on /metrics (prometheus_client text format, one label set per engine),
# trimmed: counters carry the `_total` suffix, `_created` gauges and the per-position acceptance
# counters sit beside them.
COMMON = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="qwen3-next"} 3.0
vllm:num_preemptions_total{engine="1",model_name="qwen3-next"} 2.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="qwen3-next"} 1.7961021129043827e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="qwen3-next"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="qwen3-next"} 17.0
"""
SPEC = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="qwen3-next"} 120.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="qwen3-next"} 80.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="qwen3-next"} 360.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="qwen3-next"} 240.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="qwen3-next"} 210.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="qwen3-next"} 140.0
# HELP vllm:spec_decode_num_accepted_tokens_created Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_created gauge
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="qwen3-next"} 1.7961021129043827e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen3-next",position="0"} 110.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen3-next",position="1"} 100.0
"""


# ------------------------------------------------------------------------------------------------
# counters on /metrics


def test_parse_counters_sums_engines_and_skips_neighbouring_series():
    counters = slot_metrics.parse_counters(COMMON + SPEC, slot_metrics.SLOT_COUNTERS)
    assert counters == {"preemptions": 5, "spec_drafts": 200, "spec_accepted_tokens": 350,
                        "capture_copies": None, "capture_copy_us": None, "tokens_beyond_stock": None,
                        "stock_tokens_lost": None, "prompts_waited": None,
                        "shared_hits_released": None, "rows_fit_to_graph": None}  # fmt: skip


def test_parse_counters_without_speculation_or_endpoint():
    assert slot_metrics.parse_counters(COMMON, slot_metrics.SLOT_COUNTERS) == {
        "preemptions": 5, "spec_drafts": None, "spec_accepted_tokens": None, "capture_copies": None,
        "capture_copy_us": None, "tokens_beyond_stock": None, "stock_tokens_lost": None,
        "prompts_waited": None, "shared_hits_released": None, "rows_fit_to_graph": None}  # fmt: skip
    assert slot_metrics.parse_counters("", slot_metrics.SLOT_COUNTERS) == dict.fromkeys(slot_metrics.SLOT_COUNTERS)
    # a counter exposed under its bare name (no `_total`) counts too
    bare = 'vllm:spec_decode_num_drafts{engine="0"} 7\n'
    assert slot_metrics.parse_counters(bare, {"d": "vllm:spec_decode_num_drafts"}) == {"d": 7}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the capture-copy histogram, its time in microseconds
        ('vllm:boundary_checkpoint_capture_copy_seconds_bucket{engine="0",le="0.0001"} 3.0\n'
         'vllm:boundary_checkpoint_capture_copy_seconds_count{engine="0"} 12.0\n'
         'vllm:boundary_checkpoint_capture_copy_seconds_sum{engine="0"} 0.0031415\n',
         {"capture_copies": 12, "capture_copy_us": 3142}),
        # the plugin's own estimate against stock (a `_created` series beside it does not count)
        ('vllm:boundary_checkpoint_tokens_beyond_stock_total{engine="0"} 640.0\n'
         'vllm:boundary_checkpoint_stock_tokens_lost_total{engine="0"} 96.0\n'
         'vllm:boundary_checkpoint_stock_tokens_lost_created{engine="0"} 1.79e+09\n',
         {"tokens_beyond_stock": 640, "stock_tokens_lost": 96}),
    ],
)  # fmt: skip
def test_parse_counters_reads_the_plugins_series(text, expected):
    counters = slot_metrics.parse_counters(text, slot_metrics.SLOT_COUNTERS)
    assert {key: counters[key] for key in expected} == expected


def test_counter_deltas_and_slot_counters():
    before = {"preemptions": 5, "spec_drafts": 200, "spec_accepted_tokens": 350}
    after = {"preemptions": 6, "spec_drafts": 240, "spec_accepted_tokens": 420}
    deltas = slot_metrics.counter_deltas(before, after)
    assert deltas == {"preemptions": 1, "spec_drafts": 40, "spec_accepted_tokens": 70}
    out = slot_metrics.slot_counters(deltas)
    assert out["mean_acceptance_length"] == pytest.approx(1 + 70 / 40)  # 2.75 tokens per drafting step
    assert out["preemptions"] == 1 and out["spec_drafts"] == 40
    # no speculation, an unknown scrape, a slot without a drafting step: no acceptance
    none = slot_metrics.slot_counters(
        slot_metrics.counter_deltas({"preemptions": 0}, {"preemptions": 2, "spec_drafts": None})
    )
    assert none["preemptions"] == 2 and none["mean_acceptance_length"] is None
    assert slot_metrics.counter_deltas({"preemptions": None}, {"preemptions": 3}) == {"preemptions": None}
    assert stats.acceptance_length(0, 0) is None and stats.acceptance_length(None, None) is None


class SpecMetricsStub(CompletionsStub):
    """The completions stub plus a ``/metrics`` whose spec counters grow with each completion: 2
    drafting steps and 3 accepted tokens per request (so 2.5 tokens per drafting step)."""

    completions = 0
    lock = threading.Lock()

    def do_GET(self):
        if self.path != "/metrics":
            return super().do_GET()
        n = type(self).completions
        labels = '{engine="0",model_name="m"}'
        text = (f"vllm:num_preemptions_total{labels} 4.0\n"
                f"vllm:spec_decode_num_drafts_total{labels} {2.0 * n + 10}\n"
                f"vllm:spec_decode_num_accepted_tokens_total{labels} {3.0 * n + 99}\n")  # fmt: skip
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        super().do_POST()
        with type(self).lock:
            type(self).completions += 1


def test_run_slot_reports_the_slots_counter_growth():
    CompletionsStub.seen, CompletionsStub.requests, SpecMetricsStub.completions = {}, [], 0
    w = wl.Workload(conversations=2, turns=2, system_tokens=20, user_tokens=4, answer_tokens=5, concurrency=1,
                    vocab_size=1024, seed=3)  # fmt: skip
    settings = run_settings.Settings(workload=w, labels=[PLUGIN_POLICY], in_flight=[1], repeat=1, run_salt="t",
                                     warmup=0, stats_log_interval=0)  # fmt: skip
    with serve(SpecMetricsStub) as url:
        servers = server_sets.UrlServers(settings, [traffic.Target(PLUGIN_POLICY, url, "m")])
        progress = traffic.Progress(4)
        try:
            records, summary = runner.run_slot(
                servers, PLUGIN_POLICY, w, wl.make_plans(w), 0, traffic.Clock(), progress
            )
        finally:
            progress.close()
    assert len(records) == 4
    assert (summary["spec_drafts"], summary["spec_accepted_tokens"], summary["preemptions"]) == (8, 12, 0)
    assert summary["mean_acceptance_length"] == pytest.approx(2.5)
    assert summary["decode_throughput_tok_s"] > 0


# ------------------------------------------------------------------------------------------------
# decode throughput, spreads and ratios


def _rec(completion: int, ttft: float | None, latency: float, turn: int = 1) -> RequestRecord:
    return RequestRecord(policy="p", phase="conversation", conversation=0, turn=turn, prompt_tokens=10,
                         cached_tokens=0, completion_tokens=completion, boundary=0, ttft_s=ttft, latency_s=latency,
                         start_s=0.0, end_s=latency)  # fmt: skip


def test_decode_throughput_sums_tokens_after_the_first_over_time_after_the_first():
    records = [_rec(9, 0.5, 1.5), _rec(3, 0.1, 1.1), _rec(1, 0.1, 0.2), _rec(5, None, 1.0)]
    # 8 tokens in 1.0 s and 2 in 1.0 s; the 1-token answer and the one without a TTFT have no decode
    assert stats.decode_throughput(records) == pytest.approx(10 / 2.0)
    records.append(_rec(3, 0.0, 3.0))
    # 2 more tokens in 3.0 s: 12 / 5.0 s, not the mean of per-request rates (8 + 2 + 2/3) / 3 = 3.56
    assert stats.decode_throughput(records) == pytest.approx(12 / 5.0)
    assert records[0].tpot_s == pytest.approx(1.0 / 8)  # tpot is the per-request inverse
    assert records[2].decode_s is None and records[3].decode_s is None
    assert stats.decode_throughput([_rec(1, 0.1, 0.2)]) is None
    assert stats.summarize_policy(records)["decode_throughput_tok_s"] == pytest.approx(12 / 5.0)


def _round(decode: float, acceptance: float | None, throughput: float = 100.0) -> dict:
    """A per-round summary with only the keys ``round_ratios`` reads."""
    return {"prefill_tokens": 100, "prefill_cont_tokens": 50, "output_throughput_tok_s": throughput,
            "ttft_cont_p50_s": 0.1, "ttft_turn1_p50_s": 0.1, "decode_throughput_tok_s": decode,
            "mean_acceptance_length": acceptance}  # fmt: skip


def test_spreads_over_rounds_ratios_and_the_decode_target():
    stock = [_round(100.0, 2.5), _round(110.0, 2.6), _round(90.0, 2.4), _round(100.0, 2.5)]
    plugin = [_round(99.0, 2.5), _round(104.5, 2.6), _round(90.0, 2.52), _round(95.0, 2.5)]
    agg = stats.aggregate(plugin)
    assert agg["mean_acceptance_length"] == {"median": pytest.approx(2.51), "p25": pytest.approx(2.5),
                                             "p75": pytest.approx(2.54), "n": 4}  # fmt: skip
    ratios = [stats.round_ratios({STOCK_POLICY: s, PLUGIN_POLICY: p}, None)[PLUGIN_POLICY]
              for s, p in zip(stock, plugin)]  # fmt: skip
    assert [r["decode_throughput_vs_stock"] for r in ratios] == pytest.approx([0.99, 0.95, 1.0, 0.95])
    assert ratios[2]["acceptance_vs_stock"] == pytest.approx(1.05)
    spread = stats.aggregate(ratios)
    assert spread["decode_throughput_vs_stock"]["median"] == pytest.approx(0.97)
    judged = stats.targets(spread)
    assert judged["decode_throughput_vs_stock"] == {"median": pytest.approx(0.97), "target": 0.98, "passed": False}
    judged = stats.targets(stats.aggregate(ratios[:1] + ratios[2:3]))
    assert judged["decode_throughput_vs_stock"]["passed"] is True  # median 0.995
    # without speculation the acceptance ratio is None and the decode target is not judged
    plain = [stats.round_ratios({STOCK_POLICY: _round(100.0, None), PLUGIN_POLICY: _round(90.0, None)}, None)
             [PLUGIN_POLICY]]  # fmt: skip
    assert plain[0]["acceptance_vs_stock"] is None and plain[0]["decode_throughput_vs_stock"] == pytest.approx(0.9)
    assert set(stats.targets(stats.aggregate(plain))) == set(stats.TARGETS)


# ------------------------------------------------------------------------------------------------
# report


def _result_and_level(acceptance: tuple[float, float] | None) -> tuple[dict, dict]:
    """A two-round result at one level; ``acceptance`` (stock, plugin) per round, or None."""

    def summary(decode: float, accepted: float | None) -> dict:
        return {"requests": 4, "errors": 0, "output_throughput_tok_s": 50.0, "decode_throughput_tok_s": decode,
                "mean_acceptance_length": accepted, "prefill_tokens": 100, "prefill_cont_tokens": 50,
                "ttft_cont_p50_s": 0.1, "ttft_turn1_p50_s": 0.1}  # fmt: skip

    acc = acceptance or (None, None)
    rounds = []
    for scale in (1.0, 1.1):
        policies = {STOCK_POLICY: summary(200.0 * scale, acc[0] and acc[0] * scale),
                    PLUGIN_POLICY: summary(197.0 * scale, acc[1] and acc[1] * scale)}  # fmt: skip
        rounds.append({"policies": policies, "ratios": stats.round_ratios(policies, None)})
    ratios = {PLUGIN_POLICY: stats.aggregate([rd["ratios"][PLUGIN_POLICY] for rd in rounds])}
    level = {"in_flight": 1, "conversations": 2, "rounds": rounds,
             "summary": {"policies": {p: stats.aggregate([rd["policies"][p] for rd in rounds])
                                      for p in (STOCK_POLICY, PLUGIN_POLICY)},
                         "ratios": ratios, "targets": stats.targets(ratios[PLUGIN_POLICY])}}  # fmt: skip
    result = {"policies": [STOCK_POLICY, PLUGIN_POLICY], "workload": {"turns": 2}}
    return result, level


def test_report_rows_and_target_appear_only_with_speculation():
    result, level = _result_and_level((2.0, 2.2))
    table = report.summary_table(result, level)
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert rows["mean acceptance length (tok/draft step)"].split()[-4:] == [
        "2.10", "[2.05..2.15]", "2.31", "[2.26..2.37]"]  # fmt: skip
    assert rows["decode throughput tok/s (after 1st token)"].split()[-4:] == [
        "210.0", "[205.0..215.0]", "206.9", "[201.9..211.8]"]  # fmt: skip
    ratio_rows = {line.split("  ")[0]: line.split("  ")[-1].strip() for line in report.ratio_table(level).splitlines()}
    assert ratio_rows["decode throughput / stock"] == "0.985 [0.985..0.985]"
    assert ratio_rows["mean acceptance length / stock"] == "1.100 [1.100..1.100]"
    targets = report.targets_text(result, level).splitlines()
    assert targets[-1].split() == ["decode", "throughput", "/", "stock", "0.985", "(target", ">=", "0.98)", "PASS"]

    result, level = _result_and_level(None)
    table = report.summary_table(result, level)
    assert "acceptance" not in table and "decode throughput tok/s" in table
    assert "acceptance" not in report.ratio_table(level) and "decode throughput / stock" in report.ratio_table(level)
    assert "decode throughput" not in report.targets_text(result, level)
    assert "output throughput / stock" in report.targets_text(result, level)
