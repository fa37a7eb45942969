"""The checkpoint index: published bundles, their block references, lookup, eviction and counters.

Contract
--------
* A :class:`Checkpoint` is an atomic bundle: for every KV cache group it lists the blocks that
  represent the prefix ``[0, N)`` exactly as vLLM's KV cache manager expects a prefix hit of ``N``
  tokens (attention: ``ceil(N / B)`` pages, the last one a private page whose rows ``< N`` are the
  producer's; recurrent: null padding then one block holding the state after exactly ``N`` tokens).
* The store owns exactly one reference (``ref_cnt``) per distinct block of every retained bundle.
  :meth:`publish` takes over references the caller already holds; :meth:`evict_lru`, dedup and
  :meth:`clear` give them back through ``release``. Nothing else ever frees a retained block, so a
  bundle is never half-evicted: losing any block means dropping the whole bundle first.
* Readers pin a hit's blocks themselves (the scheduler does, for the step that restores it), so
  evicting a bundle that a reader is restoring from is safe.
* Eviction is least-recently-used over bundles (:class:`LruEvictionPolicy`); the policy object is
  the seam for a cost-aware replacement. The retained budget counts distinct blocks.
* :meth:`supersede` drops the bundles of a turn once the next turn of the same conversation has
  published its own (DESIGN contract 7: a few states per conversation, not one per turn); a
  response bundle that is still the next turn's resend restore point is handed to that turn.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from boundary_checkpoints.core.keys import CheckpointKey


class BlockLike(Protocol):
    block_id: int
    is_null: bool


@dataclass(eq=False)
class Checkpoint:
    key: CheckpointKey
    kind: str
    group_blocks: tuple[tuple[BlockLike, ...], ...]
    page_bytes: tuple[int, ...] = ()  # bytes of one block of each group, for accounting
    producer: str = ""  # id of the request that produced it

    @property
    def num_tokens(self) -> int:
        return self.key.num_tokens

    def distinct_blocks(self) -> list[BlockLike]:
        """Every non-null block of the bundle once, in group order."""
        return [block for block, _ in self._distinct_sized().values()]

    def block_bytes(self) -> dict[int, int]:
        """Bytes of each distinct block, by block id."""
        return {block_id: size for block_id, (_, size) in self._distinct_sized().items()}

    def _distinct_sized(self) -> dict[int, tuple[BlockLike, int]]:
        seen: dict[int, tuple[BlockLike, int]] = {}
        for group, blocks in enumerate(self.group_blocks):
            size = self.page_bytes[group] if group < len(self.page_bytes) else 0
            for block in blocks:
                if not block.is_null:
                    seen.setdefault(block.block_id, (block, size))
        return seen


@dataclass
class StoreCounters:
    hits: int = 0
    misses: int = 0
    tokens_restored: int = 0
    published: int = 0
    duplicates: int = 0
    evictions: int = 0
    superseded: int = 0
    captures_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class LruEvictionPolicy:
    """Least recently published or restored bundle first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, Checkpoint] = OrderedDict()

    def add(self, checkpoint: Checkpoint) -> None:
        self._order[id(checkpoint)] = checkpoint

    def touch(self, checkpoint: Checkpoint) -> None:
        self._order.move_to_end(id(checkpoint))

    def remove(self, checkpoint: Checkpoint) -> None:
        self._order.pop(id(checkpoint), None)

    def victim(self) -> Checkpoint | None:
        return next(iter(self._order.values()), None)


