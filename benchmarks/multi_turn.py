#!/usr/bin/env python3
"""Multi-turn serving benchmark: request-boundary checkpoints vs stock prefix caching, plus a floor.

Runs against any OpenAI-compatible ``/v1/completions`` server (``--url``), or launches vLLM servers
itself (``--launch MODEL_DIR --policies aligned,request_boundaries``), one policy after the other on
the same host/port settings, each with the plugin's ``--additional-config`` and stopped cleanly.

Workload (identical inputs for every policy; see ``make_plans``):
  N conversations x T turns; a shared system prompt of S random token ids (the same for every
  conversation); turn 1 = system + U user ids; turn k > 1 = the turn k-1 prompt + the answer ids
  that came back (``return_token_ids``) + U new user ids. Answers: ``max_tokens=A``, ``ignore_eos``,
  temperature 0. Random ids are drawn from [4, vocab) with a seeded RNG. A thread pool of C workers
  drives the conversations; each conversation advances turn by turn, independently of the others.
  Every run uses a fresh ``cache_salt`` (per policy), so runs never share cache.

Measured per request (streaming, ``stream_options.include_usage``): TTFT = time from sending the
request to the first chunk that carries text or token ids; ``cached_tokens`` from
``usage.prompt_tokens_details.cached_tokens`` (servers need ``--enable-prompt-tokens-details``).

The FLOOR (on the stock engine, i.e. the ``aligned`` server, after its conversations): for every
conversation's turns k >= 2 the TTFT of a request whose prefix is cached exactly on the block grid
and that computes as many new tokens as an exact boundary hit would (U + 1: the last answer token and
the new user ids). With the exact boundary ``b = previous prompt + previous answer - 1`` and the
block size B: ``L0 = floor(b / B) * B`` (``B`` if that is 0). A prime of ``L0 + 1`` tokens makes stock
vLLM cache ``L0``; then a timed request of ``L0 + U + 1`` tokens sharing that prefix is sent. All
primes go first; the timed requests then run like the conversations (C threads, each sending one
conversation's turns back to back, ``max_tokens=A``), so no timed request shares a step with a prime.

Block size B: ``--block-size`` if given; otherwise parsed from the launched server's log line
"Setting attention block size to N tokens" (or ``--server-log`` in ``--url`` mode); otherwise the
value of a ``--block-size`` in ``--server-arg``. Without one the floor is skipped.

Retained checkpoint memory: the last ``bytes_retained=`` of the plugin's stats line in the server
log. Plugin revisions before 0cd112e logged through loggers named ``boundary_checkpoints.*``, outside
vLLM's ``vllm`` logger tree, so vLLM's default logging dropped their INFO lines; the launcher
therefore starts its servers with ``VLLM_LOGGING_CONFIG_PATH`` pointing at a config that routes both
``vllm`` and ``boundary_checkpoints`` to stdout (unless that variable is already set;
``--no-plugin-log-config`` turns it off).

``--write-model DIR --arch ARCH`` writes a model directory (config.json + a word-level tokenizer that
covers the whole vocab) for a real-size architecture to run with ``--load-format dummy``.

Examples:
  python benchmarks/multi_turn.py --launch ~/.cache/boundary_checkpoints/tiny_qwen3_next \\
      --policies aligned,request_boundaries -N 4 -T 4 -S 300 -U 60 -A 32 -C 2 \\
      --out-json /tmp/mt.json --plot /tmp/mt.png
  python benchmarks/multi_turn.py --url http://127.0.0.1:8000 --model tiny --vocab-size 1024 ...
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import http.client
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from boundary_checkpoints.bench.client import CompletionError, build_request, iter_sse_events

FIRST_RANDOM_ID = 4  # ids 0..3 are special tokens in every model this benchmark writes
STOCK_POLICY = "aligned"
PLUGIN_POLICY = "request_boundaries"
POLICY_ENV = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"  # the plugin lets it override --additional-config
TARGETS = {
    "continuation_ttft_vs_floor": 1.1,  # plugin TTFT p50 (turns >= 2) / floor TTFT p50, at most
    "prefill_vs_stock": 0.3,  # plugin prefill tokens / stock prefill tokens, at most
    "throughput_vs_stock": 0.98,  # plugin output throughput / stock, at least
}
ARCHES = ("tiny", "qwen3_next_80b_12l", "qwen35_9b")


# ================================================================================================
# Workload and prompt construction (pure)
# ================================================================================================


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    concurrency: int
    vocab_size: int
    seed: int = 0

    def max_prompt_tokens(self) -> int:
        """Length of the last turn's prompt (answers are exactly ``answer_tokens`` long)."""
        return self.system_tokens + self.turns * self.user_tokens + (self.turns - 1) * self.answer_tokens

    def max_sequence_tokens(self) -> int:
        """Last prompt plus its answer: what must fit in the server's max model length."""
        return self.max_prompt_tokens() + self.answer_tokens


@dataclass(frozen=True)
class ConversationPlan:
    """The inputs of one conversation: the shared system ids and the new user ids of every turn."""

    index: int
    system_ids: tuple[int, ...]
    user_turns: tuple[tuple[int, ...], ...]


