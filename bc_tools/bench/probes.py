"""End-to-end exactness criteria for boundary restores, and the probe scenario that feeds them.

Why these criteria: vLLM's GDN kernels need bf16 (float32 is refused), so two *correct* runs of a
random-weight model differ by rounding, and a greedy answer may part from its cold control where
the top two candidates are nearly tied. Whole-answer equality would measure rounding, not the
plugin. The criteria judge what the plugin controls (the resume point and the restored state):

1. Exact cached counts (``==`` the boundary): resend ``max(P - 1, 0)``, continuation the committed
   length ``P + answer - 1``, every cold run 0 (:func:`count_failures`).
2. First-token top-k logprobs of a restored run within :attr:`Bounds.first_token` of its cold
   control (:func:`first_token_deviation`). The first token is computed straight from the
   restored state, before any decode step adds its own rounding.
3. No divergence of the greedy answer where the cold run preferred its token by more than
   :attr:`Bounds.tie` over the restored run's token (:func:`divergence`).

The bounds are *calibrated on the same engine in the same run* (:func:`calibrate`) from reference
pairs whose difference is rounding only: stock partial (block-grid) hits against their cold
controls, and a cold control against a second cold control under another fresh ``cache_salt``.
A restore that is wrong by one token of state must fail them (negative controls in the tests).

:func:`run_probes` runs the scenario on an in-process ``vllm.LLM``: per conversation a cold
producer of prompt ``P``, the exact resend, the continuation ``P + answer + new tokens``, and two
cold controls of the continuation under fresh salts; optionally a third, the decode-path control
(``cold_decoded``: the answer's positions computed one token per step, as its producer computed
them, instead of inside a prefill chunk).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import asdict, dataclass

NEW_TOKENS = 50
TOP_LOGPROBS = 5  # candidates recorded per position

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


# ---- pure criteria ----------------------------------------------------------------------------
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

    def as_dict(self) -> dict:
        return asdict(self)


def calibrate(
    pairs: Iterable[tuple[Answer, Answer]],
    margin: float = MARGIN,
    floor: float = BF16_STEP,
    reference_floor: float = 0.0,
) -> Bounds:
    """Bounds from reference pairs whose difference is rounding only (see :func:`reference_pairs`).

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


def count_failures(row: ProbeRow) -> list[str]:
    """Cached counts that are not exactly the boundaries."""
    expected = {
        "producer": (row.producer.cached, 0),
        "resend": (row.resend.cached, max(row.prompt_len - 1, 0)),
        "continuation": (row.restored.cached, row.committed),
        "cold control": (row.cold.cached, 0),
        "second cold control": (row.cold_again.cached, 0),
    }
    return [
        f"P={row.prompt_len}: {name} cached {got}, expected exactly {want}"
        for name, (got, want) in expected.items()
        if got != want
    ]


def reference_pairs(rows: Sequence[ProbeRow], stock_rows: Sequence[ProbeRow] = ()) -> list[tuple[Answer, Answer]]:
    """Pairs of runs of one prompt that differ by rounding only, from a plugin run and a stock run
    of the same scenario (same prompts, row by row):

    * cold vs second cold control, in both runs;
    * the stock run's partial block-grid hits (cached > 0) vs their cold controls;
    * the plugin run's cold controls vs the stock run's cold controls of the same continuation
      (where both producers answered alike, so the continuations are equal). The plugin stops
      every prefill at ``P - 1`` and stock on its block grid: these pairs carry the rounding of a
      prefill split off the grid, which a restore at an exact boundary adds too. On the CPU engine
      the first two kinds are bit-identical (grid splits are multiples of the GDN kernels' chunk
      and round like one long prefill), so without these the bound would be the bf16 floor.

    The producers (plugin vs stock) are left out: one such pair measured 0.74 on the CPU engine
    (P = 255, in-process batch), as large as a one-token state error, which would make the bound
    too loose to catch one (an open question: kernel path of a one-token step, or the P - 1 stop).
    """
    pairs = [(row.cold_again, row.cold) for row in (*rows, *stock_rows)]
    for row in stock_rows:
        pairs += [(run, cold) for _, run, cold in row.restored_pairs() if run.cached > 0]
    if stock_rows:
        for mine, stock in zip(rows, stock_rows, strict=True):
            if mine.prompt_len != stock.prompt_len:
                raise ValueError("plugin and stock rows must come from the same scenario, row by row")
            if mine.producer.tokens == stock.producer.tokens:
                pairs.append((mine.cold, stock.cold))
    return pairs


