"""Drives the multi-turn benchmark: interleaved rounds of every label at every in-flight level.

Contract:

- A :class:`ServerSet` hands out one :class:`Target` per label. :class:`UrlServers` wraps servers
  that already run; :class:`LaunchedServers` starts vLLM servers with the plugin's policy in
  ``--additional-config``: all at once (default), or one at a time around each slot
  (``relaunch``, for hosts where two servers do not fit). Every server started is stopped by
  ``close``, also on errors and interrupts. A server gets ``warmup`` throw-away 2-turn
  conversations (own salt, own ids) before its first timed slot.
- ``run_benchmark`` runs, for each in-flight level C, ``repeat`` rounds; round r runs every label
  once, in ``round_order(labels, r)`` (so first place alternates), each with a fresh
  ``cache_salt``: rounds never share cache. A slot drives ``max(N, C)`` conversations with C
  threads, each conversation turn after turn. On the floor label (the stock ``aligned``), the
  floor (``workload.floor_prompts``) follows its conversations in the same slot: every prime
  first, then the timed requests with the conversations' cadence.
- Per slot it keeps the records, the growth of vLLM's ``SLOT_COUNTERS`` on ``/metrics`` over the
  slot's conversations (preemptions; with speculative decoding, drafts and accepted tokens, and
  from them the mean acceptance length, None without it) and, for labels other than
  the stock one whose server log it knows, the largest ``bytes_retained`` the plugin's stats lines
  logged during the slot (it waits out ``stats_log_interval_s`` and sends a tiny request so that
  a last line is logged) and that peak minus the last ``bytes_retained`` logged before the slot
  (what the slot's own conversations added: a server that stays up still holds earlier slots'
  checkpoints, under other salts, until it evicts them).
- ``time_budget_s`` (optional): a round starts only if it is expected to end within that many
  seconds of the run's start (server starts included): the time so far plus the longest round of
  this level so far (for a level's first round, the longest round of any level; the run's first
  round starts whenever any time is left). A launched server waits for health at most until the
  budget ends; one still starting then is stopped with the others (``stopped_early`` names it,
  with ``phase: server start``; in ``relaunch`` mode the level under way is lost), so no server
  outlives a budgeted run that an outer time limit would cut. The rounds that ran are summarized
  as usual, a level with none is left out, and the result's ``stopped_early`` says where the
  budget stopped the run (None if it did not), so a run under a hard time limit keeps what it
  measured.
- ``workload.mode == "chat"`` sends every conversation turn through ``/v1/chat/completions`` as
  messages (``workload.chat_messages``: the slot's shared system message, the user messages, the
  earlier answers' text as assistant messages), streamed, greedy, ``max_tokens`` = A,
  ``ignore_eos`` and ``skip_special_tokens: false`` (a random-weight model emits special tokens,
  whose text then re-renders as the same tokens), under the same per-slot ``cache_salt``; its
  records carry the server's ``usage`` counts, and a turn's boundary is the previous turn's
  rendered prompt + answer - 1. Warm-up conversations are chat conversations too, and the floor
  (tokens, ``/v1/completions``) uses the prompt ids the server rendered (``return_token_ids``).
- The result (a JSON-serialisable dict) holds per level the per-round summaries, their spreads
  (median and p25-p75 over rounds, ``stats.aggregate``), the per-round ratios to the stock label,
  the targets on the medians, per-turn tables pooled over rounds, and every request record.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import platform
import random
import re
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from bc_tools.bench import logs, stats
from bc_tools.bench.chat_words import TINY_WORDS, draw_words
from bc_tools.bench.client import Completion, CompletionError, chat, stream_complete
from bc_tools.bench.stats import PLUGIN_POLICY, STOCK_POLICY, RequestRecord
from bc_tools.bench.workload import (
    FIRST_RANDOM_ID,
    ChatConversationPlan,
    ConversationPlan,
    FloorPrompts,
    Workload,
    chat_messages,
    draw_ids,
    exact_boundary,
    first_prompt,
    floor_prompts,
    make_chat_plans,
    make_plans,
    next_prompt,
    round_order,
)

POLICY_ENV = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"  # the plugin lets it override --additional-config
REQUEST_ERRORS = (CompletionError, OSError, ValueError, http.client.HTTPException)
SLOT_COUNTERS = {  # summary key -> vLLM's Prometheus counter, read from /metrics around each slot
    "preemptions": "vllm:num_preemptions",
    "spec_drafts": "vllm:spec_decode_num_drafts",  # only with --speculative-config
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PROMETHEUS_SAMPLE = re.compile(r"(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{.*\})?\s+(?P<value>\S+)")


class Progress:
    """One tqdm bar over every timed request (vLLM depends on tqdm); a line per request without it."""

    def __init__(self, total: int, desc: str = "bc-bench"):
        self._lock = threading.Lock()
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self._bar = None
            self._n, self._total = 0, total

    def update(self, postfix: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
                self._bar.update(1)
            else:
                self._n += 1
                print(f"  {self._n}/{self._total} {postfix}", file=sys.stderr)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class Target:
    """Where one label's requests go, and the server log to read its plugin stats from."""

    label: str
    base_url: str
    model: str
    log_path: str | None = None


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