def draw_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` ids drawn uniformly from [FIRST_RANDOM_ID, vocab_size)."""
    if vocab_size <= FIRST_RANDOM_ID:
        raise ValueError(f"vocab_size must be > {FIRST_RANDOM_ID} (got {vocab_size})")
    return [rng.randrange(FIRST_RANDOM_ID, vocab_size) for _ in range(n)]


def make_plans(workload: Workload) -> list[ConversationPlan]:
    """Seeded inputs of every conversation; the same ``workload`` always gives the same ids.

    Conversation ``i`` draws its user turns from its own RNG, so adding conversations never
    changes the earlier ones.
    """
    system = tuple(draw_ids(random.Random(f"system-{workload.seed}"), workload.system_tokens,
                            workload.vocab_size))  # fmt: skip
    plans = []
    for i in range(workload.conversations):
        rng = random.Random(f"conversation-{workload.seed}-{i}")
        turns = tuple(tuple(draw_ids(rng, workload.user_tokens, workload.vocab_size))
                      for _ in range(workload.turns))  # fmt: skip
        plans.append(ConversationPlan(index=i, system_ids=system, user_turns=turns))
    return plans


def first_prompt(plan: ConversationPlan) -> list[int]:
    """Turn 1: the shared system ids followed by the first user ids."""
    return list(plan.system_ids) + list(plan.user_turns[0])


def next_prompt(previous_prompt: Sequence[int], answer_ids: Sequence[int], user_ids: Sequence[int]) -> list[int]:
    """Turn k: the turn k-1 prompt, the answer ids it got back, then the new user ids."""
    return list(previous_prompt) + list(answer_ids) + list(user_ids)


def exact_boundary(previous_prompt_len: int, previous_answer_len: int) -> int:
    """Committed length after a finished turn: the last sampled token has no KV yet."""
    if previous_answer_len <= 0:
        return previous_prompt_len
    return previous_prompt_len + previous_answer_len - 1


def grid_floor(n: int, block_size: int) -> int:
    """Largest multiple of ``block_size`` that is <= ``n``."""
    return (n // block_size) * block_size


def floor_prefix_len(boundary: int, block_size: int) -> int:
    """L0: the block-grid point just at or below the exact boundary (one block if that is 0)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive (got {block_size})")
    return max(block_size, grid_floor(boundary, block_size))


@dataclass(frozen=True)
class FloorPrompts:
    prefix_len: int  # L0
    prime: list[int]  # L0 + 1 tokens: makes stock vLLM cache L0
    timed: list[int]  # L0 + new_tokens tokens, sharing the first L0 (+1) with the prime


def floor_prompts(prompt: Sequence[int], boundary: int, new_tokens: int, block_size: int,
                  filler: Callable[[int], list[int]] | None = None) -> FloorPrompts:  # fmt: skip
    """The prime and timed floor requests for a turn whose prompt is ``prompt`` and whose exact
    boundary is ``boundary`` (``prompt[boundary:]`` are the ``new_tokens`` tokens an exact hit
    computes).

    The timed request is ``prefix + prompt[boundary:boundary + new_tokens]`` where ``prefix`` is
    the first L0 ids of ``prompt`` (extended with ``filler(k)`` ids when L0 > boundary, which only
    happens when the boundary is shorter than one block). The prime is ``prefix`` + the first id
    of the computed part.
    """
    if new_tokens <= 0:
        raise ValueError("new_tokens must be positive")
    tail = list(prompt[boundary:boundary + new_tokens])
    if len(tail) != new_tokens:
        raise ValueError(f"prompt has {len(prompt)} ids; boundary {boundary} + {new_tokens} overruns it")
    l0 = floor_prefix_len(boundary, block_size)
    prefix = list(prompt[:min(l0, boundary)])
    if len(prefix) < l0:
        if filler is None:
            raise ValueError(f"L0={l0} exceeds the boundary {boundary}: a filler is needed")
        prefix += filler(l0 - len(prefix))
    return FloorPrompts(prefix_len=l0, prime=prefix + tail[:1], timed=prefix + tail)


# ================================================================================================
# Statistics (pure)
# ================================================================================================


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks; None if
    there are no values."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100] (got {q})")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(data[lo])
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def safe_ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclass
class RequestRecord:
    """One request of the run (written to --out-json)."""

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
    start_s: float  # seconds since the policy's phase started
    end_s: float
    finish_reason: str | None = None
    answer_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - (self.cached_tokens or 0)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (one engine step at steady decode)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


def summarize_policy(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Aggregates of the ``conversation`` records of one policy."""
    conv = [r for r in records if r.phase == "conversation" and r.error is None]
    prompt = sum(r.prompt_tokens for r in conv)
    cached = sum(r.cached_tokens or 0 for r in conv)
    completion = sum(r.completion_tokens for r in conv)
    wall = (max(r.end_s for r in conv) - min(r.start_s for r in conv)) if conv else 0.0
    ttft_all = [r.ttft_s for r in conv]
    ttft_cont = [r.ttft_s for r in conv if r.turn >= 2]
    later = [r for r in conv if r.turn >= 2]
    return {
        "requests": len(conv),
        "errors": sum(1 for r in records if r.phase == "conversation" and r.error is not None),
        "missing_cached_tokens": sum(1 for r in conv if r.cached_tokens is None),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": safe_ratio(cached, prompt),
        "prefill_tokens": prompt - cached,
        "completion_tokens": completion,
        "wall_s": wall,
        "output_throughput_tok_s": safe_ratio(completion, wall),
        "ttft_p50_s": percentile(ttft_all, 50),
        "ttft_p95_s": percentile(ttft_all, 95),
        "ttft_cont_p50_s": percentile(ttft_cont, 50),
        "ttft_cont_p95_s": percentile(ttft_cont, 95),
        "tpot_p50_s": percentile([r.tpot_s for r in conv], 50),
        "prefill_cont_tokens": sum(r.prefill_tokens for r in later),
        "exact_hits": sum(1 for r in later if r.cached_tokens == r.boundary),
        "later_turns": len(later),
    }


def summarize_floor(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    timed = [r for r in records if r.phase == "floor" and r.error is None]
    if not timed:
        return None
    return {
        "requests": len(timed),
        "ttft_p50_s": percentile([r.ttft_s for r in timed], 50),
        "ttft_p95_s": percentile([r.ttft_s for r in timed], 95),
        "tpot_p50_s": percentile([r.tpot_s for r in timed], 50),
        "cached_as_primed": sum(1 for r in timed if r.cached_tokens == r.boundary),
        "mean_prefix_len": sum(r.boundary for r in timed) / len(timed),
        "mean_computed_tokens": sum(r.prefill_tokens for r in timed) / len(timed),
    }


def per_turn(records: Sequence[RequestRecord], phase: str = "conversation") -> dict[int, dict[str, Any]]:
    """Per turn: mean prompt / boundary / cached tokens and TTFT p50 of ``phase`` records."""
    out: dict[int, dict[str, Any]] = {}
    for turn in sorted({r.turn for r in records if r.phase == phase}):
        rows = [r for r in records if r.phase == phase and r.turn == turn and r.error is None]
        if not rows:
            continue
        n = len(rows)
        out[turn] = {
            "requests": n,
            "prompt_tokens": sum(r.prompt_tokens for r in rows) / n,
            "boundary": sum(r.boundary for r in rows) / n,
            "cached_tokens": sum(r.cached_tokens or 0 for r in rows) / n,
            "ttft_p50_s": percentile([r.ttft_s for r in rows], 50),
        }
    return out


def compare(summaries: dict[str, dict], floor: dict | None, stock: str = STOCK_POLICY,
            plugin: str = PLUGIN_POLICY) -> dict[str, Any]:  # fmt: skip
    """The three target ratios (None where a side is missing) and whether each is met."""
    s, p = summaries.get(stock), summaries.get(plugin)
    ratios = {
        "continuation_ttft_vs_floor": safe_ratio(p and p["ttft_cont_p50_s"], floor and floor["ttft_p50_s"]),
        "prefill_vs_stock": safe_ratio(p and p["prefill_tokens"], s and s["prefill_tokens"]),
        "throughput_vs_stock": safe_ratio(p and p["output_throughput_tok_s"], s and s["output_throughput_tok_s"]),
    }
    # Informational (no target): the same prefill ratio over turns >= 2 only.
    info = {"prefill_cont_vs_stock": safe_ratio(p and p.get("prefill_cont_tokens"), s and s.get("prefill_cont_tokens"))}
    passed: dict[str, bool | None] = {}
    for key, value in ratios.items():
        if value is None:
            passed[key] = None
        elif key == "throughput_vs_stock":
            passed[key] = value >= TARGETS[key]
        else:
            passed[key] = value <= TARGETS[key]
    return {"ratios": ratios, "targets": dict(TARGETS), "passed": passed, "info": info}


# ================================================================================================
# Server-log parsing (pure)
# ================================================================================================

_STATS_RE = re.compile(r"boundary_checkpoints: ((?:\w+=-?\d+(?:, )?)+)\s*$")
_BLOCK_SIZE_RES = (
    re.compile(r"Setting attention block size to (\d+) tokens"),
)


def parse_boundary_stats(log_text: str) -> dict[str, int] | None:
    """The counters of the last ``boundary_checkpoints: name=value, ...`` line, or None."""
    last = None
    for line in log_text.splitlines():
        if "boundary_checkpoints: " not in line or "=" not in line:
            continue
        m = _STATS_RE.search(line.rstrip())
        if m:
            last = m.group(1)
    if last is None:
        return None
    stats = {}
    for item in last.split(","):
        name, _, value = item.strip().partition("=")
        if name:
            stats[name] = int(value)
    return stats


def parse_bytes_retained(log_text: str) -> int | None:
    """The last ``bytes_retained=N`` value of the plugin's stats lines, or None."""
    stats = parse_boundary_stats(log_text)
    if stats is not None and "bytes_retained" in stats:
        return stats["bytes_retained"]
    found = re.findall(r"boundary_checkpoints:.*\bbytes_retained=(\d+)", log_text)
    return int(found[-1]) if found else None


def parse_block_size(log_text: str) -> int | None:
    """The attention block size vLLM chose ("Setting attention block size to N tokens ..."),
    the last one in the log, or None."""
    for regex in _BLOCK_SIZE_RES:
        found = regex.findall(log_text)
        if found:
            return int(found[-1])
    return None


def server_arg_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` / ``flag=VALUE`` in an argv (argparse: last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def read_text(path: str | os.PathLike | None) -> str:
    if not path:
        return ""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def plugin_logging_config() -> dict:
    """A ``VLLM_LOGGING_CONFIG_PATH`` config: vLLM's loggers plus the plugin's, at INFO, on stdout."""
    handler = {"handlers": ["bench"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "bench": {
                "format": "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
                          "[%(filename)s:%(lineno)d] %(message)s",
                "datefmt": "%m-%d %H:%M:%S",
            }
        },
        "handlers": {
            "bench": {"class": "logging.StreamHandler", "formatter": "bench", "level": "INFO",
                      "stream": "ext://sys.stdout"},
        },
        "loggers": {"vllm": dict(handler), "boundary_checkpoints": dict(handler)},
    }  # fmt: skip


# ================================================================================================
# HTTP
# ================================================================================================


@dataclass
class StreamResult:
    token_ids: list[int]
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    ttft_s: float | None
    latency_s: float


def stream_completion(base_url: str, prompt_ids: Sequence[int], *, model: str, max_tokens: int,
                      cache_salt: str, timeout: float = 600.0) -> StreamResult:  # fmt: skip
    """One streamed token-ID completion. TTFT = first chunk whose choice carries text or ids."""
    body = build_request(list(prompt_ids), model=model, max_tokens=max_tokens, cache_salt=cache_salt,
                         stream=True)  # fmt: skip
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    start = time.perf_counter()
    ttft = None
    token_ids: list[int] = []
    usage: dict = {}
    finish = None
    try:
        resp = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        detail = err.read().decode("utf-8", errors="replace")[:2000]
        raise CompletionError(f"HTTP {err.code} from {base_url}/v1/completions: {detail}") from err
    with resp:
        for event in iter_sse_events(resp):
            if "error" in event and "choices" not in event:
                raise CompletionError(f"stream error: {event['error']}")
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ttft is None and (ids or choice.get("text")):
                    ttft = time.perf_counter() - start
                token_ids.extend(int(t) for t in ids)
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                usage = event["usage"]
    latency = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return StreamResult(
        token_ids=token_ids,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
        finish_reason=finish,
        ttft_s=ttft,
        latency_s=latency,
    )


# ================================================================================================
# Running one server's workload
# ================================================================================================


class Progress:
    """A tqdm bar (vLLM depends on tqdm); a plain counter if tqdm is missing."""

    def __init__(self, total: int, desc: str):
        self._lock = threading.Lock()
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self._bar = None
            self._n, self._total, self._desc = 0, total, desc

    def update(self, postfix: str | None = None) -> None:
        with self._lock:
            if self._bar is not None:
                if postfix:
                    self._bar.set_postfix_str(postfix, refresh=False)
                self._bar.update(1)
            else:
                self._n += 1
                print(f"  {self._desc}: {self._n}/{self._total}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class Target:
    """Where one policy's requests go."""

    label: str  # policy name (launch mode) or --label (url mode)
    base_url: str
    model: str


class PolicyRun:
    """Drives the conversations (and optionally the floor) against one server."""

    def __init__(self, target: Target, workload: Workload, plans: list[ConversationPlan], salt: str,
                 *, block_size: int | None, measure_floor: bool, request_timeout: float = 600.0):  # fmt: skip
        self.target = target
        self.workload = workload
        self.plans = plans
        self.salt = salt
        self.block_size = block_size
        self.measure_floor = measure_floor and block_size is not None
        self.request_timeout = request_timeout
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        # Prompts of every turn, per conversation, for the floor phase.
        self.turn_prompts: dict[int, list[tuple[list[int], int]]] = {}
        self._floor_plans: dict[int, list[tuple[int, FloorPrompts]]] = {}
        self.phase_wall: dict[str, float] = {}

    def _send(self, prompt: list[int], *, max_tokens: int, salt: str, phase: str, conversation: int,
              turn: int, boundary: int) -> RequestRecord:  # fmt: skip
        start = time.perf_counter() - self._t0
        try:
            res = stream_completion(self.target.base_url, prompt, model=self.target.model,
                                    max_tokens=max_tokens, cache_salt=salt,
                                    timeout=self.request_timeout)  # fmt: skip
            error = None
        except (CompletionError, OSError, ValueError, http.client.HTTPException) as err:
            res = StreamResult([], None, None, None, None, None, 0.0)
            error = f"{type(err).__name__}: {err}"[:2000]
        end = time.perf_counter() - self._t0
        record = RequestRecord(
            policy=self.target.label, phase=phase, conversation=conversation, turn=turn,
            prompt_tokens=res.prompt_tokens if res.prompt_tokens is not None else len(prompt),
            cached_tokens=res.cached_tokens,
            completion_tokens=res.completion_tokens if res.completion_tokens is not None else len(res.token_ids),
            boundary=boundary, ttft_s=res.ttft_s, latency_s=res.latency_s, start_s=start, end_s=end,
            finish_reason=res.finish_reason, answer_ids=res.token_ids, error=error,
        )  # fmt: skip
        with self._lock:
            self.records.append(record)
        return record

    # ---- phases ----------------------------------------------------------------------------------
    def warm_up(self, rounds: int = 1) -> None:
        """Throw-away conversations (2 turns, own salt and own ids) so that the timed phases
        exclude first-call costs (kernel compiles, allocator growth)."""
        w = self.workload
        for i in range(rounds):
            rng = random.Random(f"warmup-{w.seed}-{i}")
            salt = f"{self.salt}-warmup-{i}"
            prompt = draw_ids(rng, w.system_tokens + w.user_tokens, w.vocab_size)
            first = self._send(prompt, max_tokens=w.answer_tokens, salt=salt, phase="warmup",
                               conversation=-1 - i, turn=1, boundary=0)  # fmt: skip
            if first.error:
                raise CompletionError(f"warm-up request failed: {first.error}")
            prompt2 = next_prompt(prompt, first.answer_ids, draw_ids(rng, w.user_tokens, w.vocab_size))
            self._send(prompt2, max_tokens=w.answer_tokens, salt=salt, phase="warmup",
                       conversation=-1 - i, turn=2,
                       boundary=exact_boundary(len(prompt), len(first.answer_ids)))  # fmt: skip

    def _conversation(self, plan: ConversationPlan, progress: Progress) -> None:
        w = self.workload
        prompt = first_prompt(plan)
        boundary = 0
        answer: list[int] = []
        history: list[tuple[list[int], int]] = []
        for turn in range(1, w.turns + 1):
            if turn > 1:
                prompt = next_prompt(prompt, answer, plan.user_turns[turn - 1])
            rec = self._send(prompt, max_tokens=w.answer_tokens, salt=self.salt, phase="conversation",
                             conversation=plan.index, turn=turn, boundary=boundary)  # fmt: skip
            history.append((prompt, boundary))
            progress.update(_postfix(rec))
            if rec.error:
                break  # later turns need this answer
            answer = rec.answer_ids
            boundary = exact_boundary(len(prompt), len(answer))
        with self._lock:
            self.turn_prompts[plan.index] = history

    def _floor_plan(self, index: int) -> list[tuple[int, FloorPrompts]]:
        """(turn, prompts) of the floor requests of one conversation (turns >= 2)."""
        w = self.workload
        filler_rng = random.Random(f"floor-filler-{w.seed}-{index}")
        out = []
        for turn, (prompt, boundary) in enumerate(self.turn_prompts.get(index, []), start=1):
            if turn >= 2:
                fp = floor_prompts(prompt, boundary, w.user_tokens + 1, self.block_size,
                                   filler=lambda k: draw_ids(filler_rng, k, w.vocab_size))  # fmt: skip
                out.append((turn, fp))
        return out

    def _floor_primes(self, index: int, progress: Progress) -> None:
        for turn, fp in self._floor_plans[index]:
            rec = self._send(fp.prime, max_tokens=1, salt=f"{self.salt}-floor", phase="floor_prime",
                             conversation=index, turn=turn, boundary=fp.prefix_len)  # fmt: skip
            progress.update(_postfix(rec))

    def _floor_timed(self, index: int, progress: Progress) -> None:
        for turn, fp in self._floor_plans[index]:
            rec = self._send(fp.timed, max_tokens=self.workload.answer_tokens, salt=f"{self.salt}-floor",
                             phase="floor", conversation=index, turn=turn, boundary=fp.prefix_len)  # fmt: skip
            progress.update(_postfix(rec))

    def _pool(self, fn: Callable[[int, Progress], None], items: list, desc: str, total: int) -> float:
        progress = Progress(total, desc)
        start = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=self.workload.concurrency) as pool:
                futures = [pool.submit(fn, item, progress) for item in items]
                for fut in concurrent.futures.as_completed(futures):
                    fut.result()
        finally:
            progress.close()
        return time.perf_counter() - start

    def run_conversations(self) -> None:
        w = self.workload
        self.phase_wall["conversation"] = self._pool(
            self._conversation, self.plans, f"{self.target.label}: conversations", w.conversations * w.turns)

    def run_floor(self) -> None:
        """Prime every floor prefix first, then send the timed requests with the same cadence as the
        conversations (C threads, each conversation's turns back to back), so that the timed
        requests never share engine steps with a prime's prefill."""
        w = self.workload
        if not self.measure_floor or w.turns < 2:
            return
        indices = [p.index for p in self.plans]
        self._floor_plans = {i: self._floor_plan(i) for i in indices}
        total = sum(len(v) for v in self._floor_plans.values())
        self.phase_wall["floor_prime"] = self._pool(
            self._floor_primes, indices, f"{self.target.label}: floor primes", total)
        self.phase_wall["floor"] = self._pool(
            self._floor_timed, indices, f"{self.target.label}: floor", total)


def _postfix(rec: RequestRecord) -> str:
    if rec.error:
        return "error"
    ttft = f"{rec.ttft_s * 1000:.0f}ms" if rec.ttft_s is not None else "-"
    return f"turn {rec.turn} cached {rec.cached_tokens}/{rec.prompt_tokens} ttft {ttft}"


# ================================================================================================
# Model directories (--write-model)
# ================================================================================================


def _arch_config(arch: str):
    """The transformers config object of a real-size architecture (weights: --load-format dummy)."""
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if arch == "qwen3_next_80b_12l":
        from transformers import Qwen3NextConfig

        # Qwen3-Next-80B-A3B dimensions, cut to 12 layers: 9 Gated DeltaNet + 3 full attention.
        config = Qwen3NextConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=5120,
            num_hidden_layers=12, full_attention_interval=4,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, max_position_embeddings=262144, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            dtype="bfloat16", **special,
        )  # fmt: skip
        config.architectures = ["Qwen3NextForCausalLM"]
        return config
    if arch == "qwen35_9b":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        # transformers' Qwen3_5TextConfig defaults are the Qwen3.5-9B text dims: hidden 4096,
        # 32 layers (24 Gated DeltaNet + 8 gated attention), 16 Q / 4 KV heads of 256, GDN 16 key /
        # 32 value heads of 128, dense MLP 12288, vocab 248320.
        config = Qwen3_5TextConfig(max_position_embeddings=262144, tie_word_embeddings=False,
                                   dtype="bfloat16", **special)  # fmt: skip
        config.architectures = ["Qwen3_5ForCausalLM"]
        return config
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHES)}")


