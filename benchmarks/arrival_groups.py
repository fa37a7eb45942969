"""Next turns grouped by how many arrived together: what a step of them cost, per label.

Contract: :func:`arrival_groups` reads a ``bc-bench --out-json`` result's conversation records of
turns >= 2 and, per (round, label, turn), groups requests whose start times are within ``window``
seconds of the previous one's. :func:`summarize` gives, per (label, group size), the number of
groups, the median new tokens per request (prompt - cached) and the median, min and max of the
groups' median TTFT. Printed as one table per file::

    python benchmarks/arrival_groups.py docs/results/gpu-shared-hits-h100/glm-together-8.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

WINDOW_S = 0.03


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def arrival_groups(result: dict, window: float = WINDOW_S) -> list[tuple[str, list[dict]]]:
    """(label, requests) per group of next turns that arrived within ``window`` of each other."""
    slots: dict[tuple, list[dict]] = defaultdict(list)
    for rec in result["records"]:
        if rec["phase"] == "conversation" and rec["turn"] > 1 and not rec.get("error"):
            slots[(rec["round"], rec["policy"], rec["turn"], rec.get("in_flight"))].append(rec)
    groups: list[tuple[str, list[dict]]] = []
    for (_, label, _, _), recs in sorted(slots.items(), key=lambda item: str(item[0])):
        recs.sort(key=lambda rec: rec["start_s"])
        current = [recs[0]]
        for rec in recs[1:]:
            if rec["start_s"] - current[-1]["start_s"] <= window:
                current.append(rec)
            else:
                groups.append((label, current))
                current = [rec]
        groups.append((label, current))
    return groups


def summarize(groups: list[tuple[str, list[dict]]]) -> dict[tuple[str, int], dict]:
    by_size: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for label, recs in groups:
        new_tokens = statistics.median(rec["prompt_tokens"] - rec["cached_tokens"] for rec in recs)
        ttft_ms = statistics.median(rec["ttft_s"] * 1000 for rec in recs)
        by_size[(label, len(recs))].append((new_tokens, ttft_ms))
    return {
        key: {
            "groups": len(rows),
            "new_tokens": statistics.median(row[0] for row in rows),
            "ttft_ms": statistics.median(row[1] for row in rows),
            "ttft_min_ms": min(row[1] for row in rows),
            "ttft_max_ms": max(row[1] for row in rows),
        }
        for key, rows in sorted(by_size.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="bc-bench --out-json files (gzipped or not)")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="seconds between arrivals of one group")
    args = parser.parse_args()
    for path in args.results:
        print(f"{path}\n| label | arriving together | groups | new tokens each | TTFT median [min..max] |")
        print("|---|---|---|---|---|")
        for (label, size), row in summarize(arrival_groups(load(path), args.window)).items():
            print(f"| {label} | {size} | {row['groups']} | {row['new_tokens']:.0f} | {row['ttft_ms']:.0f} ms "
                  f"[{row['ttft_min_ms']:.0f}..{row['ttft_max_ms']:.0f}] |")  # fmt: skip


if __name__ == "__main__":
    main()