def mtp_reference_pairs(plugin: Sequence[ProbeRow], stock: Sequence[ProbeRow]) -> list[tuple[Answer, Answer]]:
    """:func:`reference_pairs` plus the plugin's and stock's producers of each prompt (MTP runs).

    Under MTP a restore at ``P - 1`` leaves one token, which vLLM runs as a padded speculative
    row (``scheduler.py:1131-1153``: the speculative GDN kernels), while its cold control ran it
    as a non-speculative row: a kernel-path difference that no pair of :func:`reference_pairs` has
    on the CPU engine (every one of them is bit-identical there, and stock makes no partial hit on
    prompts shorter than two blocks under MTP's block drop). The producers are two cold runs of
    one prompt on different kernel paths (the plugin stops at ``P - 1`` and runs the last token
    alone; stock prefills at once): rounding only, measured 0.07-0.26 on CPU. :func:`reference_pairs`
    leaves them out where they make the bound too loose to catch a one-token state error; under
    MTP the negative control in the same run (measured 1.44-1.47 on CPU) shows the bound still
    catches it."""
    return reference_pairs(plugin, stock) + [(a.producer, b.producer) for a, b in zip(plugin, stock, strict=True)]


def probe_failures(rows: Sequence[ProbeRow], bounds: Bounds) -> list[str]:
    """Why a plugin run is not exact (empty when it is): counts, then per restore the state
    criteria against ``bounds`` (from :func:`calibrate`)."""
    failures = []
    for row in rows:
        failures += count_failures(row)
        for name, run, cold in row.restored_pairs():
            failures += state_failures(f"P={row.prompt_len} {name}", run, cold, bounds)
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


# ---- the in-process scenario ------------------------------------------------------------------
def top_logprobs(vllm_logprobs) -> list[LogprobRow]:
    """vLLM's per-position ``{token: Logprob}`` as ``{token: logprob}``."""
    return [{token: float(entry.logprob) for token, entry in position.items()} for position in vllm_logprobs]


def spec_counts(llm) -> tuple[int, int]:
    """vLLM's ``(spec_decode_num_drafts, spec_decode_num_accepted_tokens)`` counters of ``llm``
    (0, 0 without speculative decoding; needs ``disable_log_stats=False``). ``num_drafts`` counts
    drafting steps, so ``1 + accepted / drafts`` is the mean tokens per drafting step."""
    values = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")}
    drafts = values.get("vllm:spec_decode_num_drafts") or 0
    return int(drafts), int(values.get("vllm:spec_decode_num_accepted_tokens") or 0)