def write_word_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int = 262144) -> None:
    """A word-level tokenizer with exactly ``vocab_size`` entries: ``<unk> <s> </s> <pad>`` then
    ``w4 .. w{vocab_size-1}``, split on whitespace, so any id list decodes to text and back."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(FIRST_RANDOM_ID, vocab_size)]
    backend = Tokenizer(WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tokenizer.chat_template = (
        "{% for message in messages %}<s> {{ message['role'] }} {{ message['content'] }} </s> "
        "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"
    )
    tokenizer.save_pretrained(str(out_dir))


def write_model(out_dir: str | os.PathLike, arch: str) -> Path:
    """Write a model directory for ``arch`` and return it (see the module docstring)."""
    out = Path(out_dir).expanduser().resolve()
    if arch == "tiny":
        from boundary_checkpoints.fixtures.tiny_models import make_tiny_model

        return make_tiny_model(out, family="qwen3_next", seed=0)
    config = _arch_config(arch)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False}, indent=2) + "\n")
    write_word_tokenizer(out, config.vocab_size)
    (out / "bench_model.json").write_text(json.dumps(
        {"arch": arch, "weights": "none: run with --load-format dummy"}, indent=2) + "\n")
    return out


def model_vocab_size(model_dir: str | os.PathLike) -> int | None:
    """``vocab_size`` of a model directory's config.json (text_config first), or None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or {}
    return text.get("vocab_size") or config.get("vocab_size")


