"""Fast tests of the bench exactness criteria (``bench.probes``: logprob deviations, divergence,
bound calibration per prompt length, reference pairs, probe failures, ``ProbeRow`` JSON form) on
hand-built answers, plus readers of recorded results: ``runner.answer_variety``,
``logs.kv_pool_bytes`` and ``logs.graph_capture``. No server, no vLLM engine."""

from __future__ import annotations

import json
import math

import pytest

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
    from bc_tools.bench.probes import MARGIN, calibrate, calibrate_by_length, probe_failures
    from bc_tools.bench.reference_pairs import pairs_by_length

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
    from bc_tools.bench.probes import calibrate_by_length
    from bc_tools.bench.reference_pairs import decode_path_pairs, pairs_by_length

    rows = [_probe_row(prompt_len=145), _probe_row(prompt_len=257, resend_cached=256)]
    rows[0].cold_decoded = rows[0].cold
    pairs = pairs_by_length(rows, pairs=lambda mine, stock: decode_path_pairs(mine))  # none at 257
    with pytest.raises(ValueError, match="prompt length 257"):
        calibrate_by_length(pairs)
    with pytest.raises(KeyError, match="prompt length 999"):
        calibrate_by_length(pairs_by_length(rows)).at(999)


def test_pairs_by_length_pairs_plugin_and_stock_rows_of_one_length():
    from bc_tools.bench.reference_pairs import pairs_by_length, reference_pairs

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
    from bc_tools.bench.reference_pairs import reference_pairs

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


def test_graph_capture_reads_the_last_capture():
    from bc_tools.bench.logs import graph_capture

    log = ("INFO [gpu_model_runner.py:6582] Graph capturing finished in 9 secs, took 0.31 GiB\n"
           "INFO [gpu_model_runner.py:6582] Graph capturing finished in 14 secs, took 0.52 GiB\n")  # fmt: skip
    assert graph_capture(log) == {"seconds": 14.0, "gib": 0.52}
    assert graph_capture("Available KV cache memory: 28.04 GiB") is None


def test_continuations_are_judged_against_decode_path_rounding_resends_are_not():
    from bc_tools.bench.probes import calibrate, probe_failures
    from bc_tools.bench.reference_pairs import decode_path_pairs, reference_pairs

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
