"""What ``bc-demo`` prints from its runs: the table, its legend, a verdict and a counter line.

Contract: ``format_table`` renders one row per turn: the prompt length, the exact boundary the
turn could resume from, ``cached_tokens`` and streaming TTFT per policy, and per policy what the
comparison with the cold control measured: the first answer token's logprob delta (the largest
|difference| over the top-2 candidates both runs report) and, if the greedy answers part, the
token index where they part and the cold run's top-2 logprob gap there (``LEGEND`` explains the
columns). bf16 GDN kernels make two correct runs part at near-ties (a gap of a few hundredths); a
wrong restore shows as a first-token delta above ``NOISE_BOUND`` or a parting where the cold run's
top two are further apart. ``verdict`` judges one policy's column from the table's own data;
``counter_line`` sets the server's hit and miss counters (``/metrics`` after the last request)
beside the table, and says why the plugin's periodic ``boundary_checkpoints: hits=...`` log line
(every ``stats_log_interval_s``, only during engine steps) may lag behind them.
"""

from __future__ import annotations

from bc_tools.bench.demo_conversation import COMPARE_LOGPROBS, TurnResult

POLICY_LABELS = {"request_boundaries": "plugin", "aligned": "stock"}
NOISE_BOUND = 0.1
"""Logprob difference (nats) up to which the demo calls a first-token delta bf16 noise and a
parting from the cold control a near-tie (the cold run's top-2 gap there). Two correct runs of the
tiny random-weight model differ by a few hundredths; a restore wrong by one token of state moved the
first token's logprobs by 0.7-1.5 on the CPU engine (``bench/probes.py``, negative controls)."""
STATS_LOG_INTERVAL_S = 30.0  # the plugin's default stats_log_interval_s (settings.BoundaryConfig)


def restored_at_boundary(results: list[TurnResult]) -> list[TurnResult]:
    """The later turns whose ``cached_tokens`` reached their boundary (what the table shows as hits)."""
    return [r for r in results if r.turn > 1 and r.cached_tokens is not None and r.cached_tokens >= r.boundary]


def _by_name(counts: dict[str, float]) -> str:
    return ", ".join(f"{name} {n:.0f}" for name, n in sorted(counts.items()) if n)


def counter_line(
    label: str,
    results: list[TurnResult],
    counters: dict[str, dict[str, float]] | None,
    log_stats: dict[str, int] | None = None,
    log_interval_s: float = STATS_LOG_INTERVAL_S,
) -> str:
    """The server's own hit and miss counters (read from ``/metrics`` after the last request)
    beside the table's count, each labelled with what it counts; and, where the server log's last
    periodic ``boundary_checkpoints: hits=...`` line says otherwise, why it lags."""
    table_hits = len(restored_at_boundary(results))
    head = f"server counters ({label}, /metrics after its last request):"
    if counters is None:
        return f"{head} not available; the table shows {table_hits} turns restored at their boundary"
    hits = sum(counters["hits"].values())
    misses = sum(counters["misses"].values())
    kinds = _by_name(counters["hits"])
    line = f"{head} hits={hits:.0f}" + (f" ({kinds})" if kinds else "")
    if hits == table_hits:
        line += f", the {table_hits} turns the table shows restored at their boundary"
    else:
        line += (f" requests restored a checkpoint (any length, any request); the table shows {table_hits} "
                 f"turns restored exactly at their boundary")  # fmt: skip
    expected_misses = len(results) + 2  # turn 1, the warm-up request and one cold control per turn
    line += f"; misses={misses:.0f}"
    if misses == expected_misses:
        line += f" (turn 1, the warm-up and the {len(results)} cold controls: fresh cache_salts)"
    elif counters["misses"]:
        line += f" ({_by_name(counters['misses'])})"
    logged = None if log_stats is None else log_stats.get("hits")
    if logged is not None and logged != hits:
        line += (f"\n  (the server log's last periodic stats line says hits={logged}: the plugin writes it every "
                 f"stats_log_interval_s = {log_interval_s:g} s and only while the engine steps, so it was "
                 f"written before the last requests; /metrics is updated every step)")  # fmt: skip
    return line