# ------------------------------------------------------------------------------------------------
# one request, one conversation, one slot


class Clock:
    """Seconds since the run started, shared by every record."""

    def __init__(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0


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


def send(target: Target, prompt: list[int], *, max_tokens: int, salt: str, clock: Clock, timeout: float,
         **fields) -> RequestRecord:  # fmt: skip
    """One streamed request as a :class:`RequestRecord` (``fields``: phase, conversation, turn,
    boundary, in_flight, round); a failed request is a record with ``error`` set."""
    start = clock.now()
    try:
        res = stream_complete(target.base_url, prompt, model=target.model, max_tokens=max_tokens,
                              cache_salt=salt, timeout=timeout)  # fmt: skip
        error = None
    except REQUEST_ERRORS as err:
        res, error = None, f"{type(err).__name__}: {err}"[:2000]
    return _record(target, res, error, start, clock.now(), len(prompt), fields)


CHAT_OPTIONS = {"ignore_eos": True, "skip_special_tokens": False}  # vLLM's extra chat parameters


def send_chat(target: Target, messages: list[dict], *, max_tokens: int, salt: str, clock: Clock, timeout: float,
              **fields) -> tuple[RequestRecord, Completion | None]:  # fmt: skip
    """One streamed chat request (``CHAT_OPTIONS``, greedy) as a :class:`RequestRecord` like
    ``send``'s, with the completion (None if the request failed: the record's ``error`` says why)."""
    start = clock.now()
    try:
        res = chat(target.base_url, messages, stream=True, model=target.model, max_tokens=max_tokens,
                   cache_salt=salt, timeout=timeout, **CHAT_OPTIONS)  # fmt: skip
        error = None
    except REQUEST_ERRORS as err:
        res, error = None, f"{type(err).__name__}: {err}"[:2000]
    return _record(target, res, error, start, clock.now(), 0, fields), res


def _record(target: Target, res: Completion | None, error: str | None, start: float, end: float,
            prompt_len: int, fields: dict) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        policy=target.label, prompt_tokens=res.prompt_tokens if res else prompt_len,
        cached_tokens=res.cached_tokens if res else None, completion_tokens=res.completion_tokens if res else 0,
        ttft_s=res.ttft_s if res else None, latency_s=res.latency_s if res else end - start,
        start_s=start, end_s=end, finish_reason=res.finish_reason if res else None,
        answer_ids=res.token_ids if res else [], error=error, **fields,
    )  # fmt: skip


def _postfix(rec: RequestRecord) -> str:
    if rec.error:
        return f"{rec.policy} error"
    ttft = f"{rec.ttft_s * 1000:.0f}ms" if rec.ttft_s is not None else "-"
    return f"C={rec.in_flight} r{rec.round} {rec.policy} {rec.phase} t{rec.turn} ttft {ttft}"


