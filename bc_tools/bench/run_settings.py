"""What a benchmark run is given, and the time budget that decides whether a round starts.

Contract: :class:`Settings` is ``run_benchmark``'s input (the CLI's arguments, resolved; a
launched server set fills in ``block_size`` from its log when it is unknown). With
``time_budget_s``, :class:`RoundBudget` lets a round start only if it is expected to end within
that many seconds of the run's start (server starts included): the time so far plus the longest
round of this level so far (for a level's first round, the longest round of any level; the run's
first round starts whenever any time is left). Its ``stop`` records where it stopped the run (None
if it did not). A launched server still starting when the budget ends raises
:class:`BudgetEndedDuringStart`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bc_tools.bench.chat_words import TINY_WORDS
from bc_tools.bench.traffic import Clock
from bc_tools.bench.workload import Workload


@dataclass
class Settings:
    """What ``run_benchmark`` runs (the CLI's arguments, resolved)."""

    workload: Workload  # N, T, S, U, A, seed; its concurrency is replaced by each level
    labels: list[str]
    in_flight: list[int]
    repeat: int
    run_salt: str
    floor_label: str | None = None  # the label whose slots measure the floor
    block_size: int | None = None
    block_size_source: str = "unknown"
    warmup: int = 1
    stats_log_interval: float = 1.0
    request_timeout: float = 600.0
    time_budget_s: float | None = None  # see the module docstring
    chat_words: tuple[str, ...] = TINY_WORDS  # chat mode: words that render to one token each
    sleep_others: bool = False  # only the slot's server awake (vLLM sleep mode; server_sets' contract)


class RoundBudget:
    """Whether the next round is expected to end within ``limit_s`` seconds of ``clock`` (None: no
    limit); see the module docstring. ``stop`` records the first refusal."""

    def __init__(self, clock: Clock, limit_s: float | None):
        self.clock, self.limit_s = clock, limit_s
        self.longest_s: dict[int, float] = {}  # in-flight level -> its longest round
        self.stop: dict[str, Any] | None = None

    def allows(self, level: int, round_index: int) -> bool:
        if self.limit_s is None:
            return True
        now = self.clock.now()
        expected = self.longest_s.get(level, max(self.longest_s.values(), default=0.0))
        if now + expected <= self.limit_s and now < self.limit_s:
            return True
        self.stop = {"in_flight": level, "round": round_index, "at_s": round(now, 3),
                     "expected_round_s": round(expected, 3), "time_budget_s": self.limit_s}  # fmt: skip
        return False

    def finished(self, level: int, seconds: float) -> None:
        self.longest_s[level] = max(self.longest_s.get(level, 0.0), seconds)

    def seconds_left(self) -> float | None:
        """Seconds until the budget ends (never below 0; None: no limit)."""
        return None if self.limit_s is None else max(0.0, self.limit_s - self.clock.now())

    def stop_during_start(self, label: str) -> None:
        """Record that the budget ended while ``label``'s server was starting."""
        self.stop = {"phase": "server start", "label": label, "at_s": round(self.clock.now(), 3),
                     "time_budget_s": self.limit_s}  # fmt: skip


class BudgetEndedDuringStart(Exception):
    """A launched server was still starting when the run's time budget ended (see the module
    docstring); ``label`` names it."""

    def __init__(self, label: str):
        super().__init__(f"[{label}] still starting when the time budget ended")
        self.label = label