# ================================================================================================
# Reporting
# ================================================================================================


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _ratio(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _bytes(v: int | None) -> str:
    if v is None:
        return "n/a"
    return f"{v / 2**20:.1f} MiB ({v} B)"


def format_table(header: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def summary_table(result: dict, markdown: bool = False) -> str:
    labels = result["policies"]
    summ = result["summary"]["policies"]
    stock = STOCK_POLICY if STOCK_POLICY in summ else None
    floor = result["summary"].get("floor")
    rows: list[list[str]] = []

    def row(name: str, fn: Callable[[str, dict], str]) -> None:
        rows.append([name] + [fn(p, summ[p]) for p in labels])

    row("requests (errors)", lambda p, s: f"{s['requests']} ({s['errors']})")
    row("prompt tokens", lambda p, s: str(s["prompt_tokens"]))
    row("cached tokens", lambda p, s: str(s["cached_tokens"]))
    row("cached-token ratio", lambda p, s: _ratio(s["cached_ratio"], 3))
    row("prefill tokens computed", lambda p, s: str(s["prefill_tokens"]))
    if stock:
        row(f"prefill vs {stock}",
            lambda p, s: _ratio(safe_ratio(s["prefill_tokens"], summ[stock]["prefill_tokens"]), 3))  # fmt: skip
    row("prefill tokens, turns >= 2", lambda p, s: str(s["prefill_cont_tokens"]))
    if stock:
        row(f"prefill turns >= 2 vs {stock}",
            lambda p, s: _ratio(safe_ratio(s["prefill_cont_tokens"], summ[stock]["prefill_cont_tokens"]),
                                3))  # fmt: skip
    row("exact hits (turns >= 2)", lambda p, s: f"{s['exact_hits']}/{s['later_turns']}")
    row("TTFT p50 / p95 ms, all turns", lambda p, s: f"{_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p95_s'])}")
    row("TTFT p50 / p95 ms, turns >= 2", lambda p, s: f"{_ms(s['ttft_cont_p50_s'])} / {_ms(s['ttft_cont_p95_s'])}")
    if floor:
        row("TTFT p50 turns >= 2 / floor p50",
            lambda p, s: _ratio(safe_ratio(s["ttft_cont_p50_s"], floor["ttft_p50_s"])))  # fmt: skip
    row("time per output token p50 ms", lambda p, s: _ms(s["tpot_p50_s"]) if s["tpot_p50_s"] is None
        else f"{s['tpot_p50_s'] * 1000:.1f}")  # fmt: skip
    row("output throughput tok/s", lambda p, s: _ratio(s["output_throughput_tok_s"], 1))
    if stock:
        row(f"throughput vs {stock}",
            lambda p, s: _ratio(safe_ratio(s["output_throughput_tok_s"], summ[stock]["output_throughput_tok_s"]),
                                3))  # fmt: skip
    row("retained checkpoint memory", lambda p, s: _bytes(result["servers"].get(p, {}).get("bytes_retained")))
    row("preemptions (conversations)", lambda p, s: str(result["servers"].get(p, {}).get("preemptions", "-")))
    first = labels[0]
    if len(labels) > 1:
        same = result["summary"]["same_answers"]
        row(f"answers same as {first}", lambda p, s: "-" if p == first else same.get(p, "-"))
    text = format_table(["metric"] + labels, rows, markdown)
    if floor:
        text += (
            ("\n\n" if markdown else "\n")
            + f"floor ({floor['policy']} server, {floor['requests']} requests, prefix L0 on the "
            f"{result['block_size']}-token grid, mean L0 {floor['mean_prefix_len']:.0f}, "
            f"{floor['mean_computed_tokens']:.0f} tokens computed, cached as primed "
            f"{floor['cached_as_primed']}/{floor['requests']}): TTFT p50 {_ms(floor['ttft_p50_s'])} ms, "
            f"p95 {_ms(floor['ttft_p95_s'])} ms, time per output token p50 "
            f"{(floor['tpot_p50_s'] or 0) * 1000:.1f} ms"
        )
    return text


def targets_text(result: dict) -> str:
    cmp = result["summary"].get("targets")
    if not cmp:
        return ""
    names = {
        "continuation_ttft_vs_floor": f"{PLUGIN_POLICY} TTFT p50 (turns >= 2) / floor p50",
        "prefill_vs_stock": f"{PLUGIN_POLICY} prefill tokens / {STOCK_POLICY}",
        "throughput_vs_stock": f"{PLUGIN_POLICY} output throughput / {STOCK_POLICY}",
    }
    lines = ["targets:"]
    for key, name in names.items():
        value = cmp["ratios"][key]
        op = ">=" if key == "throughput_vs_stock" else "<="
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[cmp["passed"][key]]
        lines.append(f"  {name:55s} {_ratio(value, 3):>6s}  (target {op} {TARGETS[key]})  {verdict}")
    cont = (cmp.get("info") or {}).get("prefill_cont_vs_stock")
    if cont is not None:
        lines.append(f"  {'(no target) the same prefill ratio over turns >= 2':55s} {_ratio(cont, 3):>6s}")
    return "\n".join(lines)


def per_turn_table(result: dict, markdown: bool = False) -> str:
    labels = result["policies"]
    turns = result["summary"]["per_turn"]
    floor_turns = result["summary"].get("floor_per_turn") or {}
    header = ["turn", "prompt", "exact boundary"]
    header += [f"cached {p}" for p in labels] + [f"TTFT p50 ms {p}" for p in labels]
    if floor_turns:
        header += ["floor L0", "floor TTFT p50 ms"]
    rows = []
    all_turns = sorted({int(t) for p in labels for t in turns[p]})
    for t in all_turns:
        base = next((turns[p][str(t)] for p in labels if str(t) in turns[p]), None)
        row = [str(t), f"{base['prompt_tokens']:.0f}", f"{base['boundary']:.0f}"]
        row += [f"{turns[p][str(t)]['cached_tokens']:.0f}" if str(t) in turns[p] else "-" for p in labels]
        row += [_ms(turns[p][str(t)]["ttft_p50_s"]) if str(t) in turns[p] else "-" for p in labels]
        if floor_turns:
            ft = floor_turns.get(str(t))
            row += [f"{ft['boundary']:.0f}", _ms(ft["ttft_p50_s"])] if ft else ["-", "-"]
        rows.append(row)
    return format_table(header, rows, markdown)


def plot_results(result: dict, path: Path) -> bool:
    """TTFT p50 and mean cached tokens per turn, per policy and the floor. False if matplotlib is
    missing (a message says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, (ax_ttft, ax_cached) = plt.subplots(1, 2, figsize=(11, 4.2))
    turns = result["summary"]["per_turn"]
    for label in result["policies"]:
        ts = sorted(int(t) for t in turns[label])
        ax_ttft.plot(ts, [turns[label][str(t)]["ttft_p50_s"] * 1000 for t in ts], marker="o", label=label)
        ax_cached.plot(ts, [turns[label][str(t)]["cached_tokens"] for t in ts], marker="o", label=label)
    floor_turns = result["summary"].get("floor_per_turn") or {}
    if floor_turns:
        ts = sorted(int(t) for t in floor_turns)
        ax_ttft.plot(ts, [floor_turns[str(t)]["ttft_p50_s"] * 1000 for t in ts], marker="s",
                     linestyle="--", color="black", label="floor")  # fmt: skip
        ax_cached.plot(ts, [floor_turns[str(t)]["cached_tokens"] for t in ts], marker="s",
                       linestyle="--", color="black", label="floor (L0)")  # fmt: skip
    first = result["policies"][0]
    ts = sorted(int(t) for t in turns[first])
    later = [t for t in ts if t >= 2]
    ax_cached.plot(later, [turns[first][str(t)]["boundary"] for t in later], color="gray", linewidth=5,
                   alpha=0.35, zorder=0, label="exact boundary")  # fmt: skip
    w = result["workload"]
    ax_ttft.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="time to first token")
    ax_cached.set(xlabel="turn", ylabel="cached tokens (mean)", title="cached prompt tokens")
    for ax in (ax_ttft, ax_cached):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_xticks(ts)
    fig.suptitle(f"multi-turn: N={w['conversations']} T={w['turns']} S={w['system_tokens']} "
                 f"U={w['user_tokens']} A={w['answer_tokens']} C={w['concurrency']}, "
                 f"block {result.get('block_size')}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_result(workload: Workload, policies: list[str], runs: dict[str, PolicyRun],
                 servers: dict[str, dict], block_size: int | None, block_source: str,
                 floor_label: str | None, meta: dict) -> dict:  # fmt: skip
    records = [r for label in policies for r in runs[label].records]
    summaries = {p: summarize_policy(runs[p].records) for p in policies}
    floor = summarize_floor(runs[floor_label].records) if floor_label in runs else None
    if floor:
        floor["policy"] = floor_label
    same: dict[str, str] = {}
    base = {(r.conversation, r.turn): r.answer_ids for r in runs[policies[0]].records if r.phase == "conversation"}
    for p in policies[1:]:
        pairs = [(r.answer_ids, base.get((r.conversation, r.turn)))
                 for r in runs[p].records if r.phase == "conversation"]  # fmt: skip
        same[p] = f"{sum(1 for a, b in pairs if a == b)}/{len(pairs)}"
    per_turn_all = {p: {str(k): v for k, v in per_turn(runs[p].records).items()} for p in policies}
    floor_per_turn = (
        {str(k): v for k, v in per_turn(runs[floor_label].records, "floor").items()} if floor else None
    )
    return {
        "meta": meta,
        "workload": asdict(workload),
        "policies": policies,
        "block_size": block_size,
        "block_size_source": block_source,
        "servers": servers,
        "summary": {
            "policies": summaries,
            "floor": floor,
            "targets": compare(summaries, floor),
            "same_answers": same,
            "per_turn": per_turn_all,
            "floor_per_turn": floor_per_turn,
            "phase_wall_s": {p: runs[p].phase_wall for p in policies},
        },
        "records": [dict(asdict(r), prefill_tokens=r.prefill_tokens, tpot_s=r.tpot_s) for r in records],
    }


# ================================================================================================
# Orchestration
# ================================================================================================


def _signal_to_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _split_server_args(values: list[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        out += shlex.split(v)
    return out


def resolve_block_size(cli_value: int | None, log_text: str, server_args: Sequence[str]) -> tuple[int | None, str]:
    """(B, where it came from): --block-size, else the server log line, else a --block-size in the
    server args, else (None, 'unknown')."""
    if cli_value:
        return cli_value, "--block-size"
    parsed = parse_block_size(log_text)
    if parsed:
        return parsed, "server log ('Setting attention block size to N tokens')"
    arg = server_arg_value(server_args, "--block-size")
    if arg and arg.isdigit():
        return int(arg), "--server-arg --block-size"
    return None, "unknown"


def _startup_ticker(label: str, every_s: float = 15.0) -> Callable[[float], None]:
    """An ``on_tick`` for ``wait_until_healthy`` that prints a line every ``every_s`` seconds."""
    last = [0.0]

    def tick(elapsed: float) -> None:
        if elapsed - last[0] >= every_s:
            last[0] = elapsed
            print(f"[{label}] ... waiting for the server ({elapsed:.0f} s)", flush=True)

    return tick


def flush_plugin_stats(target: Target, interval: float, salt: str) -> None:
    """Make the engine log one more stats line after the run: wait out the interval, then send a
    tiny request (its own checkpoints are published after the line it triggers)."""
    time.sleep(interval + 0.3)
    try:
        stream_completion(target.base_url, [FIRST_RANDOM_ID] * 4, model=target.model, max_tokens=1,
                          cache_salt=f"{salt}-flush", timeout=60)  # fmt: skip
    except (CompletionError, OSError, ValueError, http.client.HTTPException):
        pass
    time.sleep(0.5)


def scrape_preemptions(base_url: str) -> int | None:
    """vLLM's ``vllm:num_preemptions`` counter from the server's ``/metrics`` (summed over its
    label sets), or None when the endpoint or the counter is missing."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:num_preemptions_total")]  # fmt: skip
    return int(sum(values)) if values else None


