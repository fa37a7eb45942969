"""Per-request records of the multi-turn benchmark and the statistics computed from them.

Contract (pure functions, no I/O):

- ``percentile`` interpolates linearly between closest ranks and ignores ``None``; ``spread``
  summarises one metric over rounds as its median and its interquartile range (p25-p75), the
  interval every report of the benchmark shows.
- ``summarize_policy`` aggregates the ``conversation`` records of one label in one round (TTFT
  p50/p90/p99 over all turns, turn 1 and turns >= 2; prefill and cached tokens; exact hits;
  output throughput; decode throughput, the tokens after the first over the time after the first,
  summed over requests); ``summarize_floor`` the timed ``floor`` records; ``per_turn`` per turn.
  ``acceptance_length`` is speculative decoding's mean tokens per drafting step.
- ``lost_hits`` counts, per label other than the stock one, the ``conversation`` requests whose
  ``cached_tokens`` is below the stock label's for the same (round, conversation, turn) (at the
  same in-flight level), and the tokens lost in total; ``rounds_below_stock`` the rounds in which a
  label cached fewer tokens in total than the stock label, and its least per-round ratio;
  ``turn1_cached_median`` is the median ``cached_tokens`` of a label's turn-1 requests.
- ``round_ratios`` compares each label with the stock label (and the floor) within one round;
  ``aggregate`` turns per-round dictionaries of numbers into per-key spreads.
- ``targets`` judges the plugin against the targets on the medians over rounds (the
  ``SPEC_TARGETS`` too where both servers speculate, i.e. the acceptance ratio is known).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

STOCK_POLICY = "aligned"
PLUGIN_POLICY = "request_boundaries"
PLUGIN_POLICIES = (PLUGIN_POLICY, "auto")  # labels judged against the targets, the first present


def plugin_label(labels: Iterable[str]) -> str | None:
    """The label the targets judge: the first of :data:`PLUGIN_POLICIES` among ``labels``."""
    present = set(labels)
    return next((label for label in PLUGIN_POLICIES if label in present), None)


TARGETS = {
    "continuation_ttft_vs_floor": 1.1,  # plugin TTFT p50 (turns >= 2) / floor TTFT p50, at most
    "prefill_vs_stock": 0.3,  # plugin prefill tokens / stock prefill tokens, at most
    "throughput_vs_stock": 0.98,  # plugin output throughput / stock, at least
}
SPEC_TARGETS = {  # judged only when both servers run speculative decoding
    "decode_throughput_vs_stock": 0.98,  # plugin decode throughput / stock with the same speculator, at least
}
AT_LEAST = {"throughput_vs_stock", "decode_throughput_vs_stock"}  # targets met at or above; the others at or below
QUANTILES = (50, 90, 99)
TURN_SETS = {"all": lambda turn: True, "turn1": lambda turn: turn == 1, "cont": lambda turn: turn >= 2}


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks; None if
    there are no values."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100] (got {q})")
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi:
        return float(data[lo])
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    """Median and interquartile range (p25, p75) of the non-None ``values``, with their count."""
    data = [v for v in values if v is not None]
    return {"median": percentile(data, 50), "p25": percentile(data, 25), "p75": percentile(data, 75), "n": len(data)}


def safe_ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclass
class RequestRecord:
    """One request of the run (written to the JSON result)."""

    policy: str
    phase: str  # "conversation" | "floor" | "floor_prime" | "warmup"
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    boundary: int  # exact boundary of this turn (0 on turn 1); L0 for floor records
    ttft_s: float | None
    latency_s: float
    start_s: float  # seconds since the run started
    end_s: float
    finish_reason: str | None = None
    answer_ids: list[int] = field(default_factory=list)
    error: str | None = None
    in_flight: int = 0
    round: int = 0

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - (self.cached_tokens or 0)

    @property
    def decode_tokens(self) -> int:
        """Output tokens after the first (those decode steps produce)."""
        return max(self.completion_tokens - 1, 0)

    @property
    def decode_s(self) -> float | None:
        """Time from the first output token to the last (None without a TTFT or a second token)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return self.latency_s - self.ttft_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (one engine step at steady decode)."""
        return safe_ratio(self.decode_s, self.decode_tokens)


def acceptance_length(drafts: int | None, accepted: int | None) -> float | None:
    """Speculative decoding's mean tokens per drafting step, ``1 + accepted / drafts`` (the bonus
    token plus the accepted draft tokens); None without drafts (no speculative decoding)."""
    if not drafts or accepted is None:
        return None
    return 1.0 + accepted / drafts


def decode_throughput(records: Sequence[RequestRecord]) -> float | None:
    """Output tokens after the first per second after the first, summed over the requests that
    have both (None if none has)."""
    decoding = [r for r in records if r.decode_s is not None]
    return safe_ratio(sum(r.decode_tokens for r in decoding), sum(r.decode_s for r in decoding))


def _ttft_quantiles(records: Sequence[RequestRecord], prefix: str = "ttft") -> dict[str, float | None]:
    out = {}
    for name, keep in TURN_SETS.items():
        values = [r.ttft_s for r in records if keep(r.turn)]
        for q in QUANTILES:
            out[f"{prefix}_{name}_p{q}_s"] = percentile(values, q)
    return out


def summarize_policy(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Aggregates of the ``conversation`` records of one label in one round."""
    conv = [r for r in records if r.phase == "conversation" and r.error is None]
    prompt = sum(r.prompt_tokens for r in conv)
    cached = sum(r.cached_tokens or 0 for r in conv)
    completion = sum(r.completion_tokens for r in conv)
    wall = (max(r.end_s for r in conv) - min(r.start_s for r in conv)) if conv else 0.0
    later = [r for r in conv if r.turn >= 2]
    return {
        "requests": len(conv),
        "errors": sum(1 for r in records if r.phase == "conversation" and r.error is not None),
        "missing_cached_tokens": sum(1 for r in conv if r.cached_tokens is None),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": safe_ratio(cached, prompt),
        "prefill_tokens": prompt - cached,
        "prefill_cont_tokens": sum(r.prefill_tokens for r in later),
        "completion_tokens": completion,
        "wall_s": wall,
        "output_throughput_tok_s": safe_ratio(completion, wall),
        "decode_throughput_tok_s": decode_throughput(conv),
        **_ttft_quantiles(conv),
        "tpot_p50_s": percentile([r.tpot_s for r in conv], 50),
        "exact_hits": sum(1 for r in later if r.cached_tokens == r.boundary),
        "later_turns": len(later),
    }


