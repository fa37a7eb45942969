"""Pool-grid snapshots (GLM-5.3-Flash's indexer): the recurrent state of a decoding request at its
last pool boundary, so that its response checkpoint sits on the pool grid and the next turn
prefills from there in one step (contract 12 in ``docs/design.md``).

Contract: :class:`PoolSnapshots` owns at most one snapshot per request: one private block per
recurrent group, holding the state after ``at`` tokens, ``at`` a multiple of the pool.
:meth:`copies_for_step` lists, for a step being scheduled, the ``(state block, snapshot block)``
copies of every request whose decode step (one token) ends on the pool grid; the worker applies
them after that step's forward, before any later step. A request takes its blocks at its first
such step, and only if ``room(n)`` says ``n`` more blocks cost nothing (no cached block of
vLLM's; snapshots of all requests together at most the retained budget's size). :meth:`take`
hands a finished request's snapshot, with its block references, to the caller; :meth:`release`,
:meth:`release_one` and :meth:`release_all` give blocks back (preemption, abort, pressure, a
prefix-cache reset). The owner never holds a
block of a request that is gone.
:class:`PoolGridMixin` is the scheduler's side: it attaches the copies to each step, plans a
finished request's response bundle at its snapshot, and gives snapshots back before any bundle
under pressure. It reads the scheduler's state that ``BoundaryCheckpointMixin.__init__`` sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from boundary_checkpoints.compat import keeps_prompt_states_between_blocks, watermark_blocks
from boundary_checkpoints.core.boundaries import RESPONSE
from boundary_checkpoints.core.chunk_stops import is_prefill_step
from boundary_checkpoints.core.step_copies import POST_FORWARD_COPIES_ATTR


@dataclass
class Snapshot:
    """A request's private state blocks (recurrent group order) and the tokens their state is after."""

    blocks: tuple[Any, ...]
    at: int = 0  # 0: no state copied into them yet


