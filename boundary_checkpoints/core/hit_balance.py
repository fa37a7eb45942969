"""Whether retained bundles cost vLLM's own prefix-cache hits more than they give (retention
``borrow``).

Contract: :class:`HitBalance` keeps two decayed sums over requests' first lookups, of the tokens
served above and below what stock vLLM would have served. Stock's estimate is vLLM's block-grid
hit extended by the cached blocks the pool evicted among its last ``horizon`` evictions,
``horizon`` being the private blocks the bundles hold: without them the pool would still hold
those blocks (one least-recently-used order). It learns evictions from :meth:`evicted` (the
block pool's hash of each cached block it evicts; at most ``capacity`` remembered; :meth:`forget`
on a prefix-cache reset). :meth:`losing` is true while ``lost`` exceeds ``gained``: the scheduler
then lets bundles yield to every cached block and refuses captures that would evict one, as
before any reuse is seen. Hash blocks only: a group whose blocks span several hash blocks adds no ghosts the
request's hashes name, so the balance then stays with the gains.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

DECAY = 0.98  # per lookup: the balance follows about the last 50 requests


class HitBalance:
    """Decayed tokens gained by restores against tokens lost to evictions the bundles caused."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()  # block hash -> eviction number
        self._evictions = 0
        self.gained = 0.0
        self.lost = 0.0

    def evicted(self, block_hash: Hashable) -> None:
        """vLLM's pool evicted the cached block of ``block_hash`` (its hash-block hash)."""
        self._evictions += 1
        self._ghosts[block_hash] = self._evictions
        self._ghosts.move_to_end(block_hash)
        if len(self._ghosts) > self.capacity:
            self._ghosts.popitem(last=False)

    def observe(
        self, block_hashes: Sequence[Hashable], hash_block_size: int, stock_hit: int, served: int, max_tokens: int,
        horizon: int,
    ) -> None:  # fmt: skip
        """A request's first lookup: vLLM's cache gave ``stock_hit`` tokens, the plugin served
        ``served`` (at least that), at most ``max_tokens`` were servable, and the bundles hold
        ``horizon`` private blocks now."""
        stock = stock_hit
        if horizon > 0:
            for index in range(stock_hit // hash_block_size, max_tokens // hash_block_size):
                number = self._ghosts.get(block_hashes[index])
                if number is None or self._evictions - number >= horizon:
                    break
                stock += hash_block_size
        self.gained = self.gained * DECAY + max(served - stock, 0)
        self.lost = self.lost * DECAY + max(stock - served, 0)

    def forget(self) -> None:
        """A prefix-cache reset emptied the pool: stock would hold none of the evicted blocks
        either, and the sums start again."""
        self._ghosts.clear()
        self.gained = self.lost = 0.0

    def losing(self) -> bool:
        """Whether the bundles recently cost more cached tokens than they served."""
        return self.lost > self.gained
