"""``bc-demo``: a multi-turn conversation against vLLM with and without boundary checkpoints.

For each policy (default ``request_boundaries``, then ``aligned`` = stock vLLM behaviour) the demo
starts one OpenAI server on 127.0.0.1 with the tiny Qwen3-Next model, drives the same N-turn
conversation through it, and stops the server. Servers run one after the other: on a 2-core
machine two CPU engines at once would compete for the cores and distort the TTFT columns.

Conversation (identical inputs for every policy, drawn from ``--seed``), ``--mode tokens``
(default), through ``/v1/completions`` with token-ID prompts:
- turn 1: a system-like prefix of ``--system-tokens`` random ids + ``--user-tokens`` user ids;
- turn k > 1: previous prompt + the previous answer's token ids + ``--followup-tokens`` new ids.
Greedy, ``max_tokens=--max-tokens``, ``ignore_eos``, a per-run ``cache_salt``.

``--mode chat``: the same conversation as messages through ``/v1/chat/completions``: turn 1 is a
system message of ``--system-tokens`` words and a user message of ``--user-tokens`` words; every
later turn sends the whole conversation back (each answer as an assistant message) plus a user
message of ``--followup-tokens`` words. The server renders it with the model's chat template, so a
turn resumes at the previous answer's boundary when the template re-renders the earlier turns as
an exact token prefix (the tiny model's template does). Greedy, EOS honoured, and
``skip_special_tokens: false``: a random-weight model emits special tokens (``<unk>``, ``<s>``)
inside answers, and content with them skipped would re-render as other tokens; kept in the
content they re-render exactly, on any model, without constraining what it generates.

The table has one row per turn: the prompt length, the exact boundary the turn could resume from
(0 on turn 1; otherwise the previous turn's committed length = previous prompt + previous answer
- 1, since the last sampled token has no KV yet), ``cached_tokens`` and streaming TTFT per policy,
and, per policy, what a comparison with a cold control measured (the same prompt sent to the same
server under a fresh ``cache_salt``): the first answer token's logprob delta (the largest
|difference| over the top-2 candidates both runs report), and, if the greedy answers part, the
token index where they part and the cold run's top-2 logprob gap there. bf16 GDN kernels make two
correct runs part at near-ties (a gap of a few hundredths), which chunking alone can flip on a
random-weight model; a wrong restore shows as a first-token delta far above bf16 noise or a
parting where the cold run's top two are far apart.
Plugin and stock answers are not compared with each other: the plugin ends a prefill chunk one
token before the prompt end, and on a random-weight model that alone can flip a near-tie.

Before its conversation each server gets one throw-away request of turn 1's shape under its own
``cache_salt`` (``warm_up``; its TTFT is printed, not tabled), so turn 1's TTFT does not carry the
server's first-request costs. Under the table: one verdict line per policy computed from the
table's columns (``verdict``), and for each plugin server its hit and miss counters read from
``/metrics`` after the last request (``counter_line``). The plugin's periodic
``boundary_checkpoints: hits=...`` log line is written every ``stats_log_interval_s`` (30 s) and
only during engine steps, so the last one in the log can predate the last turns; the line says so
when it disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from bc_tools.bench import logs
from bc_tools.bench.chat_words import TINY_VOCAB_SIZE, draw_words
from bc_tools.bench.client import Completion, chat, complete, stream_complete
from bc_tools.bench.probes import Answer, first_token_deviation, same_greedy_output
from bc_tools.bench.server import (
    ServerProcess,
    ServerStartError,
    interrupt_on_termination,
    policy_config,
    start_server,
    stop_server,
    wait_until_healthy,
)

POLICY_LABELS = {"request_boundaries": "plugin", "aligned": "stock"}
# The plugin lets this variable override --additional-config; the demo sets the policy per server.
POLICY_ENV = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"
FIRST_WORD_ID, VOCAB_SIZE = 4, TINY_VOCAB_SIZE
# chat words: "w8" .. "w1023" (ids 4..7 are the tiny tokenizer's role words), drawn
# by chat_words.draw_words, which bc-bench's chat mode shares
MODES = ("tokens", "chat")
COMPARE_LOGPROBS = 2  # top-k recorded per position for the comparison with the cold control
NOISE_BOUND = 0.1
"""Logprob difference (nats) up to which the demo calls a first-token delta bf16 noise and a
parting from the cold control a near-tie (the cold run's top-2 gap there). Two correct runs of the
tiny random-weight model differ by a few hundredths; a restore wrong by one token of state moved the
first token's logprobs by 0.7-1.5 on the CPU engine (``bench/probes.py``, negative controls)."""
STATS_LOG_INTERVAL_S = 30.0  # the plugin's default stats_log_interval_s (settings.BoundaryConfig)


@dataclass
class TurnResult:
    turn: int
    prompt_tokens: int
    boundary: int
    cached_tokens: int | None
    ttft_s: float | None
    latency_s: float
    answer_ids: list[int]
    vs_cold: str = ""  # "identical" | "tie" | "different" (probes.same_greedy_output; JSON only)
    first_token_delta: float | None = None  # max |logprob delta| of the first token's top-k vs cold
    parts_at: int | None = None  # first answer index where the greedy answer leaves the cold one
    cold_gap: float | None = None  # the cold run's top-2 logprob gap at ``parts_at``


@dataclass
class ConversationPlan:
    """The new user tokens of every turn (turn 1 includes the system-like prefix)."""

    turn_inputs: list[list[int]]


def make_plan(turns: int, system_tokens: int, user_tokens: int, followup_tokens: int, seed: int) -> ConversationPlan:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]

    first = draw(system_tokens) + draw(user_tokens)
    return ConversationPlan([first] + [draw(followup_tokens) for _ in range(turns - 1)])


