"""The multi-turn benchmark's inputs: seeded conversations, floor prompts and the round order.

Contract (pure functions, no I/O):

- ``make_plans(workload)`` gives the same ids for the same :class:`Workload`: N conversations of T
  turns; turn 1 = system ids + U user ids, turn k = the turn k-1 prompt + the answer ids that came
  back + U new user ids (``next_prompt``). Ids are drawn from ``[FIRST_RANDOM_ID, vocab)``. With
  ``shared_system`` every conversation starts with the same S system ids; without it each draws its
  own (the ``--turn1-only`` workload: nothing is reused anywhere).
- ``exact_boundary`` is what a finished turn commits (its last sampled token has no KV yet), so an
  exact hit on turn k computes U + 1 tokens.
- ``floor_prompts`` builds the floor's prime and timed request: a prefix cached exactly on the
  block grid (L0 = ``floor_prefix_len``) followed by the U + 1 tokens an exact hit computes.
- Chat mode (``mode="chat"``): ``make_chat_plans(workload, words)`` gives every conversation the
  same seeded system text of S words (``chat_words.draw_words``, one token per word on the
  model's tokenizer, so every conversation of a slot shares the system message, also with one
  turn) and U words of user text per turn. ``chat_messages(plan, answers)`` is the request of turn
  ``len(answers) + 1``: the system message (none when S is 0), then per earlier turn its user
  message and its answer's text as an assistant message, then the turn's user message.
- ``think_time(workload, conversation, turn)``: the seconds a user pauses before sending turn
  ``turn`` >= 2, exponential with mean ``think_time_s``, seeded by (seed, conversation, turn): the
  same for every label, so stock and the plugin see the same arrivals.
- ``round_order(labels, r)`` rotates the labels by the round index, so that over rounds every
  label runs first equally often (two labels: they alternate).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from bc_tools.bench.chat_words import TINY_WORDS, draw_words

FIRST_RANDOM_ID = 4  # ids 0..3 are special tokens in every model the package writes
MODES = ("tokens", "chat")  # /v1/completions with token ids; /v1/chat/completions with messages
# "each": a conversation's turns back to back; "rounds": turn k of every conversation before any
# turn k + 1, so each conversation's next turn waits for every other one (pressure on the cache).
TURN_ORDERS = ("each", "rounds")
CHAT_TOKENS_PER_MESSAGE = 8  # a generous bound on what a chat template adds around one message


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
    shared_system: bool = True
    mode: str = "tokens"  # one of MODES
    turn_order: str = "each"  # one of TURN_ORDERS
    think_time_s: float = 0.0  # mean pause before each next turn (think_time); 0: at once

    def max_prompt_tokens(self) -> int:
        """Length of the last turn's prompt (answers are exactly ``answer_tokens`` long; chat: plus
        at most ``CHAT_TOKENS_PER_MESSAGE`` template tokens per message and the generation prompt)."""
        tokens = self.system_tokens + self.turns * self.user_tokens + (self.turns - 1) * self.answer_tokens
        if self.mode == "chat":
            tokens += CHAT_TOKENS_PER_MESSAGE * (1 + 2 * self.turns)
        return tokens

    def max_sequence_tokens(self) -> int:
        """Last prompt plus its answer: what must fit in the server's max model length."""
        return self.max_prompt_tokens() + self.answer_tokens

    def at_in_flight(self, in_flight: int) -> Workload:
        """This workload with ``in_flight`` conversations driven at once, and at least that many
        conversations (so that ``in_flight`` requests really are in flight)."""
        return dataclasses.replace(self, concurrency=in_flight, conversations=max(self.conversations, in_flight))

    def timed_requests(self, labels: int, floor: bool) -> int:
        """Requests one round sends: every label's conversation turns, plus a prime and a timed
        request per turn >= 2 when the floor is measured."""
        floor_requests = 2 * self.conversations * (self.turns - 1) if floor else 0
        return labels * self.conversations * self.turns + floor_requests