class Slot:
    """One label's conversations (and, on the floor label, the floor) in one round at one level."""

    def __init__(self, target: Target, workload: Workload, plans: list[ConversationPlan], salt: str, *,
                 clock: Clock, progress: Progress, round_index: int, timeout: float):  # fmt: skip
        self.target, self.workload, self.plans, self.salt = target, workload, plans, salt
        self.clock, self.progress, self.timeout = clock, progress, timeout
        self.tags = {"in_flight": workload.concurrency, "round": round_index}
        self.records: list[RequestRecord] = []
        self.turn_prompts: dict[int, list[tuple[list[int], int]]] = {}  # per conversation: (prompt, boundary)
        self._lock = threading.Lock()

    def _send(self, prompt: list[int], max_tokens: int, salt: str, **fields) -> RequestRecord:
        rec = send(self.target, prompt, max_tokens=max_tokens, salt=salt, clock=self.clock, timeout=self.timeout,
                   **fields, **self.tags)  # fmt: skip
        with self._lock:
            self.records.append(rec)
        self.progress.update(_postfix(rec))
        return rec

    def _send_chat(self, messages: list[dict], **fields) -> tuple[RequestRecord, Completion | None]:
        rec, res = send_chat(self.target, messages, max_tokens=self.workload.answer_tokens, salt=self.salt,
                             clock=self.clock, timeout=self.timeout, **fields, **self.tags)  # fmt: skip
        with self._lock:
            self.records.append(rec)
        self.progress.update(_postfix(rec))
        return rec, res

    def _pool(self, fn: Callable[[Any], None], items: list) -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workload.concurrency) as pool:
            for fut in [pool.submit(fn, item) for item in items]:
                fut.result()

    def _conversation(self, plan: ConversationPlan | ChatConversationPlan) -> None:
        if isinstance(plan, ChatConversationPlan):
            self._chat_conversation(plan)
            return
        w = self.workload
        prompt, boundary, answer, history = first_prompt(plan), 0, [], []
        for turn in range(1, w.turns + 1):
            if turn > 1:
                prompt = next_prompt(prompt, answer, plan.user_turns[turn - 1])
            rec = self._send(prompt, w.answer_tokens, self.salt, phase="conversation", conversation=plan.index,
                             turn=turn, boundary=boundary)  # fmt: skip
            history.append((prompt, boundary))
            if rec.error:
                break  # later turns need this answer
            answer = rec.answer_ids
            boundary = exact_boundary(len(prompt), len(answer))
        with self._lock:
            self.turn_prompts[plan.index] = history

    def _chat_conversation(self, plan: ChatConversationPlan) -> None:
        """Turn after turn through the chat endpoint, each answer's text sent back; the history
        keeps the prompt ids the server rendered (for the floor; a turn without them is left out)."""
        answers: list[str] = []
        boundary, history = 0, []
        for turn in range(1, self.workload.turns + 1):
            rec, res = self._send_chat(chat_messages(plan, answers), phase="conversation",
                                       conversation=plan.index, turn=turn, boundary=boundary)  # fmt: skip
            if res is None:
                break  # later turns need this answer
            history.append((res.prompt_token_ids, boundary))
            answers.append(res.text)
            boundary = exact_boundary(rec.prompt_tokens, len(rec.answer_ids))
        with self._lock:
            self.turn_prompts[plan.index] = history

    def run_conversations(self) -> None:
        self._pool(self._conversation, self.plans)

    def floor_plan(self, index: int, block_size: int) -> list[tuple[int, FloorPrompts]]:
        """(turn, prompts) of the floor requests of one conversation (turns >= 2)."""
        w = self.workload
        filler_rng = random.Random(f"floor-filler-{w.seed}-{index}")
        out = []
        for turn, (prompt, boundary) in enumerate(self.turn_prompts.get(index, []), start=1):
            if turn < 2:
                continue
            new_tokens = w.user_tokens + 1 if w.mode == "tokens" else len(prompt) - boundary
            if new_tokens > 0:  # chat: 0 when the server returned no prompt ids
                fp = floor_prompts(prompt, boundary, new_tokens, block_size,
                                   filler=lambda k: draw_ids(filler_rng, k, w.vocab_size))  # fmt: skip
                out.append((turn, fp))
        return out

    def run_floor(self, block_size: int) -> None:
        """Prime every floor prefix first, then send the timed requests with the conversations'
        cadence, so that no timed request shares an engine step with a prime's prefill."""
        plans = {p.index: self.floor_plan(p.index, block_size) for p in self.plans}
        salt = f"{self.salt}-floor"

        def primes(index: int) -> None:
            for turn, fp in plans[index]:
                self._send(fp.prime, 1, salt, phase="floor_prime", conversation=index, turn=turn,
                           boundary=fp.prefix_len)  # fmt: skip

        def timed(index: int) -> None:
            for turn, fp in plans[index]:
                self._send(fp.timed, self.workload.answer_tokens, salt, phase="floor", conversation=index,
                           turn=turn, boundary=fp.prefix_len)  # fmt: skip

        self._pool(primes, list(plans))
        self._pool(timed, list(plans))


