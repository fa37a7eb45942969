"""What the property tests share (``test_property_scheduler.py``, ``test_property_spec.py``): the
shadow model's cold output, token helpers, and the operations a random stream is built from. Each
test file draws its own strategies over these operations and plays them through its player
(``property_stream.py``, ``spec_property_checks.py``; what the players share is in ``property_player.py``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from shadow_engine import EMPTY_STATE, advance, sample


def reference_output(prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy output of the shadow model for ``prompt`` computed cold, token by token."""
    state = EMPTY_STATE
    for token in prompt:
        state = advance(state, token)
    out: list[int] = []
    while len(out) < max_tokens:
        token = sample(state)
        out.append(token)
        if token in stop_ids:
            break
        state = advance(state, token)
    return out


def random_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(n)]


def pick_tracked(tracked: list, which: int):
    """The earlier request an operation's ``which`` picks (modulo how many there are), or None
    when there is none yet (a stream's first prompts may all have been too long for its pool)."""
    return tracked[which % len(tracked)] if tracked else None


@dataclass(frozen=True)
class Fresh:
    """A new prompt of ``length`` random tokens."""

    seed: int
    length: int
    max_tokens: int
    salt: str | None
    stop_at: int | None  # stop on the reference output's token at this index (finish STOPPED early)


@dataclass(frozen=True)
class Resend:
    """The exact prompt of an earlier request, under its salt or under ``other_salt``."""

    which: int
    max_tokens: int
    other_salt: str | None | bool = False  # False: same salt as the original


@dataclass(frozen=True)
class Branch:
    """The first ``keep`` tokens of an earlier prompt, then ``extra`` new tokens (same salt)."""

    which: int
    keep: int
    extra: int
    seed: int
    max_tokens: int


@dataclass(frozen=True)
class Continue:
    """The next turn: an earlier request's prompt + output + ``extra`` new tokens.

    Like a client, it first waits (runs steps) until that request has finished. Continuing the
    same turn twice with other tokens is an n > 1 style branch of the conversation.
    """

    which: int
    extra: int
    seed: int
    max_tokens: int
    stop_at: int | None


@dataclass(frozen=True)
class Abort:
    which: int


@dataclass(frozen=True)
class Steps:
    k: int


@dataclass(frozen=True)
class Reset:
    """``reset_prefix_cache(reset_running_requests=True)`` (POST /reset_prefix_cache, pause,
    sleep): running requests are preempted, every checkpoint and pending capture dropped."""
