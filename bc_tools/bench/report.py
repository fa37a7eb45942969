"""Tables and the plot of a multi-turn benchmark result (the dict ``runner.run_benchmark`` returns).

Contract: pure formatting, nothing is measured here. Every number that varies between rounds is
shown as ``median [p25..p75]`` over the rounds of its in-flight level. ``format_table`` renders
aligned text or Markdown; ``level_tables`` gives a level's summary table (one column per label
and one for the floor), its ratio table (each label / the stock label) and the per-turn table
(pooled over rounds); ``targets_text`` judges the medians. One-turn workloads (``--turn1-only``)
leave out the rows and targets about later turns. The speculative decoding rows (mean acceptance
length, its ratio to stock, the decode throughput target) appear only where some server
speculates (``speculates``); decode throughput is shown always. The summary table's lost-hits row
(``lost_hits_cell``) shows, per label other than stock, the conversation requests cached below
stock's same request over all rounds and the tokens lost (blank without a stock label); the next
row (``rounds_below_cell``) the rounds whose total cached tokens fell below stock's. Chat-mode
results add a line with each label's median turn-1 cached tokens (the shared system message's
reuse; the per-turn table shows turn 1's mean). ``plot_result`` draws a PNG with
matplotlib and returns False, with a message on stderr, when matplotlib is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from bc_tools.bench.stats import AT_LEAST, PLUGIN_POLICY, STOCK_POLICY, rounds_below_stock

RATIO_NAMES = {
    "turn1_ttft_vs_stock": "TTFT p50 turn 1 (fresh prompt) / stock",
    "cont_ttft_vs_stock": "TTFT p50 turns >= 2 / stock",
    "all_ttft_vs_stock": "TTFT p50 all turns / stock",
    "continuation_ttft_vs_floor": "TTFT p50 turns >= 2 / floor p50",
    "prefill_vs_stock": "prefill tokens / stock",
    "prefill_cont_vs_stock": "prefill tokens turns >= 2 / stock",
    "throughput_vs_stock": "output throughput / stock",
    "decode_throughput_vs_stock": "decode throughput / stock",
    "acceptance_vs_stock": "mean acceptance length / stock",
}
TURN_SET_NAMES = {"all": "all turns", "turn1": "turn 1", "cont": "turns >= 2"}


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.2f}"


def cell(s: dict | None, fmt: Callable[[float | None], str]) -> str:
    """``median [p25..p75]`` of a spread ('-' without values; the median alone for one round)."""
    if not s or s.get("median") is None:
        return "-"
    if s["n"] < 2:
        return fmt(s["median"])
    return f"{fmt(s['median'])} [{fmt(s['p25'])}..{fmt(s['p75'])}]"


def format_table(header: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def speculates(level: dict) -> bool:
    """Whether any label's slots measured a mean acceptance length (its server speculates)."""
    policies = level["summary"]["policies"]
    return any((p.get("mean_acceptance_length") or {}).get("median") is not None for p in policies.values())


LOST_HITS_ROW = "requests cached below stock, all rounds (tokens lost)"


def lost_hits_cell(level: dict, label: str) -> str:
    """``N (T)``: ``label``'s conversation requests cached below stock's same request, all rounds,
    and the tokens lost; '' for the stock label itself and where the run has no stock label."""
    item = (level["summary"].get("lost_hits") or {}).get(label)
    return "" if item is None else f"{item['requests']} ({item['tokens_lost']})"


ROUNDS_BELOW_ROW = "rounds cached below stock (worst cached / stock)"


def rounds_below_cell(level: dict, label: str) -> str:
    """``N of R (worst W)``: the rounds in which ``label`` cached fewer tokens than stock; '' for the
    stock label itself and where the run has no stock label."""
    if label == STOCK_POLICY:
        return ""
    item = rounds_below_stock(level["rounds"], label)
    if item is None:
        return ""
    return f"{item['below']} of {item['rounds']} (worst {num(item['worst'], 3)})"