def warm_up(target: Target, workload: Workload, salt: str, conversations: int, timeout: float,
            words: tuple[str, ...] = TINY_WORDS) -> None:  # fmt: skip
    """Throw-away 2-turn conversations (own salt, own ids; chat mode: chat conversations of
    ``words``), so that the timed slots exclude first-call costs (kernel compiles, allocator growth)."""
    w, clock = workload, Clock()
    if w.mode == "chat":
        warm_up_chat(target, workload, salt, conversations, timeout, words)
        return
    for i in range(conversations):
        rng = random.Random(f"warmup-{w.seed}-{i}")
        prompt = draw_ids(rng, w.system_tokens + w.user_tokens, w.vocab_size)
        first = send(target, prompt, max_tokens=w.answer_tokens, salt=f"{salt}-{i}", clock=clock, timeout=timeout,
                     phase="warmup", conversation=-1 - i, turn=1, boundary=0)  # fmt: skip
        if first.error:
            raise CompletionError(f"[{target.label}] warm-up request failed: {first.error}")
        second = next_prompt(prompt, first.answer_ids, draw_ids(rng, w.user_tokens, w.vocab_size))
        send(target, second, max_tokens=w.answer_tokens, salt=f"{salt}-{i}", clock=clock, timeout=timeout,
             phase="warmup", conversation=-1 - i, turn=2, boundary=0)  # fmt: skip


def warm_up_chat(target: Target, workload: Workload, salt: str, conversations: int, timeout: float,
                 words: tuple[str, ...]) -> None:  # fmt: skip
    """``warm_up``'s chat conversations: turn 1's shape (a system and a user message) with other
    words, then a second turn with the answer sent back."""
    w, clock = workload, Clock()
    for i in range(conversations):
        rng = random.Random(f"chat-warmup-{w.seed}-{i}")
        plan = ChatConversationPlan(index=-1 - i, system_text=draw_words(rng, w.system_tokens, words),
                                    user_texts=(draw_words(rng, w.user_tokens, words),
                                                draw_words(rng, w.user_tokens, words)))  # fmt: skip
        answers: list[str] = []
        for turn in (1, 2):
            rec, res = send_chat(target, chat_messages(plan, answers), max_tokens=w.answer_tokens,
                                 salt=f"{salt}-{i}", clock=clock, timeout=timeout, phase="warmup",
                                 conversation=-1 - i, turn=turn, boundary=0)  # fmt: skip
            if res is None:
                raise CompletionError(f"[{target.label}] warm-up chat request failed: {rec.error}")
            answers.append(res.text)