def summarize_floor(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Aggregates of the timed ``floor`` records of one round, or None if there are none."""
    timed = [r for r in records if r.phase == "floor" and r.error is None]
    if not timed:
        return None
    values = [r.ttft_s for r in timed]
    return {
        "requests": len(timed),
        **{f"ttft_p{q}_s": percentile(values, q) for q in QUANTILES},
        "tpot_p50_s": percentile([r.tpot_s for r in timed], 50),
        "cached_as_primed": sum(1 for r in timed if r.cached_tokens == r.boundary),
        "mean_prefix_len": sum(r.boundary for r in timed) / len(timed),
        "mean_computed_tokens": sum(r.prefill_tokens for r in timed) / len(timed),
    }


def per_turn(records: Sequence[RequestRecord], phase: str = "conversation") -> dict[str, dict[str, Any]]:
    """Per turn (keys are strings, as in JSON): mean prompt / boundary / cached tokens and TTFT p50
    of the ``phase`` records (pooled over whatever rounds ``records`` holds)."""
    out: dict[str, dict[str, Any]] = {}
    for turn in sorted({r.turn for r in records if r.phase == phase}):
        rows = [r for r in records if r.phase == phase and r.turn == turn and r.error is None]
        if not rows:
            continue
        n = len(rows)
        out[str(turn)] = {
            "requests": n,
            "prompt_tokens": sum(r.prompt_tokens for r in rows) / n,
            "boundary": sum(r.boundary for r in rows) / n,
            "cached_tokens": sum(r.cached_tokens or 0 for r in rows) / n,
            "ttft_p50_s": percentile([r.ttft_s for r in rows], 50),
        }
    return out


def rounds_below_stock(rounds: Sequence[dict], label: str, stock: str = STOCK_POLICY) -> dict[str, Any] | None:
    """``below`` (rounds in which ``label``'s requests cached fewer tokens in total than ``stock``'s),
    ``rounds`` (rounds compared) and ``worst`` (the least per-round ratio of cached tokens, label /
    stock; None where stock cached none) over the level's ``rounds``; None when either label is
    missing. Which requests hit moves with timing between servers; the totals of a round do not."""
    pairs = [
        (rd["policies"][label].get("cached_tokens"), rd["policies"][stock].get("cached_tokens"))
        for rd in rounds
        if label in rd["policies"] and stock in rd["policies"]
    ]
    pairs = [(own, theirs) for own, theirs in pairs if own is not None and theirs is not None]
    if not pairs:
        return None
    ratios = [own / theirs for own, theirs in pairs if theirs]
    return {
        "below": sum(own < theirs for own, theirs in pairs),
        "rounds": len(pairs),
        "worst": min(ratios) if ratios else None,
    }


def lost_hits(records: Sequence[RequestRecord], labels: Sequence[str],
              stock: str = STOCK_POLICY) -> dict[str, dict[str, int]] | None:  # fmt: skip
    """Per label of ``labels`` other than ``stock``: ``requests`` (its conversation requests cached
    below stock's), ``tokens_lost`` (the sum of stock's cached minus its own over those) and
    ``compared`` (the pairs where both requests succeeded with a known ``cached_tokens``). None when
    ``stock`` is not a label.

    A request is paired with stock's of the same in-flight level, round, conversation and turn;
    first turns by rank of their cached counts instead: conversations that share a prefix and
    arrive at once take its one cold start in arrival order, so which conversation computes it
    differs between servers while the hits are the same."""
    if stock not in labels:
        return None

    def key(r: RequestRecord) -> tuple:
        return (r.in_flight, r.round, r.conversation, r.turn)

    usable = [r for r in records if r.phase == "conversation" and r.error is None and r.cached_tokens is not None]
    base = {key(r): r.cached_tokens for r in usable if r.policy == stock}
    out = {}
    for label in labels:
        if label == stock:
            continue
        paired = [(r, base[key(r)]) for r in usable if r.policy == label and key(r) in base]
        pairs = [(r.cached_tokens, theirs) for r, theirs in paired if r.turn != 1]
        first_turns: dict[tuple, tuple[list[int], list[int]]] = {}
        for r, theirs in paired:
            if r.turn == 1:
                mine, stocks = first_turns.setdefault((r.in_flight, r.round), ([], []))
                mine.append(r.cached_tokens)
                stocks.append(theirs)
        for mine, stocks in first_turns.values():
            pairs += list(zip(sorted(mine), sorted(stocks)))
        below = [stock_cached - own for own, stock_cached in pairs if own < stock_cached]
        out[label] = {"requests": len(below), "tokens_lost": sum(below), "compared": len(pairs)}
    return out


def turn1_cached_median(records: Sequence[RequestRecord], label: str) -> float | None:
    """Median ``cached_tokens`` of ``label``'s successful turn-1 conversation requests (None: none)."""
    return percentile((r.cached_tokens for r in records if r.policy == label and r.phase == "conversation"
                       and r.turn == 1 and r.error is None), 50)  # fmt: skip


def round_ratios(summaries: dict[str, dict], floor: dict | None, stock: str = STOCK_POLICY) -> dict[str, dict]:
    """Per label other than ``stock``: its ratios to the stock label (and to the floor) in one
    round. ``turn1_ttft_vs_stock`` is the first-turn tax (TTFT p50 on fresh prompts)."""
    s = summaries.get(stock)
    out = {}
    for label, p in summaries.items():
        if label == stock:
            continue
        out[label] = {
            "turn1_ttft_vs_stock": safe_ratio(p["ttft_turn1_p50_s"], s and s["ttft_turn1_p50_s"]),
            "cont_ttft_vs_stock": safe_ratio(p["ttft_cont_p50_s"], s and s["ttft_cont_p50_s"]),
            "all_ttft_vs_stock": (  # with one turn only, turn 1's
                safe_ratio(p.get("ttft_all_p50_s"), s and s.get("ttft_all_p50_s")) if p.get("later_turns") else None
            ),
            "continuation_ttft_vs_floor": safe_ratio(p["ttft_cont_p50_s"], floor and floor["ttft_p50_s"]),
            "prefill_vs_stock": safe_ratio(p["prefill_tokens"], s and s["prefill_tokens"]),
            "prefill_cont_vs_stock": safe_ratio(p["prefill_cont_tokens"], s and s["prefill_cont_tokens"]),
            "throughput_vs_stock": safe_ratio(p["output_throughput_tok_s"], s and s["output_throughput_tok_s"]),
            "decode_throughput_vs_stock": safe_ratio(
                p.get("decode_throughput_tok_s"), s and s.get("decode_throughput_tok_s")
            ),
            "acceptance_vs_stock": safe_ratio(p.get("mean_acceptance_length"), s and s.get("mean_acceptance_length")),
        }
    return out


def aggregate(rows: Sequence[dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Per numeric key of the per-round dictionaries ``rows``: its ``spread`` over the rounds."""
    keys: list[str] = []
    for row in rows:
        for key, value in (row or {}).items():
            if key not in keys and (value is None or isinstance(value, (int, float))):
                keys.append(key)
    return {key: spread([(row or {}).get(key) for row in rows]) for key in keys}


def targets(ratios: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per target: the median ratio of ``ratios`` (an ``aggregate`` of one label's round ratios),
    the target and whether the median meets it (None where the ratio is missing). ``TARGETS``
    always; ``SPEC_TARGETS`` when the acceptance ratio has a median (both servers speculate)."""
    judged = dict(TARGETS)
    if (ratios.get("acceptance_vs_stock") or {}).get("median") is not None:
        judged.update(SPEC_TARGETS)
    out = {}
    for key, target in judged.items():
        value = (ratios.get(key) or {}).get("median")
        if value is None:
            passed = None
        elif key in AT_LEAST:
            passed = value >= target
        else:
            passed = value <= target
        out[key] = {"median": value, "target": target, "passed": passed}
    return out