def summary_table(result: dict, level: dict, markdown: bool = False) -> str:
    """Per label (and the floor, where it applies): every metric as ``median [p25..p75]``."""
    labels = result["policies"]
    summ = level["summary"]["policies"]
    floor = level["summary"].get("floor")
    header = ["metric"] + labels + (["floor"] if floor else [])
    rows: list[list[str]] = []

    def row(name: str, key: str, fmt: Callable, floor_key: str | None = None) -> None:
        values = [cell(summ[p].get(key), fmt) for p in labels]
        if floor:
            values.append(cell(floor.get(floor_key), fmt) if floor_key else "")
        rows.append([name] + values)

    errors = {p: sum(rd["policies"][p]["errors"] for rd in level["rounds"]) for p in labels}
    rows.append(["requests per round (errors, all rounds)"]
                + [f"{num(summ[p]['requests']['median'], 0)} ({errors[p]})" for p in labels]
                + ([cell(floor.get("requests"), lambda v: num(v, 0))] if floor else []))  # fmt: skip
    one_turn = result["workload"]["turns"] < 2
    for name, label in TURN_SET_NAMES.items():
        if one_turn and name != "turn1":
            continue  # all turns are turn 1, and there is no later turn
        for q in (50, 90, 99):
            row(f"TTFT p{q} ms, {label}", f"ttft_{name}_p{q}_s", ms, f"ttft_p{q}_s" if name == "cont" else None)
    row("output throughput tok/s", "output_throughput_tok_s", lambda v: num(v, 1))
    row("decode throughput tok/s (after 1st token)", "decode_throughput_tok_s", lambda v: num(v, 1))
    if speculates(level):
        row("mean acceptance length (tok/draft step)", "mean_acceptance_length", lambda v: num(v, 2))
    row("prefill tokens computed", "prefill_tokens", lambda v: num(v, 0))
    row("cached-token ratio", "cached_ratio", lambda v: num(v, 3))
    rows.append([LOST_HITS_ROW] + [lost_hits_cell(level, p) for p in labels] + ([""] if floor else []))
    rows.append([ROUNDS_BELOW_ROW] + [rounds_below_cell(level, p) for p in labels] + ([""] if floor else []))
    if any((summ[p].get("stock_tokens_lost") or {}).get("median") is not None for p in labels):
        row("plugin's estimate: tokens beyond stock", "tokens_beyond_stock", lambda v: num(v, 0))
        row("plugin's estimate: stock tokens lost", "stock_tokens_lost", lambda v: num(v, 0))
    if not one_turn:
        row("exact hits (turns >= 2)", "exact_hits", lambda v: num(v, 0))
        row("turns >= 2", "later_turns", lambda v: num(v, 0))
    row("peak retained checkpoint MiB", "peak_bytes_retained", mib)
    row("peak retained share of KV pool", "peak_retained_share_of_pool", lambda v: num(v, 3))
    row("retained MiB added by the slot", "retained_bytes_added", mib)
    row("time per output token p50 ms", "tpot_p50_s", lambda v: num(None if v is None else v * 1000, 1))
    row("preemptions", "preemptions", lambda v: num(v, 0))
    if any((summ[p].get("prompts_waited") or {}).get("median") for p in labels):  # speculative decoding
        row("prompts that waited for a prefix in flight", "prompts_waited", lambda v: num(v, 0))
    if any((summ[p].get("shared_hits_released") or {}).get("median") for p in labels):
        row("prompts started beside a shared cached prefix", "shared_hits_released", lambda v: num(v, 0))
    if any((summ[p].get("rows_fit_to_graph") or {}).get("median") for p in labels):  # graph_fit_tokens
        row("requests started a step later to fit a CUDA graph", "rows_fit_to_graph", lambda v: num(v, 0))
    if any((summ[p].get("capture_copies") or {}).get("median") for p in labels):  # where /metrics has them
        row("capture-copy launches", "capture_copies", lambda v: num(v, 0))
        row("capture-copy time ms", "capture_copy_us", lambda v: num(None if v is None else v / 1000, 2))
    return format_table(header, rows, markdown)


