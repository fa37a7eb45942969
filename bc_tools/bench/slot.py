"""One label's slot of a round, and the warm-up that precedes a server's first slot.

Contract: a :class:`Slot` drives ``max(N, C)`` conversations with C threads (C: the workload's
concurrency), each conversation turn after turn (``workload.turn_order`` "each") or turn k of
every conversation before any turn k + 1 ("rounds"), each next turn after its
``workload.think_time`` pause, and keeps every request record and, per
conversation, each turn's (prompt, boundary). In ``workload.mode == "chat"`` a turn goes through
``/v1/chat/completions`` as messages (``workload.chat_messages``: the slot's shared system message,
the user messages, the earlier answers' text as assistant messages), streamed, greedy,
``max_tokens`` = A, ``ignore_eos`` and ``skip_special_tokens: false`` (a random-weight model emits
special tokens, whose text then re-renders as the same tokens); its records carry the server's
``usage`` counts, and a turn's boundary is the previous turn's rendered prompt + answer - 1.
``run_floor`` then sends the floor (``workload.floor_prompts``, token ids, ``/v1/completions``;
in chat mode from the prompt ids the server rendered): every prime first, then the timed requests
with the conversations' cadence. ``warm_up`` sends throw-away 2-turn conversations, all at once (own
salt, own ids; chat conversations in chat mode), and raises if one fails.
"""

from __future__ import annotations

import concurrent.futures
import functools
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from bc_tools.bench.chat_words import TINY_WORDS, draw_words
from bc_tools.bench.client import Completion, CompletionError
from bc_tools.bench.stats import RequestRecord
from bc_tools.bench.traffic import Clock, Progress, Target, send, send_chat
from bc_tools.bench.workload import (
    ChatConversationPlan,
    ConversationPlan,
    FloorPrompts,
    Workload,
    chat_messages,
    draw_ids,
    exact_boundary,
    first_prompt,
    floor_prompts,
    next_prompt,
    think_time,
)


def _postfix(rec: RequestRecord) -> str:
    if rec.error:
        return f"{rec.policy} error"
    ttft = f"{rec.ttft_s * 1000:.0f}ms" if rec.ttft_s is not None else "-"
    return f"C={rec.in_flight} r{rec.round} {rec.policy} {rec.phase} t{rec.turn} ttft {ttft}"


@dataclass
class _ConversationState:
    """One conversation's progress through its turns."""

    prompt: list[int] = field(default_factory=list)
    answer: list[int] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # chat: the answers' text
    boundary: int = 0
    history: list[tuple[list[int], int]] = field(default_factory=list)  # (prompt, boundary) per turn
    stopped: bool = False


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
        run_threads(fn, items, self.workload.concurrency)

    def _turn(self, plan: ConversationPlan | ChatConversationPlan, state: _ConversationState, turn: int) -> None:
        """Send turn ``turn`` of ``plan`` (tokens or chat), unless an earlier turn failed."""
        if state.stopped:
            return  # later turns need the failed turn's answer
        time.sleep(think_time(self.workload, plan.index, turn))
        if isinstance(plan, ChatConversationPlan):
            rec, res = self._send_chat(chat_messages(plan, state.answers), phase="conversation",
                                       conversation=plan.index, turn=turn, boundary=state.boundary)  # fmt: skip
            if res is None:
                state.stopped = True
                return
            # Keep the prompt ids the server rendered (for the floor).
            state.history.append((res.prompt_token_ids, state.boundary))
            state.answers.append(res.text)
            state.boundary = exact_boundary(rec.prompt_tokens, len(rec.answer_ids))
            return
        if turn == 1:
            state.prompt = first_prompt(plan)
        else:
            state.prompt = next_prompt(state.prompt, state.answer, plan.user_turns[turn - 1])
        rec = self._send(state.prompt, self.workload.answer_tokens, self.salt, phase="conversation",
                         conversation=plan.index, turn=turn, boundary=state.boundary)  # fmt: skip
        state.history.append((state.prompt, state.boundary))
        if rec.error:
            state.stopped = True
            return
        state.answer = rec.answer_ids
        state.boundary = exact_boundary(len(state.prompt), len(state.answer))

    def _turns(self, states: dict[int, _ConversationState], turns: range, plan) -> None:
        for turn in turns:
            self._turn(plan, states[plan.index], turn)

    def run_conversations(self) -> None:
        """Every conversation's turns: each conversation's back to back (``turn_order`` "each"), or
        turn k of every conversation before any turn k + 1 ("rounds")."""
        states = {plan.index: _ConversationState() for plan in self.plans}
        turns = range(1, self.workload.turns + 1)
        if self.workload.turn_order == "rounds":
            for turn in turns:
                self._pool(functools.partial(self._turns, states, range(turn, turn + 1)), self.plans)
        else:
            self._pool(functools.partial(self._turns, states, turns), self.plans)
        self.turn_prompts = {index: state.history for index, state in states.items()}

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
    ``words``), all ``conversations`` at once, so that the timed slots exclude first-call costs
    (kernel compiles, allocator growth), those of batches of that many requests included."""
    chat = workload.mode == "chat"
    send_one: Callable[..., None] = functools.partial(_warm_up_chat, words=words) if chat else _warm_up_tokens
    run_threads(lambda i: send_one(target, workload, salt, i, timeout), list(range(conversations)), conversations)


def run_threads(fn: Callable[[Any], None], items: list, workers: int) -> None:
    """``fn`` on every item, ``workers`` threads at a time; re-raises the error of the first item,
    in order, that failed."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for fut in [pool.submit(fn, item) for item in items]:
            fut.result()


def _warm_up_tokens(target: Target, workload: Workload, salt: str, i: int, timeout: float) -> None:
    w, clock = workload, Clock()
    rng = random.Random(f"warmup-{w.seed}-{i}")
    prompt = draw_ids(rng, w.system_tokens + w.user_tokens, w.vocab_size)
    first = send(target, prompt, max_tokens=w.answer_tokens, salt=f"{salt}-{i}", clock=clock, timeout=timeout,
                 phase="warmup", conversation=-1 - i, turn=1, boundary=0)  # fmt: skip
    if first.error:
        raise CompletionError(f"[{target.label}] warm-up request failed: {first.error}")
    second = next_prompt(prompt, first.answer_ids, draw_ids(rng, w.user_tokens, w.vocab_size))
    send(target, second, max_tokens=w.answer_tokens, salt=f"{salt}-{i}", clock=clock, timeout=timeout,
         phase="warmup", conversation=-1 - i, turn=2, boundary=0)  # fmt: skip


def _warm_up_chat(
    target: Target, workload: Workload, salt: str, i: int, timeout: float, words: tuple[str, ...]
) -> None:
    """Turn 1's shape (a system and a user message) with other words, then a second turn with
    the answer sent back."""
    w, clock = workload, Clock()
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
