"""Reuse distances of retained checkpoints, and the protection they earn against a newcomer.

Contract
--------
Least-recently-used eviction keeps none of a cyclic workload whose working set exceeds the
retention budget: with more conversations in flight than bundles fit, each bundle is evicted just
before its next turn needs it (0 exact hits in 192 turns of such a workload on a GPU). This
module lets the store keep a stable subset instead:

* time is counted in publications (:meth:`ReuseTracker.stamp` gives each published bundle the
  current count);
* a *reuse distance* is the number of publications between a bundle's publication and a request
  that used it: observed on every hit, and on every *regret* -- a miss that an evicted bundle
  would have served (evicted keys are remembered as ghosts, a bounded number of them, and so
  are captures refused while the cache thrashes) -- and on every resend of a remembered prompt;
* once distances have been observed, a bundle younger than twice their median is *protected*:
  it is likely still to be used, so the store refuses a newcomer rather than evict it
  (:meth:`ReuseTracker.protects`). Older bundles (their conversation is late or gone) are evicted
  as before. With no distance observed yet, nothing is protected: plain LRU.

The same horizon (:meth:`ReuseTracker.reuse_horizon`) tells the scheduler which of vLLM's cached
blocks every bundle gives way to (``core/yielding.py``). Pressure relief and lineage do not use
it. It decides what is kept, never what a restore reads, so it cannot make an output wrong.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence

from boundary_checkpoints.core.keys import CheckpointKey

MAX_GHOSTS = 4096  # evicted keys remembered to notice regrets
DISTANCES_KEPT = 64  # most recent reuse distances the median is taken over
PROTECTION_FACTOR = 2  # protected while younger than this many median reuse distances


class ReuseTracker:
    def __init__(self) -> None:
        self.clock = 0
        self._ghosts: OrderedDict[tuple[Hashable, int], dict[tuple[int, ...], int]] = OrderedDict()
        self._num_ghosts = 0
        self._distances: deque[int] = deque(maxlen=DISTANCES_KEPT)

    # ---- time ----------------------------------------------------------------------------------
    def stamp(self) -> int:
        """The publication time of a bundle being published now."""
        self.clock += 1
        return self.clock

    # ---- observations --------------------------------------------------------------------------
    def record_hit(self, published_at: int) -> None:
        self._distances.append(self.clock - published_at)

    def remember_evicted(self, key: CheckpointKey, published_at: int) -> None:
        tails = self._ghosts.setdefault((key.parent, key.start), {})
        if key.tail not in tails:
            self._num_ghosts += 1
        tails[key.tail] = published_at
        self._ghosts.move_to_end((key.parent, key.start))
        while self._num_ghosts > MAX_GHOSTS:
            _, oldest = self._ghosts.popitem(last=False)
            self._num_ghosts -= len(oldest)

    def regret(
        self,
        tokens: Sequence[int],
        max_tokens: int,
        parents: Callable[[int], Hashable | None],
        hash_block_size: int,
        min_tokens: int = 0,
    ) -> bool:
        """Whether an evicted bundle would have served ``tokens`` (a prefix of more than
        ``min_tokens`` and at most ``max_tokens``); if so its reuse distance is recorded and the
        ghost forgotten."""
        if max_tokens <= min_tokens:
            return False
        for start in range((max_tokens - 1) // hash_block_size * hash_block_size, -1, -hash_block_size):
            if start + hash_block_size <= min_tokens:
                break  # a tail is shorter than a hash block: every bundle from here is too short
            parent = parents(start)
            tails = self._ghosts.get((parent, start)) if parent is not None else None
            if not tails:
                continue
            for tail in list(tails):
                if min_tokens < start + len(tail) <= max_tokens and tuple(tokens[start : start + len(tail)]) == tail:
                    self._reused((parent, start), tail)
                    return True
        return False

    def revisit(self, key: CheckpointKey) -> bool:
        """Whether ``key`` is remembered (evicted, or refused while the cache thrashed): a prompt
        sent again, which that checkpoint would not have served (a resend resumes at ``P - 1``)
        but whose reuse it was kept for. If so its reuse distance is recorded and it is forgotten."""
        tails = self._ghosts.get((key.parent, key.start))
        if not tails or key.tail not in tails:
            return False
        self._reused((key.parent, key.start), key.tail)
        return True

    def _reused(self, where: tuple[Hashable, int], tail: tuple[int, ...]) -> None:
        tails = self._ghosts[where]
        self._distances.append(self.clock - tails.pop(tail))
        self._num_ghosts -= 1
        if not tails:
            del self._ghosts[where]

    # ---- decisions -----------------------------------------------------------------------------
    def reuse_distance(self) -> float | None:
        """Median of the recent reuse distances, or None before any was observed."""
        return statistics.median(self._distances) if self._distances else None

    def reuse_horizon(self) -> float | None:
        """How many publications after its last use a bundle, or a block of vLLM's cache, is still
        likely to be read again: ``PROTECTION_FACTOR`` median reuse distances (half of all reuses
        come later than the median). None before any distance was observed."""
        distance = self.reuse_distance()
        return None if distance is None else PROTECTION_FACTOR * max(distance, 1)

    def protects(self, published_at: int, publications_ahead: int = 0) -> bool:
        """Whether a bundle published at ``published_at`` is still likely to be reused, now or
        after ``publications_ahead`` more publications."""
        horizon = self.reuse_horizon()
        return horizon is not None and self.clock + publications_ahead - published_at < horizon