def ratio_table(level: dict, markdown: bool = False) -> str:
    """Each label / the stock label (and / the floor), per round, as ``median [p25..p75]``."""
    ratios = level["summary"]["ratios"]
    if not ratios:
        return ""
    labels = list(ratios)
    rows = [[text] + [cell(ratios[p].get(key), lambda v: num(v, 3)) for p in labels]
            for key, text in RATIO_NAMES.items()]  # fmt: skip
    rows = [r for r in rows if any(v != "-" for v in r[1:])]  # e.g. no turns >= 2 with --turn1-only
    return format_table(["ratio (per round)"] + labels, rows, markdown)


def per_turn_table(result: dict, level: dict, markdown: bool = False) -> str:
    """Per turn, pooled over rounds: prompt, boundary, mean cached tokens and TTFT p50 per label."""
    labels = result["policies"]
    turns = level["summary"]["per_turn"]
    floor_turns = level["summary"].get("floor_per_turn") or {}
    header = ["turn", "prompt", "exact boundary"]
    header += [f"cached {p}" for p in labels] + [f"TTFT p50 ms {p}" for p in labels]
    if floor_turns:
        header += ["floor L0", "floor TTFT p50 ms"]
    rows = []
    for t in sorted({int(t) for p in labels for t in turns[p]}):
        key = str(t)
        base = next(turns[p][key] for p in labels if key in turns[p])
        row = [key, f"{base['prompt_tokens']:.0f}", f"{base['boundary']:.0f}"]
        row += [f"{turns[p][key]['cached_tokens']:.0f}" if key in turns[p] else "-" for p in labels]
        row += [ms(turns[p][key]["ttft_p50_s"]) if key in turns[p] else "-" for p in labels]
        if floor_turns:
            ft = floor_turns.get(key)
            row += [f"{ft['boundary']:.0f}", ms(ft["ttft_p50_s"])] if ft else ["-", "-"]
        rows.append(row)
    return format_table(header, rows, markdown)


def targets_text(result: dict, level: dict) -> str:
    """The targets judged on the medians over rounds ('' without a plugin/stock pair, and for
    one-turn workloads, where they do not apply); the decode throughput target only where
    ``stats.targets`` judged it (both servers speculate)."""
    judged = level["summary"].get("targets")
    if not judged or result["workload"]["turns"] < 2:
        return ""
    plugin = level["summary"].get("targets_policy") or PLUGIN_POLICY
    lines = [f"targets ({plugin} vs {STOCK_POLICY}, medians over rounds):"]
    for key, item in judged.items():
        op = ">=" if key in AT_LEAST else "<="
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[item["passed"]]
        target = f"(target {op} {item['target']})"
        lines.append(f"  {RATIO_NAMES[key]:45s} {num(item['median'], 3):>6s}  {target}  {verdict}")
    return "\n".join(lines)


def turn1_cached_text(result: dict, level: dict) -> str:
    """Chat mode: ``turn-1 cached tokens: median per policy: aligned 0, request_boundaries 153``
    (pooled over rounds; '' in tokens mode)."""
    if result["workload"].get("mode") != "chat":
        return ""
    medians = level["summary"].get("turn1_cached_median") or {}
    values = ", ".join(f"{p} {num(medians.get(p), 0)}" for p in result["policies"])
    return f"turn-1 cached tokens: median per policy (all rounds; the system message's reuse): {values}"


def level_text(result: dict, level: dict, markdown: bool = False) -> str:
    """Everything printed for one in-flight level."""
    n_rounds = len(level["rounds"])
    mode = " (chat mode)" if result["workload"].get("mode") == "chat" else ""
    parts = [
        f"## in flight {level['in_flight']}: {level['conversations']} conversations, {n_rounds} rounds "
        f"(median [p25..p75] over rounds){mode}",  # fmt: skip
        summary_table(result, level, markdown),
    ]
    floor = level["summary"].get("floor")
    if floor:
        parts.append(f"floor on {result['floor_policy']}: prefix L0 on the {result['block_size']}-token grid, "
                     f"mean L0 {num(floor['mean_prefix_len']['median'], 0)}, "
                     f"{num(floor['mean_computed_tokens']['median'], 0)} tokens computed, cached as primed "
                     f"{num(floor['cached_as_primed']['median'], 0)}/{num(floor['requests']['median'], 0)} "
                     f"(median per round)")  # fmt: skip
    for text in (ratio_table(level, markdown), per_turn_table(result, level, markdown),
                 turn1_cached_text(result, level), targets_text(result, level)):  # fmt: skip
        if text:
            parts.append(text)
    same = level["summary"].get("same_answers")
    if same:
        variety = level["summary"].get("answer_variety")
        note = ""
        if variety is not None:
            note = f" (median {variety:g} distinct tokens per answer"
            note += (
                "; answers repeat one or two tokens, so this compares little more than first tokens)"
                if variety <= 2
                else ")"
            )
        parts.append("answers same as " + result["policies"][0] + ": "
                     + ", ".join(f"{p} {v}" for p, v in same.items()) + note)  # fmt: skip
    return "\n\n".join(parts)