@dataclass
class CheckpointStore:
    """Retained bundles indexed by key parent, then by exact tail tokens."""

    release: Callable[[Sequence[BlockLike]], None]
    max_blocks: int
    policy: LruEvictionPolicy = field(default_factory=LruEvictionPolicy)
    counters: StoreCounters = field(default_factory=StoreCounters)

    def __post_init__(self) -> None:
        if self.max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")
        self._by_parent: dict[tuple[Hashable, int], dict[tuple[int, ...], Checkpoint]] = {}
        self._block_users: dict[int, int] = {}
        self._block_bytes: dict[int, int] = {}

    # ---- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(tails) for tails in self._by_parent.values())

    def __contains__(self, key: CheckpointKey) -> bool:
        return key.tail in self._by_parent.get((key.parent, key.start), {})

    @property
    def retained_blocks(self) -> int:
        return len(self._block_users)

    @property
    def retained_bytes(self) -> int:
        return sum(self._block_bytes.values())

    def checkpoints(self) -> list[Checkpoint]:
        return [ckpt for tails in self._by_parent.values() for ckpt in tails.values()]

    def lookup(
        self,
        tokens: Sequence[int],
        max_tokens: int,
        parents: Callable[[int], Hashable | None],
        hash_block_size: int,
    ) -> Checkpoint | None:
        """Longest retained prefix of ``tokens`` with ``N <= max_tokens``.

        ``parents(start)`` returns the key parent of a tail starting at ``start`` for this
        request (its chained block hash or its root discriminator), or None when unknown.
        """
        if max_tokens <= 0:
            return None
        for start in range((max_tokens - 1) // hash_block_size * hash_block_size, -1, -hash_block_size):
            parent = parents(start)
            if parent is None:
                continue
            tails = self._by_parent.get((parent, start))
            if not tails:
                continue
            best: Checkpoint | None = None
            for tail, ckpt in tails.items():
                end = start + len(tail)
                if end > max_tokens or (best is not None and end <= best.num_tokens):
                    continue
                if tuple(tokens[start:end]) == tail:
                    best = ckpt
            if best is not None:
                self.policy.touch(best)
                return best
        return None

    # ---- lifecycle -----------------------------------------------------------------------
    def publish(self, checkpoint: Checkpoint) -> bool:
        """Retain ``checkpoint``, taking over one reference per distinct block.

        Returns False (and releases those references) when an identical key is already
        retained; the older bundle is kept and refreshed.
        """
        key = checkpoint.key
        tails = self._by_parent.setdefault((key.parent, key.start), {})
        existing = tails.get(key.tail)
        if existing is not None:
            self.release(checkpoint.distinct_blocks())
            self.policy.touch(existing)
            self.counters.duplicates += 1
            return False
        tails[key.tail] = checkpoint
        for block_id, size in checkpoint.block_bytes().items():
            self._block_users[block_id] = self._block_users.get(block_id, 0) + 1
            self._block_bytes[block_id] = size
        self.policy.add(checkpoint)
        self.counters.published += 1
        self._enforce_budget(keep=checkpoint)
        return True

    def supersede(self, checkpoint: Checkpoint, successor: str | None = None) -> int:
        """Drop ``checkpoint`` and every other bundle of its producer; returns how many dropped.

        Used when a conversation moves on: the bundles of the turn a request resumed from are
        replaced by that request's own, so a conversation keeps one prompt and one response
        bundle instead of one per turn. With ``successor`` (the resuming request, when it kept no
        prompt checkpoint of its own) ``checkpoint`` stays, as the restore point of a resend of
        the successor's prompt, and passes to the successor: it goes when the successor's turn is
        superseded in turn.
        """
        victims = [c for c in self.checkpoints() if c is checkpoint or (c.producer and c.producer == checkpoint.producer)]
        if successor is not None and checkpoint in victims:  # not evicted meanwhile
            victims.remove(checkpoint)
            checkpoint.producer = successor
        for victim in victims:
            self._drop(victim)
        self.counters.superseded += len(victims)
        return len(victims)

    def evict_lru(self) -> bool:
        """Drop the least recently used bundle; False when nothing is retained."""
        victim = self.policy.victim()
        if victim is None:
            return False
        self._drop(victim)
        self.counters.evictions += 1
        return True

    def clear(self) -> int:
        """Drop every bundle (prefix-cache reset); returns how many were dropped."""
        dropped = self.checkpoints()
        for checkpoint in dropped:
            self._drop(checkpoint)
        return len(dropped)

    def record_lookup(self, hit: Checkpoint | None) -> None:
        if hit is None:
            self.counters.misses += 1
        else:
            self.counters.hits += 1
            self.counters.tokens_restored += hit.num_tokens

    # ---- internals -----------------------------------------------------------------------
    def _enforce_budget(self, keep: Checkpoint) -> None:
        while self.retained_blocks > self.max_blocks:
            victim = self.policy.victim()
            if victim is None:
                return
            if victim is keep:
                # The newest bundle alone exceeds the budget: it cannot be retained.
                self._drop(victim)
                self.counters.evictions += 1
                return
            self._drop(victim)
            self.counters.evictions += 1

    def _drop(self, checkpoint: Checkpoint) -> None:
        key = checkpoint.key
        tails = self._by_parent.get((key.parent, key.start), {})
        if tails.get(key.tail) is not checkpoint:
            return
        del tails[key.tail]
        if not tails:
            del self._by_parent[(key.parent, key.start)]
        self.policy.remove(checkpoint)
        blocks = checkpoint.distinct_blocks()
        for block in blocks:
            users = self._block_users[block.block_id] - 1
            if users:
                self._block_users[block.block_id] = users
            else:
                del self._block_users[block.block_id]
                del self._block_bytes[block.block_id]
        # Tail pages first, so vLLM's free queue reuses the deepest pages first.
        self.release(blocks[::-1])