def turn_span(turns: list[int]) -> str:
    """``[2, 3, 4, 6]`` -> ``"2-4, 6"``."""
    spans: list[list[int]] = []
    for t in sorted(turns):
        if spans and t == spans[-1][1] + 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def verdict(label: str, results: list[TurnResult], *, expects_boundary: bool = True, noise: float = NOISE_BOUND) -> str:
    """One line judging a column of the table from its own data: did every later turn restore at
    its boundary (``cached_tokens >= boundary``), are the first-token deltas within ``noise``, and
    does any answer part from its cold control where that was not a near-tie (cold top-2 gap above
    ``noise``). ``expects_boundary=False`` (stock) counts the turns restored at their boundary
    instead of naming the others."""
    clauses = []
    later = [r for r in results if r.turn > 1]
    restored = restored_at_boundary(results)
    missed = [r for r in later if r not in restored]
    if not later:
        clauses.append("a single turn: nothing to restore")
    elif not expects_boundary:
        clauses.append(f"{len(restored)} of {len(later)} later turns restored at their boundary "
                       "(stock resumes on its block grid)")  # fmt: skip
    elif not missed:
        clauses.append(f"every later turn ({turn_span([r.turn for r in later])}) restored at its boundary")
    else:
        turns, their = ("turn", "its") if len(missed) == 1 else ("turns", "their")
        cached = ", ".join(f"{_fmt_int(r.cached_tokens)}/{r.boundary}" for r in missed)
        clauses.append(f"{turns} {turn_span([r.turn for r in missed])} did not restore at {their} boundary "
                       f"(cached/boundary {cached})")  # fmt: skip
    deltas = [(r.first_token_delta, r.turn) for r in results if r.first_token_delta is not None]
    if not deltas:
        clauses.append("no first-token logprobs to compare")
    else:
        worst, turn = max(deltas)
        if worst <= noise:
            clauses.append(f"first-token deltas within bf16 noise (largest {worst:.4f}, turn {turn}; bound {noise:g})")
        else:
            clauses.append(f"largest first-token delta {worst:.4f} (turn {turn}) is above bf16 noise (bound {noise:g})")
    wide = [r for r in results if r.parts_at is not None and (r.cold_gap is None or r.cold_gap > noise)]
    if wide:
        where = ", ".join(f"turn {r.turn} at token {r.parts_at} (gap "
                          f"{'n/a' if r.cold_gap is None else f'{r.cold_gap:.3f}'})" for r in wide)  # fmt: skip
        clauses.append(f"answers part from the cold control off a near-tie: {where}")
    elif any(r.parts_at is not None for r in results):
        clauses.append("answers part from the cold control only at near-ties")
    return f"verdict ({label}): " + "; ".join(clauses)


def _fmt_int(value: int | None) -> str:
    return "-" if value is None else str(value)


def format_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _fmt_delta(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _fmt_parts(result: TurnResult, noise: float = NOISE_BOUND) -> str:
    """How the answer compares with the cold control's: ``same``, or ``parts@I (near-tie, gap G)``
    / ``parts@I (gap G, not a near-tie)`` / ``parts@I (gap n/a)`` (the cold run's top-2 gap at
    answer token I, where the greedy answers part)."""
    if result.parts_at is None:
        return "same"
    if result.cold_gap is None:
        return f"parts@{result.parts_at} (gap n/a)"
    if result.cold_gap <= noise:
        return f"parts@{result.parts_at} (near-tie, gap {result.cold_gap:.3f})"
    return f"parts@{result.parts_at} (gap {result.cold_gap:.3f}, not a near-tie)"


LEGEND = (
    "Each turn is also sent to the same server under a fresh cache_salt (a cold control, computed from scratch).\n"
    "dlp1 = largest |logprob difference| of the first answer token's top-{k} candidates against the cold control.\n"
    "answer vs cold: 'same' = identical greedy answers; 'parts@I (near-tie, gap G)' = the answers part at answer\n"
    "token I, where the cold run's top two candidates were only G apart (<= {noise:g}): bf16 GDN kernels flip such\n"
    "near-ties in two correct runs, so this is not a failure. A wrong restore shows as a dlp1 above {noise:g} or as\n"
    "'parts@I (gap G, not a near-tie)'; 'gap n/a': the cold answer ended there or has no logprobs."
).format(k=COMPARE_LOGPROBS, noise=NOISE_BOUND)


def format_table(policies: list[str], results: dict[str, list[TurnResult]]) -> str:
    """One row per turn: prompt, boundary, cached and TTFT per policy, and what the comparison
    with the cold control measured (first-token logprob delta, whether and where the answers part)."""
    labels = [POLICY_LABELS.get(p, p) for p in policies]
    header = ["turn", "prompt", "boundary"]
    header += [f"cached {label}" for label in labels]
    header += [f"TTFT ms {label}" for label in labels]
    header += [f"dlp1 {label}" for label in labels]
    header += [f"answer vs cold {label}" for label in labels]
    rows = []
    first = results[policies[0]]
    for i, base in enumerate(first):
        per = [results[p][i] for p in policies]
        row = [str(base.turn), str(base.prompt_tokens), str(base.boundary)]
        row += [_fmt_int(r.cached_tokens) for r in per]
        row += [format_ms(r.ttft_s) for r in per]
        row += [_fmt_delta(r.first_token_delta) for r in per]
        row += [_fmt_parts(r) for r in per]
        rows.append(row)
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