class PoolSnapshots:
    """The scheduler's pool-grid snapshots (module docstring)."""

    def __init__(
        self,
        block_pool: Any,
        recurrent_groups: Sequence[tuple[int, int]],
        pool: int,
        room: Callable[[int], bool],
    ) -> None:
        """``recurrent_groups``: (KV cache group, state block size) of each recurrent group."""
        self._block_pool = block_pool
        self._groups = tuple(recurrent_groups)
        self.pool = pool
        self._room = room
        self._by_request: dict[str, Snapshot] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks the snapshots hold."""
        return len(self._by_request) * len(self._groups)

    def copies_for_step(
        self,
        num_scheduled_tokens: Mapping[str, int],
        requests: Mapping[str, Any],
        request_blocks: Callable[[str], Sequence[Sequence[Any]]],
    ) -> list[tuple[int, int]]:
        """The snapshot copies of a step scheduling ``num_scheduled_tokens`` (request id -> tokens,
        the requests' computed counts already advanced past the step): the running state block of
        each request whose one-token decode step (not :func:`is_prefill_step`) ends on the pool
        grid, into its snapshot."""
        pairs: list[tuple[int, int]] = []
        for request_id, num_scheduled in num_scheduled_tokens.items():
            if num_scheduled != 1:
                continue
            request = requests[request_id]
            end = request.num_computed_tokens
            if end % self.pool or is_prefill_step(request, end - 1):
                continue
            snapshot = self._by_request.get(request_id) or self._allocate(request_id)
            if snapshot is None:
                continue
            blocks = request_blocks(request_id)
            for (group, block_size), destination in zip(self._groups, snapshot.blocks, strict=True):
                pairs.append((blocks[group][(end - 1) // block_size].block_id, destination.block_id))
            snapshot.at = end
        return pairs

    def _allocate(self, request_id: str) -> Snapshot | None:
        if not self._room(len(self._groups)):
            return None
        snapshot = Snapshot(tuple(self._block_pool.get_new_blocks(len(self._groups))))
        self._by_request[request_id] = snapshot
        return snapshot

    def take(self, request_id: str) -> Snapshot | None:
        """The request's snapshot, if it has one with a state; its references go to the caller."""
        snapshot = self._by_request.pop(request_id, None)
        if snapshot is not None and not snapshot.at:
            self._block_pool.free_blocks(snapshot.blocks)
            return None
        return snapshot

    def release(self, request_id: str) -> None:
        """Give the request's snapshot blocks back, if it has any."""
        snapshot = self._by_request.pop(request_id, None)
        if snapshot is not None:
            self._block_pool.free_blocks(snapshot.blocks)

    def release_one(self) -> bool:
        """Give back the oldest snapshot's blocks (a copy still in flight into them lands before any
        later step reuses them: steps run in order); False if there is none."""
        if not self._by_request:
            return False
        self.release(next(iter(self._by_request)))
        return True

    def release_all(self) -> None:
        """Give every snapshot's blocks back."""
        for request_id in list(self._by_request):
            self.release(request_id)


def with_state_blocks(
    geometries: Sequence[Any], blocks: Sequence[Sequence[Any]], state_blocks: Sequence[Any], num_tokens: int
) -> list[Sequence[Any]]:
    """A request's block table with each recurrent group's state block at ``num_tokens`` (block
    ``(num_tokens - 1) // B``) replaced by ``state_blocks`` (recurrent group order): a bundle
    planned from it takes its states from those blocks."""
    replaced = list(blocks)
    states = iter(state_blocks)
    for g, geometry in enumerate(geometries):
        if geometry.is_recurrent:
            group = list(blocks[g])
            group[(num_tokens - 1) // geometry.block_size] = next(states)
            replaced[g] = group
    return replaced


class PoolGridMixin:
    """Pool-grid snapshots on the boundary scheduler's side (module docstring)."""

    def _make_pool_snapshots(self) -> PoolSnapshots | None:
        """Snapshots where the layout has an indexer pool, without speculative decoding (a verify
        step leaves no whole state on the grid), unless ``pool_grid_snapshots`` is off."""
        if not self._kpool or self.num_spec_tokens or not self.boundary_config.pool_grid_snapshots:
            return None
        groups = [(g, geometry.block_size) for g, geometry in enumerate(self._geometries) if geometry.is_recurrent]
        return PoolSnapshots(self._block_pool, groups, self._kpool, self._snapshot_room)

    def _vllm_keeps_prompts_on_grid(self) -> bool:
        """Whether vLLM's own cache keeps each prompt's recurrent state at its last hash-block
        boundary below the end (``--prefix-match-unit`` finer than the block) on the pool grid."""
        return (
            bool(self._kpool) and keeps_prompt_states_between_blocks(self) and self.hash_block_size % self._kpool == 0
        )

    def _pool_grid_line(self) -> str:
        """The startup line's words on response checkpoints of a layout with an indexer pool."""
        if not self._kpool:
            return ""
        if self._grid_only:
            prompt = "vLLM's own" if self._vllm_keeps_prompts_on_grid() else "at a pool boundary below P - 1"
            return (
                f", checkpoints only on the indexer's {self._kpool}-token pool grid under speculative decoding (prompt "
                f"{prompt}, responses only where they end on it): a restore then never needs "
                "a one-token step that completes a pool beside verify rows, and no stop or restore leaves a "
                f"prefill row of {self.num_spec_tokens + 1} tokens or fewer (as long as a verify row)"
            )
        within = f"; off the grid only {self._kpool} tokens or more past vLLM's own hit"
        if self._pool_snapshots is None:
            return f", response checkpoints at the committed length (pool_grid_snapshots off){within}"
        return (
            f", response checkpoints on the indexer's {self._kpool}-token pool grid (each decoding request keeps "
            "its state at its last pool boundary in free blocks no cached page needs, given back first under "
            f"pressure){within}"
        )

    @property
    def _snapshot_blocks(self) -> int:
        return self._pool_snapshots.num_blocks if self._pool_snapshots is not None else 0

    def _snapshot_room(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more snapshot blocks take none of vLLM's cached blocks and leave
        vLLM's admission watermark free, with all snapshots within the retained budget's size (they
        are running requests' state, not retained: a full store of bundles does not crowd them out)."""
        store = self.checkpoint_store
        if self._snapshot_blocks + num_blocks > store.max_blocks:
            return False
        spare = self._block_pool.get_num_free_blocks() - watermark_blocks(self.kv_cache_manager)
        return spare >= num_blocks and not self._cached_ahead(num_blocks)

    def _attach_snapshot_copies(self, output) -> None:
        """Append this step's snapshot copies to the copies run after its forward."""
        pairs = self._pool_snapshots.copies_for_step(output.num_scheduled_tokens, self.requests, self._request_blocks)
        if pairs:
            after = getattr(output, POST_FORWARD_COPIES_ATTR, None) or []
            setattr(output, POST_FORWARD_COPIES_ATTR, [*after, *pairs])
            self.checkpoint_store.counters.pool_snapshot_copies += len(pairs)

    def _plan_response_on_pool_grid(self, request, num_tokens: int) -> bool:
        """Plan a finished request's response bundle at ``g = num_tokens // pool * pool`` from its
        snapshot, when ``num_tokens`` is off the grid and the snapshot holds the state after ``g``;
        False (nothing planned) otherwise. The snapshot's references are dropped either way: a
        planned bundle holds its own."""
        snapshots = self._pool_snapshots
        if snapshots is None or not num_tokens % snapshots.pool:
            return False
        snapshot = snapshots.take(request.request_id)
        if snapshot is None:
            return False
        try:
            if snapshot.at != self._on_pool_grid(num_tokens):
                return False
            before = len(self._pending)
            self._plan_capture(request, snapshot.at, RESPONSE, adopt=True, state_blocks=snapshot.blocks)
            self.checkpoint_store.counters.responses_on_pool_grid += len(self._pending) > before
            return True
        finally:
            self._block_pool.free_blocks(snapshot.blocks)

    def _release_snapshot(self) -> bool:
        """Give back one snapshot's blocks (they go before any bundle); False if there is none."""
        if self._pool_snapshots is None or not self._pool_snapshots.release_one():
            return False
        self.checkpoint_store.counters.pool_snapshots_released += 1
        return True
