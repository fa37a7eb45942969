"""``benchmarks/arrival_groups.py`` on synthetic records: next turns grouped by arrival."""

from __future__ import annotations

import pytest
from script_modules import load_script


def record(label: str, start: float, *, turn: int = 2, round_index: int = 0, ttft: float = 0.1, cached: int = 900,
           error: str | None = None) -> dict:  # fmt: skip
    return {"phase": "conversation", "policy": label, "round": round_index, "turn": turn, "in_flight": 8,
            "start_s": start, "ttft_s": ttft, "prompt_tokens": 1000, "cached_tokens": cached,
            "error": error}  # fmt: skip


def test_next_turns_arriving_within_the_window_form_one_group():
    module = load_script("benchmarks/arrival_groups.py", "arrival_groups_under_test")
    records = [
        record("plugin", 1.00, ttft=0.10), record("plugin", 1.02, ttft=0.20), record("plugin", 1.04, ttft=0.30),
        record("plugin", 2.00, ttft=0.05),  # alone: 0.96 s after the last
        record("plugin", 1.01, turn=3),  # another turn: its own slot
        record("plugin", 0.50, turn=1), record("plugin", 1.03, error="boom"),  # turn 1 and failures: not next turns
        record("stock", 1.00, cached=100, ttft=0.4), record("stock", 1.00, round_index=1, cached=100, ttft=0.2),
    ]  # fmt: skip
    groups = module.arrival_groups({"records": records})
    assert sorted((label, len(recs)) for label, recs in groups) == [
        ("plugin", 1), ("plugin", 1), ("plugin", 3), ("stock", 1), ("stock", 1)
    ]  # fmt: skip
    summary = module.summarize(groups)
    assert summary[("plugin", 3)] == {"groups": 1, "new_tokens": 100, "ttft_ms": pytest.approx(200),
                                      "ttft_min_ms": pytest.approx(200), "ttft_max_ms": pytest.approx(200)}  # fmt: skip
    assert summary[("stock", 1)]["groups"] == 2 and summary[("stock", 1)]["new_tokens"] == 900
    assert summary[("stock", 1)]["ttft_ms"] == pytest.approx(300)
    assert len(module.arrival_groups({"records": records}, window=0.005)) == 7  # a narrower window splits the three