@dataclass
class ChatPlan:
    """The new messages of every turn (turn 1: a system and a user message; then a user message)."""

    turn_messages: list[list[dict]]


def make_chat_plan(turns: int, system_tokens: int, user_tokens: int, followup_tokens: int, seed: int) -> ChatPlan:
    """Word-level messages of the given lengths (one token per word on the tiny tokenizer)."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return draw_words(rng, n)

    first = [{"role": "user", "content": words(user_tokens)}]
    if system_tokens:
        first.insert(0, {"role": "system", "content": words(system_tokens)})
    later = [[{"role": "user", "content": words(followup_tokens)}] for _ in range(turns - 1)]
    return ChatPlan([first] + later)


def top2_gap(position: dict[int, float]) -> float | None:
    """The logprob gap between the two best recorded candidates of one position."""
    best = sorted(position.values(), reverse=True)[:2]
    return best[0] - best[1] if len(best) == 2 else None


def compare_with_cold(out: Completion, cold: Completion) -> dict:
    """What the comparison with the cold control measured (the ``TurnResult`` fields)."""
    delta = None
    if out.top_logprobs and cold.top_logprobs:
        delta = first_token_deviation(Answer(0, [], out.top_logprobs), Answer(0, [], cold.top_logprobs))
    if out.token_ids == cold.token_ids:
        return dict(vs_cold="identical", first_token_delta=delta, parts_at=None, cold_gap=None)
    pairs = zip(out.token_ids, cold.token_ids)
    parts_at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(out.token_ids), len(cold.token_ids)))
    cold_gap = top2_gap(cold.top_logprobs[parts_at]) if parts_at < len(cold.top_logprobs) else None
    vs_cold = "different"  # one answer a prefix of the other, or no logprobs to tell a near-tie by
    if parts_at < min(len(out.top_logprobs), len(cold.top_logprobs), len(out.token_ids), len(cold.token_ids)):
        vs_cold, _ = same_greedy_output(out.token_ids, cold.token_ids, out.top_logprobs, cold.top_logprobs)
    return dict(vs_cold=vs_cold, first_token_delta=delta, parts_at=parts_at, cold_gap=cold_gap)


def run_conversation(
    base_url: str, plan: ConversationPlan, *, max_tokens: int, cache_salt: str, model: str = "tiny"
) -> list[TurnResult]:
    """Drive the conversation turn by turn; each prompt extends the last by its answer ids."""
    results: list[TurnResult] = []
    prompt: list[int] = []
    boundary = 0
    for index, new_tokens in enumerate(plan.turn_inputs, start=1):
        prompt = prompt + new_tokens
        logprob_args = dict(
            model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS, return_tokens_as_token_ids=True
        )
        out = stream_complete(base_url, prompt, cache_salt=cache_salt, **logprob_args)
        cold = complete(base_url, prompt, cache_salt=f"{cache_salt}-cold-{index}", **logprob_args)
        results.append(
            TurnResult(
                turn=index,
                prompt_tokens=len(prompt),
                boundary=boundary,
                cached_tokens=out.cached_tokens,
                ttft_s=out.ttft_s,
                latency_s=out.latency_s,
                answer_ids=out.token_ids,
                **compare_with_cold(out, cold),
            )
        )
        boundary = len(prompt) + len(out.token_ids) - 1  # committed length of this turn
        prompt = prompt + out.token_ids
    return results


def run_chat_conversation(
    base_url: str, plan: ChatPlan, *, max_tokens: int, cache_salt: str, model: str = "tiny"
) -> list[TurnResult]:
    """Drive the conversation through ``/v1/chat/completions``, sending it back as messages.

    The boundary of turn k + 1 is turn k's committed length as the server counted it: the prompt
    it rendered + the answer ids - 1."""
    results: list[TurnResult] = []
    messages: list[dict] = []
    boundary = 0
    args = dict(model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS, skip_special_tokens=False)
    for index, new_messages in enumerate(plan.turn_messages, start=1):
        messages = messages + new_messages
        out = chat(base_url, messages, stream=True, cache_salt=cache_salt, **args)
        cold = chat(base_url, messages, cache_salt=f"{cache_salt}-cold-{index}", **args)
        results.append(
            TurnResult(
                turn=index,
                prompt_tokens=out.prompt_tokens,
                boundary=boundary,
                cached_tokens=out.cached_tokens,
                ttft_s=out.ttft_s,
                latency_s=out.latency_s,
                answer_ids=out.token_ids,
                **compare_with_cold(out, cold),
            )
        )
        boundary = out.prompt_tokens + len(out.token_ids) - 1
        messages = messages + [{"role": "assistant", "content": out.text}]
    return results


def warmup_input(plan: ConversationPlan | ChatPlan, seed: int = 0) -> list[int] | list[dict]:
    """A throw-away first turn of the same shape as ``plan``'s turn 1 (same token counts; chat:
    the same messages with as many words each) with other random ids or words."""
    rng = random.Random(f"bc-demo-warmup-{seed}")
    if isinstance(plan, ChatPlan):
        return [{"role": m["role"], "content": draw_words(rng, len(m["content"].split()))}
                for m in plan.turn_messages[0]]  # fmt: skip
    return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in plan.turn_inputs[0]]


def warm_up(
    base_url: str, plan: ConversationPlan | ChatPlan, *, max_tokens: int, model: str = "tiny", seed: int = 0
) -> Completion:
    """One throw-away request shaped like turn 1 (same lengths, same endpoint, streamed with the
    same logprobs) under a fresh ``cache_salt``, so the measured turn 1 excludes first-request
    costs (what the first long prompt compiles or allocates); the salt keeps it from restoring
    anything into the measured conversation. Returns the warm-up's completion (its TTFT is printed)."""
    salt = f"bc-demo-warmup-{uuid.uuid4().hex}"
    prompt = warmup_input(plan, seed)
    if isinstance(plan, ChatPlan):
        return chat(base_url, prompt, model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS,
                    skip_special_tokens=False, stream=True, cache_salt=salt)  # fmt: skip
    return stream_complete(base_url, prompt, model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS,
                           return_tokens_as_token_ids=True, cache_salt=salt)  # fmt: skip


