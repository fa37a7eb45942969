"""Whether retained bundles cost vLLM's own prefix-cache hits more than they give (retention
``borrow``).

Contract: :class:`HitBalance` keeps two decayed sums over requests' first lookups, of the tokens
served above and below what stock vLLM would have served. Stock's estimate extends vLLM's
block-grid hit to the longest prefix of the request's hash blocks whose pages (``page_groups``)
and, at its end, recurrent states (``state_groups``) are each still cached
(``is_cached(hash, group)``) or were evicted among the pool's last ``horizon`` evictions, with at
least one so evicted; other groups (GLM's indexer tail ring, which vLLM's cache never holds) do
not count. ``horizon`` is the private blocks the bundles hold: without them the pool would still
hold those blocks (one least-recently-used order). So a state block that aged out alone counts as
lost too. It learns evictions from :meth:`evicted` (the block pool's
hash of each cached block it evicts and its group; at most ``capacity`` remembered;
:meth:`forget` on a prefix-cache reset). :meth:`losing` is true while ``lost`` exceeds
``gained``: the scheduler then lets bundles yield to every cached block and refuses captures
that would evict one. Hash blocks only: a group whose blocks span several hash blocks adds no
ghosts the request's hashes name, so the balance then sees fewer losses.

It also remembers, per hash block, the last two first lookups whose vLLM hit covered it:
:meth:`shared_prefix` is true for a block two of the last ``SHARED_WINDOW`` lookups read (a
shared system prompt, a chat in progress), and for every block before that many lookups were
seen. The scheduler's bundles, each serving one request, yield to such a block whatever its age.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

DECAY = 0.98  # per lookup: the balance follows about the last 50 requests
SHARED_WINDOW = 32  # lookups: a block two of them read is a prefix in use by several requests


class HitBalance:
    """Decayed tokens gained by restores against tokens lost to evictions the bundles caused."""

    def __init__(
        self, capacity: int, page_groups: Sequence[int] = (0,), state_groups: Sequence[int] = (),
        is_cached: Callable[[Hashable, int], bool] = lambda block_hash, group: False,
    ) -> None:  # fmt: skip
        self.capacity = max(capacity, 1)
        self._page_groups = list(page_groups)
        self._state_groups = list(state_groups)
        self.is_cached = is_cached
        self._ghosts: OrderedDict[tuple[Hashable, int], int] = OrderedDict()  # (hash, group) -> eviction number
        self._evictions = 0
        self.gained = 0.0
        self.lost = 0.0
        self._reads: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()  # hash -> its last two lookups
        self._lookups = 0

    def evicted(self, block_hash: Hashable, group: int = 0) -> None:
        """vLLM's pool evicted the cached block of ``block_hash`` (its hash-block hash) in KV
        group ``group``."""
        self._evictions += 1
        key = (block_hash, group)
        self._ghosts[key] = self._evictions
        self._ghosts.move_to_end(key)
        if len(self._ghosts) > self.capacity:
            self._ghosts.popitem(last=False)

    def observe(
        self, block_hashes: Sequence[Hashable], hash_block_size: int, stock_hit: int, served: int, max_tokens: int,
        horizon: int,
    ) -> tuple[int, int]:  # fmt: skip
        """A request's first lookup: vLLM's cache gave ``stock_hit`` tokens, the plugin served
        ``served`` (at least that), at most ``max_tokens`` were servable, and the bundles hold
        ``horizon`` private blocks now. Returns the tokens served beyond stock's estimate and the
        tokens short of it."""
        self._lookups += 1
        for block_hash in block_hashes[: stock_hit // hash_block_size]:
            self._reads[block_hash] = (self._reads.get(block_hash, (0, 0))[1], self._lookups)
            self._reads.move_to_end(block_hash)
        while len(self._reads) > self.capacity:
            self._reads.popitem(last=False)
        stock = stock_hit
        if horizon > 0:
            any_evicted = False
            for index in range(stock_hit // hash_block_size, max_tokens // hash_block_size):
                pages = [self._held_by_stock(block_hashes[index], g, horizon) for g in self._page_groups]
                if not all(pages):
                    break
                states = [self._held_by_stock(block_hashes[index], g, horizon) for g in self._state_groups]
                any_evicted = any_evicted or "evicted" in pages
                if all(states) and (any_evicted or "evicted" in states):
                    stock = (index + 1) * hash_block_size
        beyond, short = max(served - stock, 0), max(stock - served, 0)
        self.gained = self.gained * DECAY + beyond
        self.lost = self.lost * DECAY + short
        return beyond, short

    def _held_by_stock(self, block_hash: Hashable, group: int, horizon: int) -> str:
        """``"evicted"`` if the pool evicted this block within ``horizon`` evictions, ``"cached"`` if
        it holds it, else ``""``."""
        number = self._ghosts.get((block_hash, group))
        if number is not None and self._evictions - number < horizon:
            return "evicted"
        return "cached" if self.is_cached(block_hash, group) else ""

    def shared_prefix(self, block_hash: Hashable) -> bool:
        """Whether the cached block of ``block_hash`` (its hash-block hash) may hold a prefix that
        several requests read: two of the last ``SHARED_WINDOW`` first lookups read it from vLLM's
        cache, or fewer lookups than that were seen (none can be told apart yet)."""
        if self._lookups < SHARED_WINDOW:
            return True
        previous, _ = self._reads.get(block_hash, (0, 0))
        return previous > 0 and self._lookups - previous < SHARED_WINDOW

    def forget(self) -> None:
        """A prefix-cache reset emptied the pool: stock would hold none of the evicted blocks
        either, and the sums start again."""
        self._ghosts.clear()
        self._reads.clear()
        self.gained = self.lost = 0.0

    def losing(self) -> bool:
        """Whether the bundles recently cost more cached tokens than they served."""
        return self.lost > self.gained