def flush_plugin_stats(target: Target, interval: float, salt: str) -> None:
    """Make the engine log one more stats line: wait out the interval, then send a tiny request
    (its own checkpoints are published after the line it triggers)."""
    time.sleep(interval + 0.3)
    try:
        stream_complete(target.base_url, [FIRST_RANDOM_ID] * 4, model=target.model, max_tokens=1,
                        cache_salt=f"{salt}-flush", timeout=60)  # fmt: skip
    except REQUEST_ERRORS:
        pass
    time.sleep(0.5)


def parse_counters(text: str, names: dict[str, str]) -> dict[str, int | None]:
    """Per key of ``names`` (key -> vLLM counter name, e.g. ``"vllm:num_preemptions"``): the
    counter's value in the Prometheus exposition ``text``, summed over its label sets (one per
    engine), or None when the text has no sample of it. A sample counts under its name with the
    ``_total`` suffix prometheus_client gives counters, or under the bare name; comments and
    other series (``_created``, ``..._per_pos_total``) do not."""
    wanted = {}
    for key, name in names.items():
        wanted[name] = wanted[f"{name}_total"] = key
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = PROMETHEUS_SAMPLE.match(line)
        if match and match["name"] in wanted:
            key = wanted[match["name"]]
            sums[key] = sums.get(key, 0.0) + float(match["value"])
    return {key: round(sums[key]) if key in sums else None for key in names}


def scrape_counters(base_url: str, names: dict[str, str] = SLOT_COUNTERS) -> dict[str, int | None]:
    """``parse_counters`` of the server's ``/metrics``; every value None when the endpoint is
    missing."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):
        text = ""
    return parse_counters(text, names)


def counter_deltas(before: dict[str, int | None], after: dict[str, int | None]) -> dict[str, int | None]:
    """Per key: how much the counter grew from ``before`` to ``after`` (None unless both are known)."""
    return {key: None if before.get(key) is None or value is None else value - before[key]
            for key, value in after.items()}  # fmt: skip


def slot_counters(deltas: dict[str, int | None]) -> dict[str, float | int | None]:
    """The slot's summary entries from its ``SLOT_COUNTERS`` deltas: ``preemptions``,
    ``spec_drafts``, ``spec_accepted_tokens`` and ``mean_acceptance_length`` (None without
    speculative decoding, see ``stats.acceptance_length``)."""
    return {
        **deltas,
        "mean_acceptance_length": stats.acceptance_length(
            deltas.get("spec_drafts"), deltas.get("spec_accepted_tokens")
        ),
    }


# ------------------------------------------------------------------------------------------------
# servers


class ServerSet:
    """Hands out the target of a label for one slot (``acquire`` ... ``release``)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.info: dict[str, dict[str, Any]] = {}
        self._warm: set[str] = set()

    def _ready(self, target: Target, progress: Progress) -> Target:
        """Warm ``target`` up the first time it is handed out (per server start)."""
        s = self.settings
        if target.label not in self._warm and s.warmup > 0:
            progress.write(f"[{target.label}] warm-up ({s.warmup} conversation(s))")
            warm_up(target, s.workload, f"{s.run_salt}-warmup-{target.label}", s.warmup, s.request_timeout,
                    s.chat_words)  # fmt: skip
        self._warm.add(target.label)
        return target

    def acquire(self, label: str, progress: Progress) -> Target:
        raise NotImplementedError

    def release(self, label: str) -> None:
        """Called after each slot; servers that stay up do nothing."""

    def close(self) -> None:
        """Stop what was started."""


class UrlServers(ServerSet):
    """Servers that already run: one per label (``--url`` repeated, with ``--label``)."""

    def __init__(self, settings: Settings, targets: list[Target]):
        super().__init__(settings)
        self.targets = {t.label: t for t in targets}
        self.info = {t.label: {"url": t.base_url, "log_path": t.log_path} for t in targets}

    def acquire(self, label: str, progress: Progress) -> Target:
        return self._ready(self.targets[label], progress)