def run_probes(
    llm,
    lengths: list[int],
    conversations: int,
    max_tokens: int,
    seed: int = 0,
    acceptance: dict[str, list[int]] | None = None,
    next_token: Callable[[list[int]], int] | None = None,
    decode_spans: MutableMapping[str, tuple[int, int]] | None = None,
) -> list[ProbeRow]:
    """The scenario on ``llm``; every phase sends all conversations together (shared batches).

    ``acceptance`` (a dict, filled in place): per phase (``producer``, ``resend``, ``restored``,
    ``cold``, ``cold_again``, and ``cold_decoded`` if it runs) the ``[drafting steps, accepted
    drafts]`` of :func:`spec_counts` that phase added (speculative decoding with stats enabled).

    ``next_token`` (optional): the first of a continuation's new tokens from its producer's answer
    (random otherwise, like the rest). Under MTP with async scheduling a response finished with a
    step in flight is kept at ``num_tokens`` and serves only a next turn that continues with the
    token that step sampled (the next-token guard, docs/notes/spec-decode.md §10); a caller that
    can predict that token (the planted fixture: the successor of the answer's last token) makes
    those bundles restorable.

    ``decode_spans`` (optional): the registry of a decode-path scheduler (the tests'
    ``decode_path_control``, whose engine core runs in this process). When given, a last phase
    ``cold_decoded`` sends the continuations again under fresh salts, each registered first as
    ``salt -> (max(P - 1, 0), committed)``, which that scheduler runs one token per step
    (``ProbeRow.cold_decoded``): the positions the plugin's producer computed alone in a step --
    the answer tokens it fed back, and its last prompt token, which the plugin's prompt checkpoint
    runs alone (the ``P - 1`` stop; captured in the step, as a one-token decode row inside the GDN
    layers; ``P = 1``: a one-token first chunk, a prefill row in both runs). Off by default."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    salt = f"probe-{seed}-{random.random()}"  # unseeded: reruns on one engine never share a salt

    def send(prompts, salt_of, phase: str) -> list[Answer]:
        batch = [TokensPrompt(prompt_token_ids=p, cache_salt=salt_of(i)) for i, p in enumerate(prompts)]
        before = spec_counts(llm) if acceptance is not None else (0, 0)
        outs = llm.generate(batch, params, use_tqdm=False)
        if acceptance is not None:
            after = spec_counts(llm)
            acceptance[phase] = [after[0] - before[0], after[1] - before[1]]
        return [Answer(o.num_cached_tokens, list(o.outputs[0].token_ids), top_logprobs(o.outputs[0].logprobs))
                for o in outs]  # fmt: skip

    def draw(n):
        return [rng.randrange(4, vocab) for _ in range(n)]

    prompts = [draw(lengths[i % len(lengths)]) for i in range(conversations)]
    producers = send(prompts, lambda i: salt, "producer")
    resends = send(prompts, lambda i: salt, "resend")

    def new_tokens(answer: list[int]) -> list[int]:
        tokens = draw(NEW_TOKENS)
        if next_token is not None and answer:
            tokens[0] = next_token(answer)
        return tokens

    continuations = [p + out.tokens + new_tokens(out.tokens) for p, out in zip(prompts, producers)]
    restored = send(continuations, lambda i: salt, "restored")
    cold = send(continuations, lambda i: f"{salt}-cold-{i}", "cold")
    cold_again = send(continuations, lambda i: f"{salt}-cold-again-{i}", "cold_again")
    decoded: list[Answer | None] = [None] * len(prompts)
    if decode_spans is not None:
        for i, (p, out) in enumerate(zip(prompts, producers)):
            decode_spans[f"{salt}-cold-decoded-{i}"] = (max(len(p) - 1, 0), len(p) + len(out.tokens) - 1)
        decoded = send(continuations, lambda i: f"{salt}-cold-decoded-{i}", "cold_decoded")
    return [
        ProbeRow(len(p), *answers)
        for p, *answers in zip(prompts, producers, resends, restored, cold, cold_again, decoded)
    ]


def summarize(rows: list[ProbeRow], bounds: Bounds | None = None) -> str:
    """A markdown table, one line per distinct prompt length (counts as min-max over the group)."""
    lines = [
        "| P | resend cached | continuation cached / committed | max first-token deviation "
        "| max divergence gap | cold cached |",
        "|---|---|---|---|---|---|",
    ]
    for length in sorted({r.prompt_len for r in rows}):
        group = [r for r in rows if r.prompt_len == length]
        deviation = max(first_token_deviation(run, cold) for r in group for _, run, cold in r.restored_pairs())
        gaps = [d[1] for r in group for _, run, cold in r.restored_pairs() if (d := divergence(run, cold))]
        gap_text = f"{max(gaps):.4f}" if gaps else "-"
        lines.append(
            f"| {length} | {min(r.resend.cached for r in group)}-{max(r.resend.cached for r in group)} "
            f"| {min(r.restored.cached for r in group)}-{max(r.restored.cached for r in group)} "
            f"/ {group[0].committed} | {deviation:.4f} | {gap_text} "
            f"| {max(max(r.cold.cached, r.cold_again.cached) for r in group)} |"
        )
    if bounds is not None:
        lines.append(f"\nbounds: {bounds.as_dict()}")
    return "\n".join(lines)