def run_launch(args, workload: Workload, plans: list[ConversationPlan], run_salt: str):
    from boundary_checkpoints.bench.server import (
        ServerStartError,
        build_command,
        find_free_port,
        start_server,
        stop_server,
        wait_until_healthy,
    )  # fmt: skip

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bc-multi-turn-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}")
    server_args = _split_server_args(args.server_arg)
    env: dict[str, str] = dict(item.split("=", 1) for item in args.server_env)
    log_config_set = "VLLM_LOGGING_CONFIG_PATH" in env or os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if args.plugin_log_config and not log_config_set:
        cfg_path = Path(tempfile.mkdtemp(prefix="bc-multi-turn-logging-")) / "logging_config.json"
        cfg_path.write_text(json.dumps(plugin_logging_config(), indent=2) + "\n")
        env["VLLM_LOGGING_CONFIG_PATH"] = str(cfg_path)
    extra_cfg = json.loads(args.additional_config) if args.additional_config else {}
    port = args.port or find_free_port(args.host)
    model_name = args.model or Path(args.launch).name
    full_argv = build_command(args.launch, port, extra_args=server_args)
    max_len = server_arg_value(full_argv, "--max-model-len")
    if max_len and max_len.isdigit() and workload.max_sequence_tokens() > int(max_len):
        raise SystemExit(f"the last turn needs {workload.max_sequence_tokens()} tokens but "
                         f"--max-model-len is {max_len}: pass --server-arg='--max-model-len N'")  # fmt: skip
    runs: dict[str, PolicyRun] = {}
    servers: dict[str, dict] = {}
    block_size, block_source = args.block_size, "--block-size" if args.block_size else "unknown"
    floor_label = STOCK_POLICY if (args.floor is not False and STOCK_POLICY in args.policies) else None
    for policy in args.policies:
        additional = dict(extra_cfg)
        section = dict(additional.get("boundary_checkpoints") or {})
        section.update({**args.sections[policy], "stats_log_interval_s": args.stats_log_interval})
        additional["boundary_checkpoints"] = section
        log_path = log_dir / f"server_{policy}.log"
        print(f"[{policy}] starting vLLM on {args.host}:{port} (log {log_path})", flush=True)
        server = start_server(args.launch, log_path, host=args.host, port=port, served_model_name=model_name,
                              additional_config=additional, extra_args=server_args, env=env,
                              unset_env=(POLICY_ENV,))  # fmt: skip
        info: dict[str, Any] = {"command": server.command, "log_path": str(log_path)}
        servers[policy] = info
        try:
            ready = wait_until_healthy(server, timeout=args.startup_timeout, on_tick=_startup_ticker(policy))
            info["ready_s"] = ready
            print(f"[{policy}] ready in {ready:.1f} s", flush=True)
            log_text = read_text(log_path)
            info["block_size_in_log"] = parse_block_size(log_text)
            if not args.block_size:
                b, src = resolve_block_size(None, log_text, server.command)
                if b is not None:
                    if block_size is not None and b != block_size:
                        print(f"warning: block size {b} on {policy} differs from {block_size} "
                              f"(keeping {block_size})", file=sys.stderr)  # fmt: skip
                    else:
                        block_size, block_source = b, src
            target = Target(label=policy, base_url=server.base_url, model=model_name)
            run = PolicyRun(target, workload, plans, f"{run_salt}-{policy}", block_size=block_size,
                            measure_floor=(policy == floor_label), request_timeout=args.request_timeout)  # fmt: skip
            runs[policy] = run
            if policy == floor_label and block_size is None:
                print("warning: block size unknown (no log line, no --block-size): floor skipped", file=sys.stderr)
            run.warm_up(args.warmup)
            run.run_conversations()
            info["preemptions"] = scrape_preemptions(server.base_url)
            if policy != STOCK_POLICY and args.stats_log_interval > 0:
                flush_plugin_stats(target, args.stats_log_interval, run.salt)
            run.run_floor()
            log_text = read_text(log_path)
            info["boundary_stats"] = parse_boundary_stats(log_text)
            info["bytes_retained"] = None if policy == STOCK_POLICY else parse_bytes_retained(log_text)
        except ServerStartError as err:
            raise SystemExit(f"[{policy}] server failed to start: {err}") from err
        finally:
            code = stop_server(server)
            info["exit_code"] = code
            print(f"[{policy}] server stopped (exit code {code})", flush=True)
    return runs, servers, block_size, block_source, floor_label


