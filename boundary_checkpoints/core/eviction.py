"""The checkpoint store's eviction order over retained bundles.

Contract: :class:`LruEvictionPolicy` orders every bundle the store retains (``add`` on publication,
``remove`` on drop): least recently published or restored first (``touch`` makes a bundle the most
recent, ``demote`` the next victim of its class), and lasting bundles (``Checkpoint.lasting``)
after every other one. It stamps each bundle with ``clock()`` when it adds or touches it
(:meth:`used_at`; a demoted bundle reads as used before anything), so the scheduler can compare a
bundle's last use with a cached block's. It only orders: budget, protection and the release of
blocks are the store's (``core/store.py``). The policy object is the seam for a cost-aware
replacement.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from boundary_checkpoints.core.checkpoint import Checkpoint


class LruEvictionPolicy:
    """Least recently published or restored bundle first; lasting bundles after all others."""

    def __init__(self, clock: Callable[[], int] = lambda: 0) -> None:
        self._order: OrderedDict[int, Checkpoint] = OrderedDict()
        self._used_at: dict[int, int] = {}
        self._clock = clock

    def add(self, checkpoint: Checkpoint) -> None:
        self._order[id(checkpoint)] = checkpoint
        self._used_at[id(checkpoint)] = self._clock()

    def touch(self, checkpoint: Checkpoint) -> None:
        self._order.move_to_end(id(checkpoint))
        self._used_at[id(checkpoint)] = self._clock()

    def demote(self, checkpoint: Checkpoint) -> None:
        """Make ``checkpoint`` the next victim of its class (lasting or not)."""
        self._order.move_to_end(id(checkpoint), last=False)
        self._used_at[id(checkpoint)] = -1

    def remove(self, checkpoint: Checkpoint) -> None:
        self._order.pop(id(checkpoint), None)
        self._used_at.pop(id(checkpoint), None)

    def used_at(self, checkpoint: Checkpoint) -> int:
        """``clock()`` when ``checkpoint`` was last added or touched; -1 once demoted."""
        return self._used_at[id(checkpoint)]

    def __len__(self) -> int:
        return len(self._order)

    def victim(self) -> Checkpoint | None:
        return next(self.in_order(), None)

    def in_order(self) -> Iterator[Checkpoint]:
        """Every bundle, the next victim first, produced as the caller asks (an eviction usually
        stops at the first few). Iterate again after dropping or touching a bundle."""
        yield from (c for c in self._order.values() if not c.lasting)
        yield from (c for c in self._order.values() if c.lasting)