# ---- the server's own counters (item: a log line that lags behind the table) -----------------
HITS_METRIC = "vllm:boundary_checkpoint_hits"
MISSES_METRIC = "vllm:boundary_checkpoint_misses"


def parse_checkpoint_counters(metrics_text: str) -> dict[str, dict[str, float]] | None:
    """``{"hits": {kind: n}, "misses": {reason: n}}`` from a Prometheus ``/metrics`` page (summed
    over engines and models), or None when the page has no boundary-checkpoint hit series."""
    out: dict[str, dict[str, float]] = {"hits": {}, "misses": {}}
    found = False
    for line in metrics_text.splitlines():
        for key, metric, label in (("hits", HITS_METRIC, "kind"), ("misses", MISSES_METRIC, "reason")):
            if not line.startswith(metric + "_total{"):
                continue
            labels, _, value = line[len(metric) + len("_total{") :].rpartition("} ")
            found = found or key == "hits"
            name = next((item.split("=", 1)[1].strip('"') for item in labels.split(",")
                         if item.split("=", 1)[0] == label), "?")  # fmt: skip
            out[key][name] = out[key].get(name, 0.0) + float(value)
    return out if found else None


def read_checkpoint_counters(base_url: str, timeout: float = 10.0) -> dict[str, dict[str, float]] | None:
    """The server's boundary-checkpoint counters from its ``/metrics`` (None if unavailable)."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as resp:
            return parse_checkpoint_counters(resp.read().decode("utf-8", errors="replace"))
    except OSError:
        return None


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


class Progress:
    """Spinner with elapsed seconds on a terminal; a line every 5 s otherwise."""

    FRAMES = "|/-\\"

    def __init__(self, label: str, stream=sys.stderr):
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.ticks = 0
        self.last_line = 0.0

    def tick(self, elapsed: float) -> None:
        self.ticks += 1
        if self.tty:
            frame = self.FRAMES[self.ticks % len(self.FRAMES)]
            self.stream.write(f"\r  {frame} {self.label} {elapsed:5.1f} s ")
            self.stream.flush()
        elif elapsed - self.last_line >= 5.0:
            self.last_line = elapsed
            self.stream.write(f"  ... {self.label} {elapsed:.0f} s\n")
            self.stream.flush()

    def done(self, message: str) -> None:
        if self.tty:
            self.stream.write("\r" + " " * (len(self.label) + 16) + "\r")
        self.stream.write(f"  {message}\n")
        self.stream.flush()


@dataclass
class PolicyRun:
    """What one server's run gave: the table rows and what the demo prints around them."""

    results: list[TurnResult]
    ready_s: float
    warmup_ttft_s: float | None = None
    counters: dict | None = None  # parse_checkpoint_counters of /metrics after the last request
    log_stats: dict | None = None  # the server log's last periodic boundary_checkpoints stats line


