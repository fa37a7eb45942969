"""The checkpoint index: published bundles, their block references, lookup, eviction and counters.

Contract
--------
* A :class:`Checkpoint` is an atomic bundle: for every KV cache group it lists the blocks that
  represent the prefix ``[0, N)`` exactly as vLLM's KV cache manager expects a prefix hit of ``N``
  tokens (attention: ``ceil(N / B)`` pages, the last one a private page whose rows ``< N`` are the
  producer's; recurrent: null padding then one block holding the state after exactly ``N`` tokens).
  A bundle with a ``next_token`` (speculative decoding: its MTP draft K/V row ``N - 1`` was
  computed from token ``N``, which the key does not cover) serves only prefixes whose token ``N``
  is that token; :meth:`query` skips it for others and can name it as the refusal (miss reason
  ``draft_next_token``, or ``draft_next_token_fallbacks`` when a shorter bundle serves them instead).
* The store owns exactly one reference (``ref_cnt``) per distinct block of every retained bundle.
  :meth:`publish` takes over references the caller already holds; eviction (the budget's, in
  :meth:`publish`, and :meth:`evict_to_free`), dedup and :meth:`clear` give them back through
  ``release``. Nothing else ever frees a retained block, so a
  bundle is never half-evicted: losing any block means dropping the whole bundle first.
* With ``borrow`` (retention ``borrow``) a bundle publishes holding only its private blocks:
  the references to blocks vLLM's prefix cache names go back at once, and the bundle keeps their
  hashes. vLLM's own LRU then orders those blocks exactly as without the plugin; :meth:`query`
  drops a bundle whose borrowed block lost its hash (``evictions_borrowed``) and scans again.
* Readers pin a hit's blocks themselves (the scheduler does, for the step that restores it), so
  evicting a bundle that a reader is restoring from is safe.
* Eviction is least-recently-used over bundles (:class:`LruEvictionPolicy` in
  ``core/eviction.py``); the policy object is the seam for a cost-aware replacement. Under the
  budget, a bundle younger than twice the observed reuse distance is protected: the newcomer is
  refused instead (``core/reuse.py``; counted as ``refused_protected``). *Lasting* bundles (kind
  :data:`INSTRUCTION`: a shared system prompt, restored by many conversations) come after every
  other bundle in eviction order (budget and pressure alike), least recently used first among
  themselves. The retained budget counts the distinct blocks of the bundles' groups; a bundle's
  grid blocks (vLLM's own block-grid hit below its boundary, :attr:`Checkpoint.grid_blocks`) are
  held and released with it but not counted, since stock's cache would hold them as well. A
  newcomer that alone exceeds the budget is refused without evicting anything; otherwise bundles
  go in eviction order until the budget holds (the newcomer itself only once every other bundle
  left is lasting and it is not). Pressure relief (:meth:`evict_to_free`: an allocation that does not
  fit, or new blocks that would evict a block of vLLM's prefix cache) evicts only bundles that
  give at least one block back to the pool (``is_free(block)`` after the release), one at a time,
  so the caller can stop as soon as its allocation fits.
* Lineage (``core/scheduler.py`` contract 5: a few states per conversation, not one per turn):
  every bundle has a set of *owners*, the turns (request ids) that keep it alive; its producer
  first. When a turn
  moves on (:meth:`retire`: the next turn of that conversation published its response), the turn
  leaves every owner set, and a bundle with no owner left is dropped. A bundle that is still a
  live turn's resend restore point gains that turn as an owner (:meth:`adopt`), so every live
  branch of a conversation (n > 1, edits of a turn) keeps its latest turn. Lasting bundles are
  shared by many conversations and never retired by lineage: only eviction and :meth:`clear`
  drop them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from boundary_checkpoints.core.checkpoint import INSTRUCTION, BlockLike, Checkpoint, StoreCounters
from boundary_checkpoints.core.eviction import LruEvictionPolicy
from boundary_checkpoints.core.keys import CheckpointKey
from boundary_checkpoints.core.kinds import CheckpointKind, MissReason
from boundary_checkpoints.core.reuse import ReuseTracker
from boundary_checkpoints.core.store_query import StoreAnswer, lost_to_row_rule, miss_reason, scan


@dataclass
class CheckpointStore:
    """Retained bundles indexed by key parent, then by exact tail tokens."""

    release: Callable[[Sequence[BlockLike]], None]
    max_blocks: int
    # Retention ``borrow``: at publication a bundle gives back its references to blocks vLLM's
    # prefix cache names and keeps their hashes instead (:meth:`Checkpoint.intact`).
    borrow: bool = False
    counters: StoreCounters = field(default_factory=StoreCounters)
    reuse: ReuseTracker = field(default_factory=ReuseTracker)

    def __post_init__(self) -> None:
        self.policy = LruEvictionPolicy(clock=self.now)
        if self.max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")
        self._by_parent: dict[tuple[Hashable, int], dict[tuple[int, ...], Checkpoint]] = {}
        self._block_users: dict[int, int] = {}  # retained block id -> bundles holding it
        self._budget_users: dict[int, int] = {}  # the same for the blocks the budget counts
        self._blocks: dict[int, tuple[BlockLike, int]] = {}  # retained block id -> (block, bytes)
        self._bytes = 0  # sum of the retained blocks' bytes (read every engine step)

    # ---- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.policy)  # the policy orders every retained bundle

    def __contains__(self, key: CheckpointKey) -> bool:
        return self._retained_at(key) is not None

    @property
    def retained_blocks(self) -> int:
        """Blocks the retained bundles hold, grid blocks included."""
        return len(self._block_users)

    @property
    def budgeted_blocks(self) -> int:
        """Blocks the retained budget counts (:meth:`Checkpoint.budget_blocks`)."""
        return len(self._budget_users)

    @property
    def retained_bytes(self) -> int:
        return self._bytes

    def now(self) -> int:
        """The store's clock: bundles published so far (``core/reuse.py``)."""
        return self.reuse.clock

    def within_reuse_horizon(self, freed_at: int) -> bool:
        """Whether vLLM's prefix cache freed a block at ``freed_at`` (:meth:`now` then) recently
        enough that it is as likely to be read again as a protected bundle (``ReuseTracker.
        reuse_horizon``), or no reuse was seen yet. Such a block serves stock's own hit, so
        bundles give way to it."""
        horizon = self.reuse.reuse_horizon()
        return horizon is None or self.now() - freed_at < horizon

    def checkpoints(self) -> list[Checkpoint]:
        return [ckpt for tails in self._by_parent.values() for ckpt in tails.values()]

    def query(
        self,
        tokens: Sequence[int],
        max_tokens: int,
        parents: Callable[[int], Hashable | None],
        hash_block_size: int,
        *,
        with_refusal: bool,
        classify_miss: bool,
        stock_hit: int = 0,
        without_row_rule: int | None = None,
    ) -> StoreAnswer:
        """What the store holds for ``tokens``, from one scan of their tails (``N <= max_tokens``).

        ``parents(start)`` returns the key parent of a tail starting at ``start`` for this
        request (its chained block hash or its root discriminator), or None when unknown.
        :attr:`StoreAnswer.hit` is the longest bundle that serves ``tokens``
        (:meth:`Checkpoint.serves`); a hit is touched in the eviction policy. With
        ``with_refusal``, :attr:`StoreAnswer.refused` is the longest bundle when it does not serve
        them (its draft rows were computed from another token ``N``). With ``classify_miss`` and no
        hit, :attr:`StoreAnswer.miss_reason` says why (``core/store_query.py``; ``draft_next_token``
        without more when the refusal is longer than ``stock_hit``, vLLM's own block-grid hit;
        ``short_row`` when a bundle longer than ``stock_hit`` would serve them within
        ``without_row_rule`` tokens, the limit before contract 13's row rule lowered it to
        ``max_tokens``: a second scan, on such misses only).
        """
        hit, longest = scan(self._by_parent, tokens, max_tokens, parents, hash_block_size)
        while self.borrow and (stale := [c for c in (hit, longest) if c is not None and not c.intact()]):
            for checkpoint in stale:  # vLLM gave out a page it borrowed: it can serve no one
                self._evict(checkpoint)
                self.counters.evictions_borrowed += 1
            hit, longest = scan(self._by_parent, tokens, max_tokens, parents, hash_block_size)
        if hit is not None:
            self.policy.touch(hit)  # its reuse distance is recorded once, where the hit is counted
        refused = longest if with_refusal and longest is not None and not longest.serves(tokens) else None
        reason = None
        if classify_miss and hit is None:
            if refused is not None and refused.num_tokens > stock_hit:
                reason = MissReason.DRAFT_NEXT_TOKEN
            elif lost_to_row_rule(
                self._by_parent, tokens, max_tokens, without_row_rule, parents, hash_block_size, stock_hit
            ):
                reason = MissReason.SHORT_ROW
            else:
                reason = miss_reason(self._by_parent, self.reuse, tokens, max_tokens, parents, hash_block_size, longest)
        return StoreAnswer(hit, refused, reason)

    def peek(
        self, tokens: Sequence[int], max_tokens: int, parents: Callable[[int], Hashable | None], hash_block_size: int
    ) -> Checkpoint | None:
        """The longest bundle that serves ``tokens`` (``N <= max_tokens``) if it is intact, as
        :meth:`query` would find it, with no side effect (nothing touched, evicted or counted)."""
        hit, _ = scan(self._by_parent, tokens, max_tokens, parents, hash_block_size)
        return hit if hit is not None and hit.intact() else None

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
        checkpoint.published_at = self.reuse.stamp()
        if self.borrow:
            cached = [b for b in checkpoint.distinct_blocks() if getattr(b, "block_hash", None) is not None]
            checkpoint.borrowed = tuple((block, block.block_hash) for block in cached)  # type: ignore[attr-defined]
            self.release(cached[::-1])
        for block_id, sized in checkpoint.held_sized_blocks().items():
            self._block_users[block_id] = self._block_users.get(block_id, 0) + 1
            if block_id not in self._blocks:
                self._bytes += sized[1]
            self._blocks[block_id] = sized
        for block in checkpoint.budget_blocks():
            self._budget_users[block.block_id] = self._budget_users.get(block.block_id, 0) + 1
        self.policy.add(checkpoint)
        self.counters.published += 1
        self._enforce_budget(keep=checkpoint)
        return True

    def retire(self, turn: str) -> int:
        """Turn ``turn`` has moved on: it leaves every owner set; ownerless bundles are dropped.

        Returns how many bundles were dropped.
        """
        victims = []
        for checkpoint in self.checkpoints():
            if checkpoint.lasting:
                continue  # shared by many conversations: never retired by one of them
            if turn in checkpoint.owners:
                checkpoint.owners.discard(turn)
                if not checkpoint.owners:
                    victims.append(checkpoint)
        for victim in victims:
            self._drop(victim)
        self.counters.superseded += len(victims)
        return len(victims)

    def adopt(self, checkpoint: Checkpoint, turn: str) -> bool:
        """Make ``turn`` an owner of ``checkpoint``; False if it is no longer retained."""
        if not self._is_retained(checkpoint):
            return False
        checkpoint.owners.add(turn)
        return True

    def demote(self, checkpoint: Checkpoint) -> None:
        """Evict ``checkpoint`` before any other bundle of its class, and without the protection
        of its reuse distance (a newcomer no longer yields to it). For a prompt bundle once its
        request's response bundle is retained: the next turn restores from the response, so under
        a tight budget the prompt bundle (a resend's) is the one to give up. A lookup that finds it
        makes it the most recent again (LRU), still without protection."""
        if self._is_retained(checkpoint) and not checkpoint.lasting:
            checkpoint.demoted = True
            self.policy.demote(checkpoint)

    def make_lasting(self, key: CheckpointKey, kind: CheckpointKind = INSTRUCTION) -> bool:
        """Give the retained bundle at ``key`` the lasting ``kind`` (a prompt checkpoint that is
        also an instruction boundary); False if none is retained."""
        checkpoint = self._retained_at(key)
        if checkpoint is None:
            return False
        checkpoint.kind = kind
        return True

    def refusal(self, block_ids: set[int], num_private: int, lasting: bool) -> str | None:
        """Why a bundle holding ``block_ids`` (pages already in the pool) and ``num_private`` blocks
        not taken yet would be refused if published now (``"oversize"``, ``"protected"``: the
        refusals of :meth:`_enforce_budget`, which this mirrors), or None otherwise.
        Asked before a capture takes its private blocks and copies: a refused bundle would
        otherwise have taken them from the pool's free queue, evicting blocks of vLLM's prefix
        cache, to be dropped at publication. Publications in between can change the answer; it
        decides only whether a capture is taken, never what a restore reads."""
        if len(block_ids) + num_private > self.max_blocks:
            return "oversize"
        excess = self.budgeted_blocks + num_private + len(block_ids - self._budget_users.keys()) - self.max_blocks
        released: dict[int, int] = {}
        for victim in self.policy.in_order():
            if excess <= 0:
                break
            if victim.lasting and not lasting:
                return None  # only lasting bundles left: publication decides (it may evict the newcomer)
            if self._protected_from(victim, lasting, publications_ahead=1):
                return "protected"  # as at the newcomer's publication, which advances the clock
            for block in victim.budget_blocks():
                block_id = block.block_id
                released[block_id] = released.get(block_id, 0) + 1
                if released[block_id] == self._budget_users[block_id] and block_id not in block_ids:
                    excess -= 1
        return None if excess <= 0 else "protected"

    def freeable_blocks(self, is_free: Callable[[BlockLike], bool]) -> int:
        """Blocks that evicting every bundle would give back to the pool."""
        return sum(1 for block, _ in self._blocks.values() if is_free(block))

    def evict_to_free(
        self, is_free: Callable[[BlockLike], bool], cause: str = "pressure", used_by: int | None = None
    ) -> bool:
        """Evict the least recently used bundle whose release frees a block; False if none would.

        A block frees only when the store holds its last reference: it is in no other retained
        bundle and ``is_free(block)`` (the caller's view: no running request holds it) is true.
        ``cause`` names the eviction counter (``evictions_<cause>``). With ``used_by``, only a
        bundle last used (:meth:`LruEvictionPolicy.used_at`) no later than that goes.
        """
        for victim in self.policy.in_order():
            if used_by is not None and self.policy.used_at(victim) > used_by:
                continue
            if any(self._block_users[b.block_id] == 1 and is_free(b) for b in victim.held_blocks()):
                self._evict(victim)
                setattr(self.counters, f"evictions_{cause}", getattr(self.counters, f"evictions_{cause}") + 1)
                return True
        return False

    def clear(self) -> int:
        """Drop every bundle (prefix-cache reset); returns how many were dropped."""
        dropped = self.checkpoints()
        for checkpoint in dropped:
            self._drop(checkpoint)
        return len(dropped)

    def record_lookup(self, hit: Checkpoint | None, reason: MissReason | None = None) -> None:
        if hit is None:
            self.counters.misses += 1
            reason = reason or MissReason.UNKNOWN
            self.counters.misses_by_reason[reason] = self.counters.misses_by_reason.get(reason, 0) + 1
        else:
            self.counters.hits += 1
            self.counters.hits_by_kind[hit.kind] = self.counters.hits_by_kind.get(hit.kind, 0) + 1
            self.counters.tokens_restored += hit.num_tokens
            # One reuse distance per restoring request. A shared system prompt's distances say
            # nothing of turns; a pending bundle (published_at 0) has none yet.
            if not hit.lasting and hit.published_at:
                self.reuse.record_hit(hit.published_at)

    # ---- internals -----------------------------------------------------------------------
    def _enforce_budget(self, keep: Checkpoint) -> None:
        if len(keep.budget_blocks()) > self.max_blocks:
            # The newcomer alone exceeds the budget: refuse it, keep everything older.
            self._drop(keep)
            self.counters.refused_oversize += 1
            return
        while self.budgeted_blocks > self.max_blocks:
            victim = self.policy.victim()
            if victim is None:
                return
            if victim is not keep and self._protected_from(victim, keep.lasting):
                # Likely reused before the newcomer would be (core/reuse.py): refuse the newcomer.
                self._drop(keep)
                self.counters.refused_protected += 1
                return
            # ``keep`` is reached only when every other bundle left is lasting and ``keep`` is
            # not: it goes before them (counted as a budget eviction).
            self._evict(victim)
            self.counters.evictions_budget += 1

    def _protected_from(self, victim: Checkpoint, lasting: bool, publications_ahead: int = 0) -> bool:
        """Whether ``victim`` is kept against a newcomer of the ``lasting`` class (the newcomer is
        refused instead): same class, not demoted, and young by its reuse distance."""
        return (
            victim.lasting == lasting
            and not victim.demoted
            and self.reuse.protects(victim.published_at, publications_ahead)
        )

    def refuse_thrashing(self, key: CheckpointKey) -> None:
        """Count a capture refused because the cache thrashes (``CaptureMixin``) and remember its
        key (:meth:`remember_refused`)."""
        self.counters.refused_thrashing += 1
        self.remember_refused(key)

    def remember_refused(self, key: CheckpointKey) -> None:
        """Remember the key of a capture not taken (refused, or given up before its copies ran)
        as if evicted, so a later request it would have served records a reuse distance; and
        count it on the clock as a publication, since the cache's lifetime is measured on that
        clock and must keep growing while refusals stand in for publications."""
        self.reuse.remember_evicted(key, self.reuse.stamp())

    def _evict(self, victim: Checkpoint) -> None:
        """Drop ``victim`` to make room, remembering its key to notice a regret later."""
        self._drop(victim)
        self.reuse.remember_evicted(victim.key, victim.published_at)
        self.counters.evictions += 1

    def _retained_at(self, key: CheckpointKey) -> Checkpoint | None:
        return self._by_parent.get((key.parent, key.start), {}).get(key.tail)

    def _is_retained(self, checkpoint: Checkpoint) -> bool:
        return self._retained_at(checkpoint.key) is checkpoint

    def _drop(self, checkpoint: Checkpoint) -> None:
        if not self._is_retained(checkpoint):
            return
        key = checkpoint.key
        tails = self._by_parent[(key.parent, key.start)]
        del tails[key.tail]
        if not tails:
            del self._by_parent[(key.parent, key.start)]
        self.policy.remove(checkpoint)
        for block in checkpoint.budget_blocks():
            users = self._budget_users[block.block_id] - 1
            if users:
                self._budget_users[block.block_id] = users
            else:
                del self._budget_users[block.block_id]
        blocks = checkpoint.held_blocks()
        for block in blocks:
            users = self._block_users[block.block_id] - 1
            if users:
                self._block_users[block.block_id] = users
            else:
                del self._block_users[block.block_id]
                self._bytes -= self._blocks.pop(block.block_id)[1]
        # Tail pages first, so vLLM's free queue reuses the deepest pages first.
        self.release(blocks[::-1])
