"""Drives the multi-turn benchmark: interleaved rounds of every label at every in-flight level.

Contract:

- ``run_benchmark`` runs, for each in-flight level C, ``repeat`` rounds; round r runs every label
  once, in ``round_order(labels, r)`` (so first place alternates), each with a fresh
  ``cache_salt``: rounds never share cache. A slot (``slot.Slot``) drives ``max(N, C)``
  conversations with C threads; on the floor label (the stock ``aligned``) the floor follows its
  conversations in the same slot.
- Per slot it keeps the records, the growth of vLLM's ``SLOT_COUNTERS`` on ``/metrics`` over the
  slot's conversations (``slot_metrics``) and, for labels other than the stock one whose server log
  it knows, the largest ``bytes_retained`` the plugin's stats lines logged during the slot (it
  waits out ``stats_log_interval_s`` and sends a tiny request so that a last line is logged) and
  that peak minus the last ``bytes_retained`` logged before the slot (what the slot's own
  conversations added: a server that stays up still holds earlier slots' checkpoints, under other
  salts, until it evicts them).
- ``time_budget_s`` (``run_settings.RoundBudget``): a round starts only if it is expected to end
  within the budget; a server still starting when it ends is stopped with the others (in
  ``relaunch`` mode the level under way is lost), so no server outlives a budgeted run that an
  outer time limit would cut. The rounds that ran are summarized as usual, a level with none is
  left out, and the result's ``stopped_early`` says where the budget stopped the run (None if it
  did not), so a run under a hard time limit keeps what it measured.
- The result (a JSON-serialisable dict) holds per level the per-round summaries, their spreads
  (median and p25-p75 over rounds, ``stats.aggregate``), the per-round ratios to the stock label,
  the targets on the medians, per-turn tables pooled over rounds, and every request record; its
  ``servers`` is the server set's ``info`` (with ``sleep_others``, each slot's wake, sleep and
  warm-up seconds: ``server_sets``' contract). Every server the run started is stopped before it
  returns, also on errors and interrupts.
- ``on_round``: called after every round with the result so far (the same layout, ``complete``
  False), so a run killed from outside keeps the rounds it finished; the returned result has
  ``complete`` True.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from bc_tools.bench import logs, stats
from bc_tools.bench.run_settings import BudgetEndedDuringStart, RoundBudget, Settings
from bc_tools.bench.server_sets import LaunchedServers, ServerSet
from bc_tools.bench.slot import Slot
from bc_tools.bench.slot_metrics import counter_deltas, flush_plugin_stats, scrape_counters, slot_counters
from bc_tools.bench.stats import STOCK_POLICY, RequestRecord
from bc_tools.bench.traffic import Clock, Progress
from bc_tools.bench.workload import ConversationPlan, Workload, make_chat_plans, make_plans, round_order


def run_slot(servers: ServerSet, label: str, workload: Workload, plans: list[ConversationPlan], round_index: int,
             clock: Clock, progress: Progress) -> tuple[list[RequestRecord], dict[str, Any]]:  # fmt: skip
    """One label's slot: its records and its summary (with the slot's ``slot_counters`` and peak
    retained bytes)."""
    s = servers.settings
    target = servers.acquire(label, progress)
    try:
        track_memory = label != STOCK_POLICY and bool(target.log_path) and s.stats_log_interval > 0
        offset = logs.log_size(target.log_path)
        startup_log = logs.read_text(target.log_path) if track_memory else ""  # stats so far, KV pool size
        before = logs.parse_boundary_stats(startup_log) if track_memory else None
        counters_before = scrape_counters(target.base_url)
        salt = f"{s.run_salt}-c{workload.concurrency}-r{round_index}-{label}"
        slot = Slot(target, workload, plans, salt, clock=clock, progress=progress, round_index=round_index,
                    timeout=s.request_timeout)  # fmt: skip
        slot.run_conversations()
        counters = counter_deltas(counters_before, scrape_counters(target.base_url))
        if label == s.floor_label and s.block_size and workload.turns >= 2:
            slot.run_floor(s.block_size)
        peak = pool = None
        if track_memory:
            flush_plugin_stats(target, s.stats_log_interval, salt)
            peak = logs.peak_bytes_retained(logs.read_text(target.log_path, offset))
            pool = logs.kv_pool_bytes(startup_log)
    finally:
        servers.release(label)
    summary = stats.summarize_policy(slot.records)
    summary.update(slot_counters(counters))
    summary["peak_bytes_retained"] = peak
    summary["peak_retained_share_of_pool"] = peak / pool if peak is not None and pool else None
    summary["retained_bytes_added"] = None if peak is None else peak - (before or {}).get("bytes_retained", 0)
    return slot.records, summary


def same_answers(records: list[RequestRecord], labels: list[str]) -> dict[str, str]:
    """Per label after the first: conversation requests whose answer equals the first label's
    answer to the same (round, conversation, turn)."""
    key = lambda r: (r.round, r.conversation, r.turn)  # noqa: E731
    conv = [r for r in records if r.phase == "conversation"]
    base = {key(r): r.answer_ids for r in conv if r.policy == labels[0]}
    out = {}
    for label in labels[1:]:
        pairs = [(r.answer_ids, base.get(key(r))) for r in conv if r.policy == label]
        out[label] = f"{sum(1 for a, b in pairs if a == b)}/{len(pairs)}"
    return out


def answer_variety(records: list[RequestRecord], label: str) -> float | None:
    """Median number of distinct token ids per conversation answer of ``label`` (None: no answer).
    Dummy weights tend to answer with one token repeated, and then ``same_answers`` compares
    first tokens only; the report says so."""
    return stats.percentile(
        (len(set(r.answer_ids)) for r in records if r.phase == "conversation" and r.policy == label and r.answer_ids),
        50,
    )


def run_level(servers: ServerSet, workload: Workload, clock: Clock, progress: Progress, budget: RoundBudget,
              after_round: Callable[[dict[str, Any]], None] | None) -> dict[str, Any] | None:  # fmt: skip
    """The rounds at one in-flight level that ``budget`` lets start: the level's part of the result,
    with its records (None if no round started). ``after_round``, if given, gets that part after each
    round."""
    s = servers.settings
    plans = make_chat_plans(workload, s.chat_words) if workload.mode == "chat" else make_plans(workload)
    records: list[RequestRecord] = []
    rounds: list[dict[str, Any]] = []
    for r in range(s.repeat):
        if not budget.allows(workload.concurrency, r):
            progress.write(f"time budget: round {r + 1} of {s.repeat} at {workload.concurrency} in flight would end "
                           f"past {budget.limit_s:g} s (now {budget.stop['at_s']:g} s, longest round "
                           f"{budget.stop['expected_round_s']:g} s): no more rounds")  # fmt: skip
            break
        started = clock.now()
        order = round_order(s.labels, r)
        summaries: dict[str, dict] = {}
        round_records: list[RequestRecord] = []
        for label in order:
            slot_records, summaries[label] = run_slot(servers, label, workload, plans, r, clock, progress)
            round_records += slot_records
        floor = stats.summarize_floor(round_records)
        rounds.append({"round": r, "order": order, "policies": {p: summaries[p] for p in s.labels},
                       "floor": floor, "ratios": stats.round_ratios(summaries, floor),
                       "lost_hits": stats.lost_hits(round_records, s.labels)})  # fmt: skip
        records += round_records
        budget.finished(workload.concurrency, clock.now() - started)
        if after_round is not None:
            after_round(level_result(workload, s.labels, rounds, records))
    return level_result(workload, s.labels, rounds, records) if rounds else None


def level_result(workload: Workload, labels: list[str], rounds: list[dict[str, Any]],
                 records: list[RequestRecord]) -> dict[str, Any]:  # fmt: skip
    """One level's part of the result from its rounds so far (see the module docstring)."""
    ratio_labels = [p for p in labels if p != STOCK_POLICY] if STOCK_POLICY in labels else []
    ratios = {p: stats.aggregate([rd["ratios"][p] for rd in rounds]) for p in ratio_labels}
    floor_rounds = [rd["floor"] for rd in rounds]
    return {
        "in_flight": workload.concurrency,
        "conversations": workload.conversations,
        "rounds": rounds,
        "summary": {
            "policies": {p: stats.aggregate([rd["policies"][p] for rd in rounds]) for p in labels},
            "floor": stats.aggregate(floor_rounds) if any(floor_rounds) else None,
            "ratios": ratios,
            "targets": stats.targets(ratios[judged]) if (judged := stats.plugin_label(ratios)) else None,
            "targets_policy": judged,
            "same_answers": same_answers(records, labels),
            "answer_variety": answer_variety(records, labels[0]),
            "per_turn": {p: stats.per_turn([r for r in records if r.policy == p]) for p in labels},
            "floor_per_turn": stats.per_turn(records, "floor") or None,
            "lost_hits": stats.lost_hits(records, labels),
            "turn1_cached_median": {p: stats.turn1_cached_median(records, p) for p in labels},
        },
        "records": records,
    }