@dataclass
class LaunchSpec:
    """How to launch the servers of ``--launch``: one per label, ``sections[label]`` being its
    whole ``boundary_checkpoints`` section."""

    model_dir: str
    model_name: str
    sections: dict[str, dict]
    host: str = "127.0.0.1"
    port: int | None = None  # the first server's port (the others follow); default: free ports
    server_args: list[str] = field(default_factory=list)
    label_args: dict[str, list[str]] = field(default_factory=dict)  # extra flags of one label, after server_args
    additional_config: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bc-bench-")))
    startup_timeout: float = 900.0
    relaunch: bool = False  # one server at a time, started for each slot
    # Every server up at once, but each started only once the previous one is healthy: vLLM's
    # memory profile counts what other processes take on the GPU while it profiles, so servers
    # that start together on one GPU can each find no room left for their KV cache.
    one_by_one: bool = False


class LaunchedServers(ServerSet):
    """vLLM servers started by the benchmark (``--launch``)."""

    def __init__(self, settings: Settings, spec: LaunchSpec):
        super().__init__(settings)
        self.spec = spec
        self.running: dict[str, Any] = {}
        self.budget: RoundBudget | None = None  # the run's budget: a start waits at most until it ends

    def _start(self, label: str, progress: Progress):
        from bc_tools.bench.server import find_free_port, start_server

        spec = self.spec
        index = self.settings.labels.index(label)
        port = spec.port + index if spec.port else find_free_port(spec.host)
        section = {**(spec.additional_config.get("boundary_checkpoints") or {}), **spec.sections[label],
                   "stats_log_interval_s": self.settings.stats_log_interval}  # fmt: skip
        log_path = spec.log_dir / f"server_{label}.log"
        progress.write(f"[{label}] starting vLLM on {spec.host}:{port} (log {log_path})")
        server = start_server(spec.model_dir, log_path, host=spec.host, port=port, served_model_name=spec.model_name,
                              additional_config={**spec.additional_config, "boundary_checkpoints": section},
                              extra_args=[*spec.server_args, *spec.label_args.get(label, [])],
                              env=spec.env, unset_env=(POLICY_ENV,))  # fmt: skip
        self.running[label] = server
        self.info.setdefault(label, {"command": server.command, "log_path": str(log_path), "ready_s": []})
        self._warm.discard(label)
        return server

    def _wait(self, label: str, progress: Progress) -> None:
        from bc_tools.bench.server import ServerStartError, wait_until_healthy

        server = self.running[label]
        left = self.budget.seconds_left() if self.budget is not None else None
        budget_bound = left is not None and left < self.spec.startup_timeout
        try:
            ready = wait_until_healthy(server, timeout=left if budget_bound else self.spec.startup_timeout)
        except ServerStartError as err:
            if budget_bound and server.running():
                raise BudgetEndedDuringStart(label) from err
            raise SystemExit(f"[{label}] server failed to start: {err}") from err
        self.info[label]["ready_s"].append(round(ready, 1))
        progress.write(f"[{label}] ready in {ready:.1f} s")
        s = self.settings
        if s.block_size is None:
            s.block_size, s.block_size_source = logs.resolve_block_size(
                None, logs.read_text(server.log_path), server.command
            )

    def start_all(self, progress: Progress) -> None:
        """Start every server at once, then wait for each; with ``one_by_one``, wait for each before
        starting the next (nothing here in ``relaunch`` mode)."""
        if self.spec.relaunch:
            return
        if self.spec.one_by_one:
            for label in self.settings.labels:
                self._start(label, progress)
                self._wait(label, progress)
            return
        for label in self.settings.labels:
            self._start(label, progress)
        for label in self.settings.labels:
            self._wait(label, progress)

    def acquire(self, label: str, progress: Progress) -> Target:
        if label not in self.running:
            self._start(label, progress)
            self._wait(label, progress)
        server = self.running[label]
        return self._ready(Target(label, server.base_url, self.spec.model_name, str(server.log_path)), progress)

    def _stop(self, label: str) -> None:
        from bc_tools.bench.server import stop_server

        server = self.running.pop(label)
        self.info[label].setdefault("exit_codes", []).append(stop_server(server))
        self.info[label]["boundary_stats"] = logs.parse_boundary_stats(logs.read_text(server.log_path))

    def release(self, label: str) -> None:
        if self.spec.relaunch:
            self._stop(label)

    def close(self) -> None:
        for label in list(self.running):
            self._stop(label)


