"""Prefixes in flight: a new prompt waits for the part of its prefix that another request is
computing, rather than computing that part cold beside it.

Contract: :class:`PrefixInFlight` records where the prefill chunks allocated in the last
``WINDOW_STEPS`` steps leave a reusable recurrent state (:meth:`computed`: a chunk's end on the
state block grid, or the position ``state_position(P)`` inside a prompt's last chunk where align
mode keeps one) and answers, for a new request and the hit its lookup found, whether it waits
(:meth:`waits`): such a state sits where the request's lookup will look in the prefix the two share
(equal chained block hashes: its last whole block below the request's last token, one block lower
where the lookup drops a block for the drafter), a state block or more beyond that hit. A request
waits at most ``WINDOW_STEPS`` times, so it is never held back longer; :meth:`step_starts` opens
a step. :meth:`admitted` checks each wait against the hit the request then got: once
``MIN_EVIDENCE`` requests have waited, the rule stops for good if more than ``MAX_MISSED`` of them
got less than the state they waited for (a wait that cannot pay only holds the queue).

Why: vLLM defers a new prompt whose recurrent hit ends on a block cached in the same step, but
under speculative decoding its lookup drops the hit's last block, so a prompt that arrives with
another sharing its prefix finds nothing to defer on and runs cold, and the state becomes a hit
only a step after the chunk that wrote it (``docs/results/cpu-same-step-arrivals.md``).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from vllm.logger import init_logger

from boundary_checkpoints.compat import drops_eagle_block, prefill_state_position

WINDOW_STEPS = 2  # steps a state is waited for, and the most steps a request waits
MIN_EVIDENCE = 16  # requests that waited before the rule judges itself
MAX_MISSED = 0.25  # the share of them that may get less than the state they waited for

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


def shared_blocks(ours: Sequence[Any], theirs: Sequence[Any]) -> int:
    """How many leading hash blocks two requests share. Block hashes chain (each covers its parent),
    so equal hashes at an index mean equal prefixes up to it: a binary search."""
    low, high = 0, min(len(ours), len(theirs))
    while low < high:
        middle = (low + high + 1) // 2
        if ours[middle - 1] == theirs[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low


class PrefixInFlight:
    """Recent prefill chunks' states, and which new prompts wait for them (module docstring)."""

    STARTUP_PHRASE = (
        ", a new prompt waits up to two steps for a shared prefix another request is computing "
        "(speculative decoding: vLLM's lookup would run it cold)"
    )

    def __init__(
        self,
        hash_block_size: int,
        state_block_size: int,
        drops_block: bool,
        state_position: Callable[[int], int],
        on_wait: Callable[[], None],
    ) -> None:
        self.hash_block_size = hash_block_size
        self.state_block_size = state_block_size  # vLLM keeps a state where a chunk ends on this grid
        self.drops_block = drops_block  # the lookup drops a hit's last block (EAGLE-style drafters)
        self.state_position = state_position  # prompt length -> the state kept inside its last chunk
        self.on_wait = on_wait  # counts each request that waits (once)
        self._steps: deque[list[tuple[Sequence[Any], int]]] = deque([[]], maxlen=WINDOW_STEPS)
        # per request: (waits so far, the state it waits for; 0 once judged)
        self._waits: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
        self.waited = self.missed = 0  # requests that waited; of them, those whose hit fell short
        self.stopped = False

    def step_starts(self) -> None:
        self._steps.append([])

    def computed(self, request: Any, start: int, end: int) -> None:
        """``request``'s chunk ``[start, end)`` is allocated in this step: keep the states it leaves."""
        prompt, states = request.num_prompt_tokens, self._steps[-1]
        if end < prompt and not end % self.state_block_size:
            states.append((request.block_hashes, end))
        if start < prompt <= end and start < (inside := self.state_position(prompt)) <= end:
            states.append((request.block_hashes, inside))

    def waits(self, request: Any, hit: int) -> bool:
        """Whether ``request`` (new, its lookup found ``hit`` tokens) waits this step: a recent
        chunk left a state where its lookup will look (:meth:`looks_at`) in a prefix it shares, a
        state block or more beyond ``hit``; at most ``WINDOW_STEPS`` times per request."""
        waited = self._waits.get(request, (0, 0))[0]
        if self.stopped or waited >= WINDOW_STEPS:
            return False
        hashes = request.block_hashes
        for states in self._steps:
            for theirs, position in states:
                if position - hit < self.state_block_size:
                    continue
                shared = shared_blocks(hashes, theirs) * self.hash_block_size
                if position == self.looks_at(min(shared, request.num_prompt_tokens - 1)):
                    self._waits[request] = (waited + 1, position)
                    if not waited:
                        self.waited += 1
                        self.on_wait()
                    return True
        return False

    def admitted(self, request: Any, hit: int) -> None:
        """``request`` (new) is allocated with ``hit`` tokens: if it waited, did it get the state?"""
        waited, position = self._waits.get(request, (0, 0))
        if not position:
            return
        self._waits[request] = (waited, 0)
        self.missed += hit < position
        if not self.stopped and self.waited >= MIN_EVIDENCE and self.missed > MAX_MISSED * self.waited:
            self.stopped = True
            logger.warning(
                "boundary_checkpoints: new prompts no longer wait for a prefix in flight: %d of %d that "
                "waited got less than the state they waited for",
                self.missed,
                self.waited,
            )

    def looks_at(self, num_tokens: int) -> int:
        """The state a lookup of a ``num_tokens``-token shared prefix reads: its last whole state
        block's end, one block lower when the lookup drops a block."""
        position = num_tokens // self.state_block_size * self.state_block_size
        return position - self.state_block_size if self.drops_block else position


def prefix_in_flight_for(scheduler: Any, counters: Any) -> PrefixInFlight | None:
    """The rule for a boundary scheduler under speculative decoding without a KV connector (whose
    external hits it does not see), counting its waits in ``counters.prompts_waited``; else None."""
    if not scheduler.num_spec_tokens or scheduler.connector is not None:
        return None
    return PrefixInFlight(
        scheduler.hash_block_size,
        scheduler.cache_config.block_size,
        drops_eagle_block(scheduler),
        state_position=lambda prompt: prefill_state_position(scheduler, prompt),
        on_wait=lambda: setattr(counters, "prompts_waited", counters.prompts_waited + 1),
    )