def run_policy(
    policy: str,
    model_dir: Path,
    log_dir: Path,
    plan: ConversationPlan | ChatPlan,
    *,
    max_tokens: int,
    startup_timeout: float,
    seed: int = 0,
) -> PolicyRun:
    """Start a server with ``policy``, warm it up with one throw-away request, run the
    conversation, read its counters, stop it."""
    log_path = log_dir / f"server_{policy}.log"
    server: ServerProcess | None = None
    try:
        server = start_server(model_dir, log_path, additional_config=policy_config(policy), unset_env=(POLICY_ENV,))
        progress = Progress(f"starting vLLM ({policy}, port {server.port})")
        ready_s = wait_until_healthy(server, timeout=startup_timeout, on_tick=progress.tick)
        progress.done(f"{policy}: server ready in {ready_s:.1f} s (pid {server.pid})")
        warm = warm_up(server.base_url, plan, max_tokens=max_tokens, seed=seed)
        print(f"  {policy}: warm-up request (turn 1's shape, its own cache_salt, not in the table): "
              f"TTFT {_fmt_ms(warm.ttft_s)} ms", flush=True)  # fmt: skip
        salt = f"bc-demo-{policy}-{uuid.uuid4().hex[:12]}"
        drive = run_chat_conversation if isinstance(plan, ChatPlan) else run_conversation
        results = drive(server.base_url, plan, max_tokens=max_tokens, cache_salt=salt)
        counters = read_checkpoint_counters(server.base_url)
        log_stats = logs.parse_boundary_stats(logs.read_text(log_path))
        return PolicyRun(results, ready_s, warm.ttft_s, counters, log_stats)
    finally:
        if server is not None:
            stop_server(server)


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