def run_benchmark(settings: Settings, servers: ServerSet,
                  on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Every level, every round; returns the JSON-serialisable result (see the module docstring)."""
    s = settings
    floor = s.floor_label is not None
    total = sum(s.repeat * s.workload.at_in_flight(c).timed_requests(len(s.labels), floor) for c in s.in_flight)
    progress = Progress(total)
    clock = Clock()
    budget = RoundBudget(clock, s.time_budget_s)
    levels: list[dict[str, Any]] = []
    after_round = None
    if on_round is not None:

        def after_round(level: dict[str, Any]) -> None:
            on_round(benchmark_result(s, [*levels, level], budget, servers.info, complete=False))

    try:
        if isinstance(servers, LaunchedServers):
            servers.budget = budget
            servers.start_all(progress)
        if floor and s.block_size is None:
            progress.write("warning: block size unknown (no log line, no --block-size): floor skipped")
        for c in s.in_flight:
            level = run_level(servers, s.workload.at_in_flight(c), clock, progress, budget, after_round)
            if level is not None:
                levels.append(level)
            if budget.stop is not None:
                break
    except BudgetEndedDuringStart as ended:
        budget.stop_during_start(ended.label)
        progress.write(f"time budget: {ended}; stopping every server (levels done: {len(levels)})")
    finally:
        progress.close()
        servers.close()
    for info in servers.info.values():
        if "boundary_stats" not in info and info.get("log_path"):
            info["boundary_stats"] = logs.parse_boundary_stats(logs.read_text(info["log_path"]))
    return benchmark_result(s, levels, budget, servers.info, complete=True)


def benchmark_result(s: Settings, levels: list[dict[str, Any]], budget: RoundBudget, servers_info: dict[str, Any],
                     complete: bool) -> dict[str, Any]:  # fmt: skip
    """The result of the levels so far, their records pooled at the end (see the module docstring)."""
    records = [r for level in levels for r in level["records"]]
    return {
        "workload": asdict(s.workload),
        "policies": list(s.labels),
        "repeat": s.repeat,
        "in_flight": list(s.in_flight),
        "interval": "median over rounds, p25-p75 (interquartile range) over rounds",
        "block_size": s.block_size,
        "block_size_source": s.block_size_source,
        "floor_policy": s.floor_label if s.block_size else None,
        "time_budget_s": s.time_budget_s,
        "sleep_others": s.sleep_others,
        "stopped_early": budget.stop,
        "complete": complete,
        "servers": servers_info,
        "levels": [{k: v for k, v in level.items() if k != "records"} for level in levels],
        "records": [dict(asdict(r), prefill_tokens=r.prefill_tokens, tpot_s=r.tpot_s) for r in records],
    }