def run_url(args, workload: Workload, plans: list[ConversationPlan], run_salt: str):
    label = args.label
    log_text = read_text(args.server_log)
    block_size, block_source = resolve_block_size(args.block_size, log_text, [])
    target = Target(label=label, base_url=args.url.rstrip("/"), model=args.model)
    measure_floor = bool(args.floor)
    if measure_floor and block_size is None:
        print("warning: --floor needs --block-size (or --server-log with the block-size line): skipped",
              file=sys.stderr)  # fmt: skip
    run = PolicyRun(target, workload, plans, f"{run_salt}-{label}", block_size=block_size,
                    measure_floor=measure_floor, request_timeout=args.request_timeout)  # fmt: skip
    run.warm_up(args.warmup)
    run.run_conversations()
    if args.server_log and args.stats_log_interval > 0:
        flush_plugin_stats(target, args.stats_log_interval, run.salt)
    run.run_floor()
    log_text = read_text(args.server_log)
    info = {"url": target.base_url, "log_path": args.server_log,
            "boundary_stats": parse_boundary_stats(log_text) if log_text else None,
            "bytes_retained": parse_bytes_retained(log_text) if log_text else None}  # fmt: skip
    floor_label = label if run.measure_floor else None
    return {label: run}, {label: info}, block_size, block_source, floor_label


