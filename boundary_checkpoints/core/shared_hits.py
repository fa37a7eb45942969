"""Prompts that hit the same cached recurrent state start in the same engine step
(``shared_hits_together``; under ``auto``, its default, everywhere but on a CPU:
:func:`decide_together` says why).

Contract: with the setting on, the plugin's KV cache manager asks :meth:`SharedHits.marks_to_release` before vLLM
allocates a request and hands the answer to :meth:`SharedHits.allocated` after a successful
allocation. vLLM's align mode marks a recurrent state as written in this step, and defers to the
next step every new prompt whose hit ends on a marked state. A prompt whose hit ends at its own
last hash-block boundary has its allocation mark the very state it hit, which an earlier step
wrote and this step only reads: so of N prompts sharing a cached prefix, vLLM starts one per step
(one per two steps under async scheduling). For a hit that ends on a recurrent group's block
boundary (the request writes its own state into a later block; no copy-on-write moves the entry),
the mark the request's allocations add on its hit's last block is taken back, at admission and at
every later allocation of that request. Marks of states written in this step are never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from boundary_checkpoints.compat import group_hit_blocks, same_step_marks, single_type_managers

Release = tuple[set, Any]  # (a group's set of marks, the hash to take back)


def decide_together(setting: bool | str, on_cpu: bool) -> tuple[bool, str]:
    """Whether prompts sharing a cached recurrent state start together, and the startup phrase.
    ``auto`` turns it on except on a CPU: batching N prompts into one step pays where a step's
    time grows slower than its tokens (on an H100, 8 turns on one 8,000-token prefix reached their
    first tokens in 0.56x stock's time), and delays the first of them where it grows with them (the
    CPU engine's median first turn 1.30x stock's)."""
    together = not on_cpu if setting == "auto" else bool(setting)
    if together:
        why = " (auto: a GPU step's time grows slower than its tokens)" if setting == "auto" else ""
        return True, ", prompts hitting one cached recurrent state start in the same step" + why
    if setting == "auto":
        why = "auto: a CPU step's time grows with its tokens"
        return False, f", prompts hitting one cached recurrent state start a step apart ({why})"
    return False, ""


class SharedHits:
    """The marks the prompts sharing a cached recurrent prefix must not set (module docstring)."""

    def __init__(self, kv_cache_manager: Any, on_release: Callable[[], None]) -> None:
        self._groups = [
            (group, marks, manager.block_size)
            for group, manager in enumerate(single_type_managers(kv_cache_manager))
            if (marks := same_step_marks(manager)) is not None
        ]
        self._on_release = on_release
        self._by_request: dict[str, list[Release]] = {}  # request id -> its hit's marks to take back

    @property
    def active(self) -> bool:
        """Whether any KV group defers hits on states marked in the step (align mode)."""
        return bool(self._groups)

    def marks_to_release(self, request: Any, kwargs: dict) -> list[Release]:
        """Before vLLM allocates ``request`` (``kwargs``: ``allocate_slots``' keywords): the hashes
        its allocation may mark though an earlier step wrote them; only those not marked now."""
        if request.num_computed_tokens:
            known = self._by_request.get(request.request_id, ())
        else:  # a new (or preempted) request: its hit now, whatever an earlier allocation saw
            self._by_request.pop(request.request_id, None)
            known = self._hit_marks(kwargs)
        return [(marks, block_hash) for marks, block_hash in known if block_hash not in marks]

    def allocated(self, request: Any, releases: list[Release]) -> None:
        """After ``request``'s allocation succeeded: take back what it marked of ``releases`` (and
        remember them for its later allocations)."""
        self._by_request.setdefault(request.request_id, releases)
        taken = False
        for marks, block_hash in releases:
            if block_hash in marks:
                marks.discard(block_hash)
                taken = True
        if taken:
            self._on_release()

    def forget(self, request_id: str) -> None:
        """The request's blocks are freed: nothing of it is released any more."""
        self._by_request.pop(request_id, None)

    def _hit_marks(self, kwargs: dict) -> list[Release]:
        hit = kwargs.get("num_new_computed_tokens", 0)
        blocks = kwargs.get("new_computed_blocks")
        if not hit or blocks is None or kwargs.get("num_external_computed_tokens", 0):
            return []
        releases = []
        for group, marks, block_size in self._groups:
            hit_blocks = group_hit_blocks(blocks, group)
            if hit % block_size or not hit_blocks:
                continue  # a hit inside a block: its state moves by copy-on-write in this step
            last = hit_blocks[-1]
            if not last.is_null and last.block_hash is not None:
                releases.append((marks, last.block_hash))
        return releases