# ------------------------------------------------------------------------------------------------
# the run


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


def run_level(servers: ServerSet, workload: Workload, clock: Clock, progress: Progress,
              budget: RoundBudget) -> dict[str, Any] | None:  # fmt: skip
    """The rounds at one in-flight level that ``budget`` lets start: the level's part of the result,
    with its records (None if no round started)."""
    s = servers.settings
    plans = make_chat_plans(workload, s.chat_words) if workload.mode == "chat" else make_plans(workload)
    records: list[RequestRecord] = []
    rounds = []
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
    if not rounds:
        return None
    ratio_labels = [p for p in s.labels if p != STOCK_POLICY] if STOCK_POLICY in s.labels else []
    ratios = {p: stats.aggregate([rd["ratios"][p] for rd in rounds]) for p in ratio_labels}
    floor_rounds = [rd["floor"] for rd in rounds]
    return {
        "in_flight": workload.concurrency,
        "conversations": workload.conversations,
        "rounds": rounds,
        "summary": {
            "policies": {p: stats.aggregate([rd["policies"][p] for rd in rounds]) for p in s.labels},
            "floor": stats.aggregate(floor_rounds) if any(floor_rounds) else None,
            "ratios": ratios,
            "targets": stats.targets(ratios[PLUGIN_POLICY]) if PLUGIN_POLICY in ratios else None,
            "same_answers": same_answers(records, s.labels),
            "answer_variety": answer_variety(records, s.labels[0]),
            "per_turn": {p: stats.per_turn([r for r in records if r.policy == p]) for p in s.labels},
            "floor_per_turn": stats.per_turn(records, "floor") or None,
            "lost_hits": stats.lost_hits(records, s.labels),
            "turn1_cached_median": {p: stats.turn1_cached_median(records, p) for p in s.labels},
        },
        "records": records,
    }


def run_benchmark(settings: Settings, servers: ServerSet) -> dict[str, Any]:
    """Every level, every round; returns the JSON-serialisable result (see the module docstring)."""
    s = settings
    floor = s.floor_label is not None
    total = sum(s.repeat * s.workload.at_in_flight(c).timed_requests(len(s.labels), floor) for c in s.in_flight)
    progress = Progress(total)
    clock = Clock()
    budget = RoundBudget(clock, s.time_budget_s)
    levels = []
    try:
        if isinstance(servers, LaunchedServers):
            servers.budget = budget
            servers.start_all(progress)
        if floor and s.block_size is None:
            progress.write("warning: block size unknown (no log line, no --block-size): floor skipped")
        for c in s.in_flight:
            level = run_level(servers, s.workload.at_in_flight(c), clock, progress, budget)
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
    records = [r for level in levels for r in level.pop("records")]
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
        "stopped_early": budget.stop,
        "servers": servers.info,
        "levels": levels,
        "records": [dict(asdict(r), prefill_tokens=r.prefill_tokens, tpot_s=r.tpot_s) for r in records],
    }


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


def write_logging_config(env: dict[str, str]) -> None:
    """Point ``VLLM_LOGGING_CONFIG_PATH`` in ``env`` at ``logs.plugin_logging_config`` unless the
    variable is already set there or in this process's environment."""
    if "VLLM_LOGGING_CONFIG_PATH" in env or os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return
    path = Path(tempfile.mkdtemp(prefix="bc-bench-logging-")) / "logging_config.json"
    path.write_text(json.dumps(logs.plugin_logging_config(), indent=2) + "\n")
    env["VLLM_LOGGING_CONFIG_PATH"] = str(path)
