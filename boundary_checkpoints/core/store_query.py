"""Reading the store's index for one request's tokens: one scan, and the reason for a miss.

Contract: :func:`scan` walks the request's tails once, deepest hash block first, and finds both
the longest retained bundle that serves the tokens and the longest one whether it serves them or
not (the next-token guard's refusal costs no second walk); it has no side effects.
:func:`miss_reason` classifies a lookup that found no serving bundle, from that scan's longest;
its one side effect is the regret it records (``core/reuse.py``); :func:`lost_to_row_rule` tells a
miss the row rule caused by a second scan. ``CheckpointStore.query`` calls them and returns a
:class:`StoreAnswer`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from boundary_checkpoints.core.checkpoint import Checkpoint
from boundary_checkpoints.core.kinds import MissReason
from boundary_checkpoints.core.reuse import ReuseTracker

Index = Mapping[tuple[Hashable, int], Mapping[tuple[int, ...], Checkpoint]]  # (parent, start) -> tail -> bundle


@dataclass(frozen=True)
class StoreAnswer:
    """What the store holds for a request's tokens (``CheckpointStore.query``)."""

    hit: Checkpoint | None  # the longest bundle that serves the tokens
    refused: Checkpoint | None  # the longest bundle, when the next-token guard refuses it (if asked)
    miss_reason: MissReason | None  # why there is no hit (if asked and there is none)


def scan(
    index: Index,
    tokens: Sequence[int],
    max_tokens: int,
    parents: Callable[[int], Hashable | None],
    hash_block_size: int,
) -> tuple[Checkpoint | None, Checkpoint | None]:
    """The longest retained prefix of ``tokens`` with ``N <= max_tokens`` that serves ``tokens``
    (:meth:`Checkpoint.serves`), and the longest one whether it serves or not."""
    longest: Checkpoint | None = None
    if max_tokens <= 0:
        return None, None
    for start in range((max_tokens - 1) // hash_block_size * hash_block_size, -1, -hash_block_size):
        parent = parents(start)
        if parent is None:
            continue
        tails = index.get((parent, start))
        if not tails:
            continue
        here: Checkpoint | None = None  # the longest at this start
        serving: Checkpoint | None = None
        for tail, ckpt in tails.items():
            end = start + len(tail)
            if end > max_tokens or (serving is not None and end <= serving.num_tokens):
                continue
            if tuple(tokens[start:end]) != tail:
                continue
            if here is None or end > here.num_tokens:
                here = ckpt
            if ckpt.serves(tokens):
                serving = ckpt
        longest = longest or here
        if serving is not None:
            return serving, longest
    return None, longest


def miss_reason(
    index: Index,
    reuse: ReuseTracker,
    tokens: Sequence[int],
    max_tokens: int,
    parents: Callable[[int], Hashable | None],
    hash_block_size: int,
    longest: Checkpoint | None,
) -> MissReason:
    """Why no bundle serves ``tokens``: ``evicted`` when a bundle evicted earlier would have served
    them (a regret: its reuse distance is recorded); ``draft_next_token`` when a retained bundle
    holds their prefix (``longest``, from :func:`scan`) but its draft rows were computed from
    another next token; ``diverged`` when a retained bundle shares a prefix with them beyond a
    common hash block (or, under the root, at least the first token) but parts before its own end
    (an edited or re-rendered turn, a truncated answer, a shorter prompt); else ``no_checkpoint``."""
    if max_tokens <= 0:
        return MissReason.NO_CHECKPOINT
    if reuse.regret(tokens, max_tokens, parents, hash_block_size):
        return MissReason.EVICTED
    if longest is not None:
        return MissReason.DRAFT_NEXT_TOKEN
    for start in range(0, (max_tokens - 1) // hash_block_size * hash_block_size + 1, hash_block_size):
        parent = parents(start)
        tails = index.get((parent, start)) if parent is not None else None
        if not tails:
            continue
        if start > 0 or any(tail[:1] == tuple(tokens[:1]) for tail in tails):
            return MissReason.DIVERGED
    return MissReason.NO_CHECKPOINT


def lost_to_row_rule(
    index: Index,
    tokens: Sequence[int],
    max_tokens: int,
    without_row_rule: int | None,
    parents: Callable[[int], Hashable | None],
    hash_block_size: int,
    stock_hit: int,
) -> bool:
    """A bundle longer than ``stock_hit`` serves ``tokens`` within ``without_row_rule`` tokens, the
    limit before the row rule lowered it to ``max_tokens`` (no side effects)."""
    if without_row_rule is None or without_row_rule <= max_tokens:
        return False
    hit, _ = scan(index, tokens, without_row_rule, parents, hash_block_size)
    return hit is not None and hit.num_tokens > stock_hit
