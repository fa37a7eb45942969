"""End-to-end exactness criteria for boundary restores, judged on probe rows.

Why these criteria: vLLM's GDN kernels need bf16 (float32 is refused), so two *correct* runs of a
random-weight model differ by rounding, and a greedy answer may part from its cold control where
the top two candidates are nearly tied. Whole-answer equality would measure rounding, not the
plugin. The criteria judge what the plugin controls (the resume point and the restored state):

1. Exact cached counts (``==`` the boundary): resend ``max(P - 1, 0)``, continuation the committed
   length ``P + answer - 1`` (GLM: the pool boundary below it), every cold run 0
   (:func:`count_failures`).
2. First-token top-k logprobs of a restored run within :attr:`Bounds.first_token` of its cold
   control (:func:`first_token_deviation`). The first token is computed straight from the
   restored state, before any decode step adds its own rounding.
3. No divergence of the greedy answer where the cold run preferred its token by more than
   :attr:`Bounds.tie` over the restored run's token (:func:`divergence`).

The bounds are *calibrated on the same engine in the same run* (:func:`calibrate`) from reference
pairs whose difference is rounding only: stock partial (block-grid) hits against their cold
controls, and a cold control against a second cold control under another fresh ``cache_salt``
(built by :mod:`bc_tools.bench.reference_pairs`).
A restore that is wrong by one token of state must fail them (negative controls in the tests).
Where rounding grows with the context length so much that the longest prompts' references would
let a short prompt's one-token error through, each prompt length gets its own bounds
(:func:`calibrate_by_length`, :class:`LengthBounds`). The rows (:class:`ProbeRow`) come from
``probe_scenario.run_probes``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

# Calibration constants (see :func:`calibrate`).
MARGIN = 3.0
"""Factor between the largest reference deviation and the bound. Plugin and reference deviations
are draws from one rounding-noise distribution when the restore is exact, so the largest plugin
deviation exceeds the largest reference one about half of the time (same sample sizes): a bound
needs head-room over the reference maximum. The negative controls show a one-token state error
exceeding the calibrated bound by far more than this factor."""
BF16_STEP = 2.0**-7
"""Floor of both bounds: the spacing of bf16 numbers in [1, 2). A logit of magnitude >= 1 stored in
bf16 moves by at least this much when its rounding changes, so a deviation below it cannot be told
from rounding even when every reference pair happens to be bit-identical (possible on a
deterministic engine). It is two orders of magnitude below what a one-token state error shows."""

LogprobRow = dict[int, float]


@dataclass
class Answer:
    """One greedy completion: cached prompt tokens, answer ids, top-k logprobs per position."""

    cached: int
    tokens: list[int]
    logprobs: list[LogprobRow]

    @classmethod
    def from_dict(cls, data: dict) -> Answer:
        """Inverse of ``asdict`` after a JSON round trip (JSON object keys are strings)."""
        logprobs = [{int(t): float(v) for t, v in row.items()} for row in data["logprobs"]]
        return cls(int(data["cached"]), [int(t) for t in data["tokens"]], logprobs)


@dataclass
class ProbeRow:
    """One conversation: producer (cold) -> resend; continuation restored vs two cold controls."""

    prompt_len: int
    producer: Answer
    resend: Answer
    restored: Answer
    cold: Answer
    cold_again: Answer  # cold-vs-cold reference: another fresh salt
    # Optional phase (``run_probes(decode_spans=...)``): the continuation cold under a fresh salt
    # with ``[P - 1, committed)`` computed one token per step (decode kernels), as its producer did.
    cold_decoded: Answer | None = None

    @property
    def committed(self) -> int:
        """The continuation's exact boundary: prompt + answer - 1 (the last sampled token has no KV)."""
        return self.prompt_len + len(self.producer.tokens) - 1

    def as_dict(self) -> dict:
        """``asdict``, without ``cold_decoded`` when that phase did not run (the form of rows
        recorded before it existed)."""
        data = asdict(self)
        if data["cold_decoded"] is None:
            del data["cold_decoded"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ProbeRow:
        answers = {k: Answer.from_dict(v) for k, v in data.items() if k != "prompt_len" and v is not None}
        return cls(prompt_len=int(data["prompt_len"]), **answers)

    def restored_pairs(self) -> list[tuple[str, Answer, Answer]]:
        """(name, restored run, its cold control) for the two restores of the scenario."""
        return [("resend", self.resend, self.producer), ("continuation", self.restored, self.cold)]


def position_deviation(a: LogprobRow, b: LogprobRow) -> float:
    """A lower bound of the largest |logprob difference| between two runs at one position.

    Tokens recorded by both count exactly. A token recorded by only one run has, in the other,
    a logprob at most that run's smallest recorded one, which bounds the difference from below.
    ``inf`` when either row is empty."""
    if not a or not b:
        return math.inf
    worst = 0.0
    for mine, other in ((a, b), (b, a)):
        floor = min(other.values())
        for token, value in mine.items():
            diff = abs(value - other[token]) if token in other else max(0.0, value - floor)
            worst = max(worst, diff)
    return worst


def first_token_deviation(run: Answer, cold: Answer) -> float:
    """:func:`position_deviation` of the first generated token (computed from the restored state)."""
    if not run.logprobs or not cold.logprobs:
        return math.inf
    return position_deviation(run.logprobs[0], cold.logprobs[0])


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def deviation_profile(a: Answer, b: Answer) -> list[float]:
    """Running maximum of :func:`position_deviation` over the positions where both runs had the
    same context (up to and including their first differing token): ``[i]`` is the largest
    rounding deviation a greedy answer met in its first ``i + 1`` tokens."""
    end = first_difference(a.tokens, b.tokens)
    last = min(len(a.logprobs), len(b.logprobs))
    if end is not None:
        last = min(last, end + 1)
    profile, worst = [], 0.0
    for i in range(last):
        worst = max(worst, position_deviation(a.logprobs[i], b.logprobs[i]))
        profile.append(worst)
    return profile


def divergence(run: Answer, cold: Answer) -> tuple[int, float] | None:
    """(position, gap) of the first token where ``run`` left ``cold``, or None if it never did.

    ``gap``: how much the cold run preferred its own token over the run's token there (for a
    greedy run's top two, its top-2 gap). If the run's token is not among the cold run's recorded
    candidates, the gap is at least the cold run's token minus its smallest recorded candidate;
    ``inf`` when lengths differ or nothing was recorded."""
    i = first_difference(run.tokens, cold.tokens)
    if i is None:
        return None
    if i >= min(len(run.tokens), len(cold.tokens)) or i >= len(cold.logprobs) or not cold.logprobs[i]:
        return i, math.inf
    row = cold.logprobs[i]
    chosen = row.get(cold.tokens[i], max(row.values()))
    other = row.get(run.tokens[i], min(row.values()))
    return i, chosen - other


@dataclass(frozen=True)
class Bounds:
    """Calibrated bounds: the first token's logprob deviation, and per answer position the cold
    run's preference a divergence may cross (:meth:`tie_at`)."""

    first_token: float
    tie: tuple[float, ...]  # [i]: tie bound at position i (the last one holds for later positions)
    reference_first_token: float  # the largest reference first-token deviation
    reference_profile: tuple[float, ...]  # the reference deviation profile the tie bounds came from
    references: int

    def tie_at(self, position: int) -> float:
        return self.tie[min(position, len(self.tie) - 1)]

    def tells_apart(self, run: Answer, reference: Answer, step: float) -> bool:
        """Whether ``run``'s first token deviates from ``reference``'s more than the largest
        reference pair by over ``step``: a deviation no rounding seen in the run explains."""
        return first_token_deviation(run, reference) > self.reference_first_token + step

    def at(self, prompt_len: int) -> Bounds:
        """The bounds of a row of ``prompt_len`` tokens: these, whatever the length (as
        :meth:`LengthBounds.at`, so that a check takes either)."""
        return self

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LengthBounds:
    """Bounds per prompt length (:func:`calibrate_by_length`): a row is judged by the bounds of its
    own prompt length only."""

    by_length: Mapping[int, Bounds]

    def at(self, prompt_len: int) -> Bounds:
        """The bounds calibrated on rows of ``prompt_len`` tokens; ``KeyError`` for a length that
        had none (no fallback: another length's rounding is not this one's)."""
        if prompt_len not in self.by_length:
            raise KeyError(f"no bounds calibrated for prompt length {prompt_len} (have {sorted(self.by_length)})")
        return self.by_length[prompt_len]

    def as_dict(self) -> dict:
        return {"by_length": {str(n): bounds.as_dict() for n, bounds in sorted(self.by_length.items())}}

    def one_step_above(self, step: float) -> LengthBounds:
        """These bounds with each length's first-token bound at its largest reference deviation plus
        ``step`` (first-token deviations come in steps of the logits' bf16 rounding), in place of the
        margin: a restore then fails exactly when a reference pair of its length tells it apart
        (:meth:`Bounds.tells_apart`). (A margin of 1.5 on a reference of 0.186 put the bound at
        0.279, above corrupted restores that deviated 0.235 and 0.241.)"""
        return LengthBounds(
            {n: replace(b, first_token=b.reference_first_token + step) for n, b in self.by_length.items()}
        )


def calibrate(
    pairs: Iterable[tuple[Answer, Answer]],
    margin: float = MARGIN,
    floor: float = BF16_STEP,
    reference_floor: float = 0.0,
) -> Bounds:
    """Bounds from reference pairs whose difference is rounding only (see
    :func:`bc_tools.bench.reference_pairs.reference_pairs`).

    * ``first_token = max(floor, margin * max first-token deviation)``;
    * ``tie[i] = max(floor, 2 * margin * max deviation over the references' first i + 1
      positions)``: a greedy flip between two tokens needs their logprob difference to move by the
      cold run's preference, i.e. one of the two by at least half of it; rounding compounds over
      decode steps, so the bound at position ``i`` comes from the noise seen up to ``i``.

    ``reference_floor``: the least reference deviation assumed at every position, for a restore
    whose kernel path no reference pair takes (a measured constant of that engine; the CPU MTP test
    uses it for the padded speculative row of a restored resend).
    """
    pairs = list(pairs)
    if not pairs:
        raise ValueError("calibration needs at least one reference pair")
    first = max(reference_floor, max(first_token_deviation(a, b) for a, b in pairs))
    profiles = [deviation_profile(a, b) for a, b in pairs]
    length = max(len(p) for p in profiles) or 1
    # A pair that parted at position j keeps its running maximum for the positions after j.
    reference = tuple(
        max(reference_floor, max((p[min(i, len(p) - 1)] for p in profiles if p), default=0.0)) for i in range(length)
    )
    tie = tuple(max(floor, 2 * margin * value) for value in reference)
    return Bounds(max(floor, margin * first), tie, first, reference, len(pairs))


def calibrate_by_length(
    pairs: Mapping[int, Iterable[tuple[Answer, Answer]]],
    margin: float = MARGIN,
    floor: float = BF16_STEP,
    reference_floor: float = 0.0,
) -> LengthBounds:
    """The first-token bound of :func:`calibrate` once per prompt length, on that length's
    reference pairs only (:func:`bc_tools.bench.reference_pairs.pairs_by_length`), with the same
    ``margin``, ``floor`` and ``reference_floor``; the tie bounds of answers that part later come
    from all pairs together.

    Why: first-token rounding grows with the context length (the GLM runs on an H200: reference
    pairs within 0.1 up to 2103 tokens, 0.19 at 32768), so one bound set by the longest prompts
    would let a short prompt's one-token state error through; a restore's first token is compared
    with references of its own length, like with like. The tie bounds only keep rounding from
    failing a restore and catch no corruption the first token misses, so they keep every pair's
    evidence. Every length needs a reference pair of its own: ``ValueError`` naming the length
    otherwise."""
    pairs = {prompt_len: list(length_pairs) for prompt_len, length_pairs in pairs.items()}
    for prompt_len, length_pairs in pairs.items():
        if not length_pairs:
            raise ValueError(f"no reference pair of prompt length {prompt_len}: its bounds cannot be calibrated")
    every = calibrate(
        [pair for length_pairs in pairs.values() for pair in length_pairs], margin, floor, reference_floor
    )
    by_length = {}
    for prompt_len, length_pairs in pairs.items():
        own = calibrate(length_pairs, margin, floor, reference_floor)
        first = {"first_token": own.first_token, "reference_first_token": own.reference_first_token}
        by_length[prompt_len] = replace(every, **first, references=own.references)
    return LengthBounds(by_length)


def state_failures(name: str, run: Answer, cold: Answer, bounds: Bounds) -> list[str]:
    """Why ``run`` (restored) is not as good as its cold control ``cold`` under ``bounds``."""
    failures = []
    deviation = first_token_deviation(run, cold)
    if deviation > bounds.first_token:
        failures.append(
            f"{name}: first-token logprobs deviate by {deviation:.4f} > bound {bounds.first_token:.4f} "
            f"(restored {run.logprobs[:1]}, cold {cold.logprobs[:1]})"
        )
    parted = divergence(run, cold)
    if parted is not None and parted[1] > bounds.tie_at(parted[0]):
        i, gap = parted
        failures.append(
            f"{name}: answer leaves its cold control at token {i} where the cold run preferred its token "
            f"by {gap:.4f} > tie bound {bounds.tie_at(i):.4f} (restored {run.logprobs[i : i + 1]}, "
            f"cold {cold.logprobs[i : i + 1]})"
        )
    return failures


def count_failures(row: ProbeRow, pool: int = 0, resend_at: Mapping[int, int] | None = None) -> list[str]:
    """Cached counts that are not exactly the boundaries; ``pool``: the response boundary sits on
    that pool grid below the committed length (GLM-5.3-Flash's pool-grid snapshots);
    ``resend_at``: a resend's count by prompt length, where it is not ``P - 1`` (GLM-5.3-Flash
    under speculative decoding: the plugin's checkpoint on the pool grid, or vLLM's hit)."""
    resend = max(row.prompt_len - 1, 0) if resend_at is None else resend_at[row.prompt_len]
    expected = {
        "producer": (row.producer.cached, 0),
        "resend": (row.resend.cached, resend),
        "continuation": (row.restored.cached, row.committed // pool * pool if pool else row.committed),
        "cold control": (row.cold.cached, 0),
        "second cold control": (row.cold_again.cached, 0),
    }
    return [
        f"P={row.prompt_len}: {name} cached {got}, expected exactly {want}"
        for name, (got, want) in expected.items()
        if got != want
    ]


def probe_failures(
    rows: Sequence[ProbeRow],
    bounds: Bounds | LengthBounds,
    continuation_bounds: Bounds | None = None,
    pool: int = 0,
    resend_at: Mapping[int, int] | None = None,
) -> list[str]:
    """Why a plugin run is not exact (empty when it is): counts (``count_failures``, with ``pool``
    and ``resend_at``), then per restore the state criteria against ``bounds`` (from
    :func:`calibrate`, or per prompt length from :func:`calibrate_by_length`: each row against its
    own length's); continuations against ``continuation_bounds`` where given (one :class:`Bounds`
    for every length, e.g. calibrated with
    :func:`bc_tools.bench.reference_pairs.decode_path_pairs`)."""
    failures = []
    for row in rows:
        failures += count_failures(row, pool, resend_at)
        for name, run, cold in row.restored_pairs():
            if name == "continuation" and continuation_bounds:
                judged = continuation_bounds
            else:
                judged = bounds.at(row.prompt_len)
            failures += state_failures(f"P={row.prompt_len} {name}", run, cold, judged)
    return failures


def same_greedy_output(
    tokens: list[int],
    cold_tokens: list[int],
    logprobs: list[LogprobRow],
    cold_logprobs: list[LogprobRow],
    tie_bound: float = 0.1,
) -> tuple[str, str]:
    """(verdict, detail) for a report column (the demo's): ``identical``; ``tie`` when the first
    difference is within ``tie_bound`` of the cold run's preference (see :func:`divergence`);
    ``different``. Tests judge answers with :func:`state_failures` and calibrated bounds instead."""
    parted = divergence(Answer(0, list(tokens), list(logprobs)), Answer(0, list(cold_tokens), list(cold_logprobs)))
    if parted is None:
        return "identical", ""
    i = parted[0]
    detail = f"token {i}: restored top {logprobs[i : i + 1]}, cold top {cold_logprobs[i : i + 1]}"
    return ("tie" if parted[1] <= tie_bound else "different"), detail