@dataclass(frozen=True)
class ConversationPlan:
    """The inputs of one conversation: its system ids and the new user ids of every turn."""

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

    Conversation ``i`` draws its user turns (and, without ``shared_system``, its system ids) from
    its own RNG, so adding conversations never changes the earlier ones.
    """
    w = workload
    shared = tuple(draw_ids(random.Random(f"system-{w.seed}"), w.system_tokens, w.vocab_size))
    plans = []
    for i in range(w.conversations):
        rng = random.Random(f"conversation-{w.seed}-{i}")
        system = shared if w.shared_system else tuple(draw_ids(rng, w.system_tokens, w.vocab_size))
        turns = tuple(tuple(draw_ids(rng, w.user_tokens, w.vocab_size)) for _ in range(w.turns))
        plans.append(ConversationPlan(index=i, system_ids=system, user_turns=turns))
    return plans


def first_prompt(plan: ConversationPlan) -> list[int]:
    """Turn 1: the system ids followed by the first user ids."""
    return list(plan.system_ids) + list(plan.user_turns[0])


def next_prompt(previous_prompt: Sequence[int], answer_ids: Sequence[int], user_ids: Sequence[int]) -> list[int]:
    """Turn k: the turn k-1 prompt, the answer ids it got back, then the new user ids."""
    return list(previous_prompt) + list(answer_ids) + list(user_ids)


def exact_boundary(previous_prompt_len: int, previous_answer_len: int) -> int:
    """Committed length after a finished turn: the last sampled token has no KV yet."""
    if previous_answer_len <= 0:
        return previous_prompt_len
    return previous_prompt_len + previous_answer_len - 1


def floor_prefix_len(boundary: int, block_size: int) -> int:
    """L0: the block-grid point just at or below the exact boundary (one block if that is 0)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive (got {block_size})")
    return max(block_size, (boundary // block_size) * block_size)


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
    tail = list(prompt[boundary : boundary + new_tokens])
    if len(tail) != new_tokens:
        raise ValueError(f"prompt has {len(prompt)} ids; boundary {boundary} + {new_tokens} overruns it")
    l0 = floor_prefix_len(boundary, block_size)
    prefix = list(prompt[: min(l0, boundary)])
    if len(prefix) < l0:
        if filler is None:
            raise ValueError(f"L0={l0} exceeds the boundary {boundary}: a filler is needed")
        prefix += filler(l0 - len(prefix))
    return FloorPrompts(prefix_len=l0, prime=prefix + tail[:1], timed=prefix + tail)


@dataclass(frozen=True)
class ChatConversationPlan:
    """The inputs of one chat conversation: the system text (shared) and every turn's user text."""

    index: int
    system_text: str
    user_texts: tuple[str, ...]


def make_chat_plans(workload: Workload, words: Sequence[str] = TINY_WORDS) -> list[ChatConversationPlan]:
    """Seeded text of every chat conversation, drawn from ``words`` (one token each): the same
    system text of ``system_tokens`` words for all (``shared_system`` is not consulted: chat mode
    always shares it), and per turn ``user_tokens`` words from the conversation's own RNG."""
    w = workload
    system = draw_words(random.Random(f"chat-system-{w.seed}"), w.system_tokens, words)
    plans = []
    for i in range(w.conversations):
        rng = random.Random(f"chat-conversation-{w.seed}-{i}")
        plans.append(ChatConversationPlan(index=i, system_text=system,
                                          user_texts=tuple(draw_words(rng, w.user_tokens, words)
                                                           for _ in range(w.turns))))  # fmt: skip
    return plans


def chat_messages(plan: ChatConversationPlan, answers: Sequence[str]) -> list[dict]:
    """The messages of turn ``len(answers) + 1``: system (if any), then each earlier turn's user
    message and its answer ``answers[k]`` as an assistant message, then this turn's user message."""
    turn = len(answers) + 1
    if turn > len(plan.user_texts):
        raise ValueError(f"{len(answers)} answers: the plan has only {len(plan.user_texts)} turns")
    messages = [{"role": "system", "content": plan.system_text}] if plan.system_text else []
    for user, answer in zip(plan.user_texts, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": plan.user_texts[turn - 1]})
    return messages


def think_time(workload: Workload, conversation: int, turn: int) -> float:
    """Seconds before turn ``turn`` of ``conversation`` is sent (0 for turn 1 and without think time)."""
    if turn < 2 or workload.think_time_s <= 0:
        return 0.0
    return random.Random(f"think-{workload.seed}-{conversation}-{turn}").expovariate(1 / workload.think_time_s)


def round_order(labels: Sequence[str], round_index: int) -> list[str]:
    """The labels of round ``round_index``, rotated by it (two labels alternate which goes first)."""
    k = round_index % len(labels) if labels else 0
    return list(labels[k:]) + list(labels[:k])