def _fmt_ms(value: float | None) -> str:
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
        row += [_fmt_ms(r.ttft_s) for r in per]
        row += [_fmt_delta(r.first_token_delta) for r in per]
        row += [_fmt_parts(r) for r in per]
        rows.append(row)
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """``bc-demo``'s options; every help text ends with the option's default."""
    parser = argparse.ArgumentParser(
        prog="bc-demo",
        description="Multi-turn conversation on a tiny hybrid model: boundary checkpoints vs stock. Each "
                    "server first gets one throw-away request shaped like turn 1 (not in the table).",
    )  # fmt: skip
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: build the tiny Qwen3-Next under "
                             "~/.cache/boundary_checkpoints/tiny_qwen3_next)")  # fmt: skip
    parser.add_argument("--mode", choices=MODES, default="tokens",
                        help="tokens: /v1/completions with token-ID prompts; chat: /v1/chat/completions "
                             "with the conversation sent back as messages (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--turns", type=int, default=8, help="turns of the conversation, one table row each (default: %(default)s)"
    )
    parser.add_argument("--policies", default="request_boundaries,aligned",
                        help="comma-separated policies, one server each, run in this order "
                             "(default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens per answer (greedy; tokens mode ignores EOS) (default: %(default)s)",
    )
    parser.add_argument("--system-tokens", type=int, default=300,
                        help="length of turn 1's system-like prefix (chat: words of the system message, one "
                             "token each) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--user-tokens", type=int, default=100,
                        help="new user tokens of turn 1, after the system prefix (chat: words) "
                             "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--followup-tokens", type=int, default=60,
                        help="new user tokens of every later turn, after the previous answer (chat: words) "
                             "(default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the conversation's token ids (default: %(default)s)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds each server may take to answer /health (default: %(default)s)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="directory for the server logs (default: a new temp dir)"
    )
    parser.add_argument(
        "--json-out", type=Path, default=None, help="also write the results as JSON to this file (default: none)"
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be >= 1")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policies:
        parser.error("--policies is empty")
    return args


def resolve_model(model: Path | None) -> Path:
    if model is not None:
        return model.expanduser().resolve()
    from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

    target = default_model_dir("qwen3_next", 0)
    start = time.monotonic()
    out = make_tiny_model(target, family="qwen3_next", seed=0)
    print(f"model: {out} ({time.monotonic() - start:.1f} s)")
    return out


def _run_demo(args: argparse.Namespace) -> int:
    """The demo proper: both servers, the table, the JSON file."""
    model_dir = resolve_model(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bc-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}")
    if os.environ.get(POLICY_ENV):
        print(f"note: ignoring {POLICY_ENV}={os.environ[POLICY_ENV]} for the demo's servers")
    make = make_chat_plan if args.mode == "chat" else make_plan
    plan = make(args.turns, args.system_tokens, args.user_tokens, args.followup_tokens, args.seed)
    runs: dict[str, PolicyRun] = {}
    for policy in args.policies:
        runs[policy] = run_policy(
            policy, model_dir, log_dir, plan,
            max_tokens=args.max_tokens, startup_timeout=args.startup_timeout, seed=args.seed,
        )  # fmt: skip
    results = {policy: run.results for policy, run in runs.items()}
    print()
    print(format_table(args.policies, results))
    print()
    for policy in args.policies:
        print(verdict(POLICY_LABELS.get(policy, policy), results[policy], expects_boundary=policy != "aligned"))
    for policy in args.policies:
        if policy != "aligned":
            run = runs[policy]
            print(counter_line(POLICY_LABELS.get(policy, policy), run.results, run.counters, run.log_stats))
    print()
    labels = ", ".join(f"{POLICY_LABELS.get(p, p)} = {p}" for p in args.policies)
    endpoint = "/v1/chat/completions, messages" if args.mode == "chat" else "/v1/completions, token ids"
    print(f"mode: {args.mode} ({endpoint}); columns: {labels}; "
          "boundary = committed length of the previous turn; TTFT excludes a warm-up request per server")  # fmt: skip
    print(LEGEND)
    if args.json_out:
        payload = {
            "policies": args.policies,
            "mode": args.mode,
            "server_ready_s": {p: run.ready_s for p, run in runs.items()},
            "warmup_ttft_s": {p: run.warmup_ttft_s for p, run in runs.items()},
            "server_counters": {p: run.counters for p, run in runs.items()},
            "turns": {p: [asdict(r) for r in rs] for p, rs in results.items()},
        }
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"results: {args.json_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with interrupt_on_termination():
            return _run_demo(args)
    except ServerStartError as err:
        print(f"\nserver failed to start: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