def plot_result(result: dict, path: Path) -> bool:
    """Left: TTFT p50 (median, p25-p75 bars) per in-flight level, turn 1 and turns >= 2, per label
    and the floor. Right: TTFT p50 per turn at the first level (pooled over rounds). False if
    matplotlib is missing (a message says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, or the package's [bench] extra)",
              file=sys.stderr)  # fmt: skip
        return False
    fig, (ax_level, ax_turn) = plt.subplots(1, 2, figsize=(11, 5.2))
    levels = result["levels"]
    xs = [lv["in_flight"] for lv in levels]

    def bars(ax, spreads: list[dict | None], **kw: Any) -> None:
        pts = [(x, s) for x, s in zip(xs, spreads) if s and s.get("median") is not None]
        if pts:
            ys = [s["median"] * 1000 for _, s in pts]
            err = [[(s["median"] - s["p25"]) * 1000 for _, s in pts], [(s["p75"] - s["median"]) * 1000 for _, s in pts]]
            ax.errorbar([x for x, _ in pts], ys, yerr=err, capsize=3, **{"marker": "o", **kw})

    colors = {label: f"C{i}" for i, label in enumerate(result["policies"])}  # one color per server, both panels
    for label in result["policies"]:
        for key, style, marker in (("ttft_turn1_p50_s", "--", "s"), ("ttft_cont_p50_s", "-", "o")):
            name = "turn 1 (fresh prompt)" if key.startswith("ttft_turn1") else "turns >= 2"
            bars(ax_level, [lv["summary"]["policies"][label].get(key) for lv in levels],
                 linestyle=style, marker=marker, color=colors[label], label=f"{label}, {name}")  # fmt: skip
    bars(ax_level, [(lv["summary"].get("floor") or {}).get("ttft_p50_s") for lv in levels], linestyle=":",
         color="black", label="floor (stock, previous turn primed)")  # fmt: skip
    first = levels[0]
    for label in result["policies"]:
        turns = first["summary"]["per_turn"][label]
        ts = sorted(int(t) for t in turns)
        ax_turn.plot(ts, [turns[str(t)]["ttft_p50_s"] * 1000 for t in ts], marker="o", color=colors[label], label=label)
    floor_turns = first["summary"].get("floor_per_turn") or {}
    if floor_turns:
        ts = sorted(int(t) for t in floor_turns)
        ax_turn.plot(ts, [floor_turns[str(t)]["ttft_p50_s"] * 1000 for t in ts], marker="s", linestyle="--",
                     color="black", label="floor (stock, previous turn primed)")  # fmt: skip
    ax_level.set(xlabel="requests in flight", ylabel="TTFT p50 (ms)", title="TTFT p50, median and p25-p75 of rounds")
    ax_level.set_xscale("log", base=2)
    ax_turn.set(xlabel="turn", ylabel="TTFT p50 (ms)", title=f"TTFT p50 per turn, {first['in_flight']} in flight")
    ax_turn.xaxis.get_major_locator().set_params(integer=True)
    for ax in (ax_level, ax_turn):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: never on a point
    w = result["workload"]
    fig.suptitle(f"bc-bench: N={w['conversations']} T={w['turns']} S={w['system_tokens']} U={w['user_tokens']} "
                 f"A={w['answer_tokens']}, {result['repeat']} rounds, block {result.get('block_size')} "
                 "(lower is better)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