def machine_info() -> dict:
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "nproc": os.cpu_count(), "mem_bytes": mem,
            "platform": platform.platform(), "python": platform.python_version()}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="multi_turn.py",
        description="Multi-turn serving benchmark: boundary checkpoints vs stock prefix caching, and a floor.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    tgt = p.add_argument_group("target")
    tgt.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    tgt.add_argument("--launch", metavar="MODEL_DIR", help="launch vLLM servers for this model directory")
    tgt.add_argument("--model", help="served model name (--url: required; --launch: default the directory name)")
    tgt.add_argument("--policies", default=f"{STOCK_POLICY},{PLUGIN_POLICY}",
                     help="--launch: comma-separated policies, one server each, in this order")
    tgt.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                     help="--launch: one more server after --policies, named LABEL, whose "
                          "boundary_checkpoints section is JSON (repeatable), e.g. "
                          "'no_prompt={\"policy\": \"request_boundaries\", \"prompt_checkpoints\": false}'")
    tgt.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                     help="--launch: extra vLLM flag(s), repeatable, shell-split "
                          "(e.g. --server-arg='--load-format dummy'); later flags override the defaults "
                          "of boundary_checkpoints.bench.server (e.g. --no-enforce-eager, --max-model-len)")
    tgt.add_argument("--additional-config", default=None, metavar="JSON",
                     help="--launch: extra keys merged into every server's --additional-config "
                          "(e.g. '{\"gdn_prefill_backend\": \"triton\"}')")
    tgt.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                     help="--launch: extra environment variable for the servers, repeatable "
                          "(e.g. VLLM_CPU_KVCACHE_SPACE=4)")
    tgt.add_argument("--host", default="127.0.0.1")
    tgt.add_argument("--port", type=int, default=None, help="--launch: port (default: one free port for all)")
    tgt.add_argument("--startup-timeout", type=float, default=900.0)
    tgt.add_argument("--log-dir", default=None, help="--launch: server logs (default: a new temp dir)")
    tgt.add_argument("--label", default="server", help="--url: name of the server's policy in the report")
    tgt.add_argument("--server-log", default=None, help="--url: the server's log, to read bytes_retained and B")
    tgt.add_argument("--stats-log-interval", type=float, default=1.0,
                     help="plugin stats_log_interval_s (seconds between bytes_retained lines)")
    tgt.add_argument("--no-plugin-log-config", dest="plugin_log_config", action="store_false",
                     help="--launch: do not route the plugin's INFO log lines into the server log")
    wl = p.add_argument_group("workload")
    wl.add_argument("-N", "--conversations", type=int, default=4)
    wl.add_argument("-T", "--turns", type=int, default=4)
    wl.add_argument("-S", "--system-tokens", type=int, default=300)
    wl.add_argument("-U", "--user-tokens", type=int, default=60)
    wl.add_argument("-A", "--answer-tokens", type=int, default=32)
    wl.add_argument("-C", "--concurrency", type=int, default=2)
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--vocab-size", type=int, default=None,
                    help="random ids come from [4, vocab) (default: the model directory's config.json)")
    wl.add_argument("--warmup", type=int, default=1, help="throw-away 2-turn conversations before timing")
    wl.add_argument("--request-timeout", type=float, default=600.0)
    fl = p.add_argument_group("floor")
    fl.add_argument("--floor", dest="floor", action="store_true", default=None,
                    help="measure the floor (default: on with --launch when aligned is a policy; off with --url)")
    fl.add_argument("--no-floor", dest="floor", action="store_false")
    fl.add_argument("--block-size", type=int, default=None,
                    help="engine block size B (default: parsed from the server log)")
    out = p.add_argument_group("output")
    out.add_argument("--out-json", default=None, help="write every per-request record and the summary")
    out.add_argument("--plot", default=None, help="PNG of TTFT p50 and cached tokens per turn (matplotlib)")
    out.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    mk = p.add_argument_group("model directory")
    mk.add_argument("--write-model", metavar="DIR", default=None, help="write a model directory first")
    mk.add_argument("--arch", choices=ARCHES, default="tiny")
    args = p.parse_args(argv)
    if args.url and args.launch:
        p.error("--url and --launch are mutually exclusive")
    if not (args.url or args.launch or args.write_model):
        p.error("give --url, --launch or --write-model")
    if args.url and not args.model:
        p.error("--url needs --model")
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.sections = {policy: {"policy": policy} for policy in args.policies}
    for item in args.variant:
        label, _, text = item.partition("=")
        try:
            section = json.loads(text)
            if not isinstance(section, dict):
                raise ValueError("not an object")
        except ValueError as err:
            p.error(f"--variant takes LABEL=JSON object (got {item!r}: {err})")
        if not label or label in args.sections:
            p.error(f"--variant needs a new label (got {label!r})")
        args.sections[label] = section
    args.policies += [label for label in args.sections if label not in args.policies]
    for name in ("conversations", "turns", "concurrency", "answer_tokens", "user_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.system_tokens < 0:
        p.error("--system-tokens must be >= 0")
    for item in args.server_env:
        if "=" not in item or not item.split("=", 1)[0]:
            p.error(f"--server-env takes KEY=VALUE (got {item!r})")
    if args.additional_config:
        try:
            if not isinstance(json.loads(args.additional_config), dict):
                raise ValueError("not an object")
        except ValueError as err:
            p.error(f"--additional-config must be a JSON object: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_model:
        start = time.monotonic()
        out = write_model(args.write_model, args.arch)
        print(f"model directory ({args.arch}): {out} ({time.monotonic() - start:.1f} s)")
        if not (args.url or args.launch):
            return 0
    vocab = args.vocab_size or (model_vocab_size(args.launch) if args.launch else None)
    if vocab is None:
        print("error: --vocab-size is needed (no model directory to read it from)", file=sys.stderr)
        return 2
    workload = Workload(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                        user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                        concurrency=args.concurrency, vocab_size=vocab, seed=args.seed)  # fmt: skip
    plans = make_plans(workload)
    run_salt = f"mt-{uuid.uuid4().hex[:12]}"
    started = _dt.datetime.now(_dt.timezone.utc)
    previous = {s: signal.signal(s, _signal_to_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if args.launch:
            runs, servers, block_size, block_source, floor_label = run_launch(args, workload, plans, run_salt)
            policies = [p for p in args.policies if p in runs]
        else:
            runs, servers, block_size, block_source, floor_label = run_url(args, workload, plans, run_salt)
            policies = [args.label]
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    meta = {
        "argv": [sys.executable, *sys.argv] if argv is None else ["multi_turn.py", *argv],
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run_salt": run_salt,
        "machine": machine_info(),
    }
    result = build_result(workload, policies, runs, servers, block_size, block_source, floor_label, meta)
    print()
    print(summary_table(result, markdown=args.markdown))
    print()
    print(per_turn_table(result, markdown=args.markdown))
    print()
    print(f"block size B = {block_size} ({block_source})")
    text = targets_text(result)
    if text:
        print(text)
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"records: {args.out_json}")
    if args.plot and plot_results(result, Path(args.plot)):
        print(f"plot: {args.plot}")
    errors = sum(s["errors"] for s in result["summary"]["policies"].values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
