"""What the boundary scheduler remembers about each request between steps: one
:class:`RequestLedger` per request id, owned by the scheduler's :class:`Ledgers`.

Contract: a ledger is created at its request's first use (``ledgers[request_id]``) and dropped
when the scheduler frees the request (:meth:`Ledgers.free`, from ``_free_request``) -- unless
captures of the request are still pending: then only what they read is kept (``restored_from``,
``tainted``) until :meth:`Ledgers.settle` finds none of them left. Reads that must not create a
ledger (a request that may be freed already) use :meth:`Ledgers.get` and the helpers beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from boundary_checkpoints.core.checkpoint import Checkpoint


@dataclass
class StepRecord:
    """A request's last scheduled step under speculative decoding (contract 3)."""

    end: int  # where it ends, drafts included (vLLM's optimistic count until ``previous`` returned)
    drafts: int
    seq: int  # its step number
    previous: int | None  # the request's step before it (None: none since it was admitted or resumed)


@dataclass
class RequestLedger:
    """One request's state between steps (module docstring)."""

    counted: bool = False  # its lookup was counted, as a hit or a miss (contract 9)
    resend: bool | None = None  # a bundle at its prompt's P existed when its prefill started (None: not asked)
    prompt_admitted: bool | None = None  # its prompt keeps a checkpoint (core/admission.py; None: not asked)
    instruction_checked: bool = False  # its instruction boundary was validated and counted (contract 10)
    instruction_target: int | None = None  # that boundary N_i, or None
    stopped_at: int | None = None  # P - 1 where the plugin cut its next chunk (contract 1)
    grid_target: tuple[int, int] | None = None  # contract 13: (prefill start, prompt checkpoint) once chosen
    last_step: StepRecord | None = None  # speculative decoding: its last scheduled step (contract 3)
    restored_from: Checkpoint | None = None  # the checkpoint its lookup restored (lineage, contract 5)
    tainted: bool = False  # preempted, or freed unfinished, with captures pending: they publish nothing
    freed: bool = False  # vLLM freed the request; the ledger waits for its pending captures


class Ledgers:
    """The ledgers of the scheduler's requests, by request id (module docstring)."""

    def __init__(self) -> None:
        self._by_request: dict[str, RequestLedger] = {}
        self._unsettled: set[str] = set()  # tainted or freed: what :meth:`settle` looks at, no more

    def __getitem__(self, request_id: str) -> RequestLedger:
        ledger = self._by_request.get(request_id)
        if ledger is None:
            ledger = self._by_request[request_id] = RequestLedger()
        return ledger

    def __len__(self) -> int:
        return len(self._by_request)

    def get(self, request_id: str) -> RequestLedger | None:
        return self._by_request.get(request_id)

    def is_tainted(self, request_id: str) -> bool:
        ledger = self._by_request.get(request_id)
        return ledger is not None and ledger.tainted

    def taint(self, request_id: str) -> None:
        """The request's pending captures publish nothing (preempted, or freed unfinished)."""
        self[request_id].tainted = True
        self._unsettled.add(request_id)

    def take_restored_from(self, request_id: str) -> Checkpoint | None:
        """The checkpoint the request restored from, forgotten as it is returned."""
        ledger = self._by_request.get(request_id)
        if ledger is None:
            return None
        restored_from, ledger.restored_from = ledger.restored_from, None
        return restored_from

    def free(self, request_id: str, captures_pending: bool) -> None:
        """Drop a freed request's ledger, or with ``captures_pending`` keep what they read."""
        ledger = self._by_request.pop(request_id, None)
        self._unsettled.discard(request_id)
        if ledger is not None and captures_pending:
            self._by_request[request_id] = RequestLedger(
                restored_from=ledger.restored_from, tainted=ledger.tainted, freed=True
            )
            self._unsettled.add(request_id)

    @property
    def unsettled(self) -> bool:
        """Whether a tainted or freed ledger waits for :meth:`settle`."""
        return bool(self._unsettled)

    def settle(self, with_captures_pending: set[str]) -> None:
        """After publication: a request without pending captures is no longer tainted, and a freed
        one's ledger is dropped. Looks only at tainted and freed ledgers: O(1) on a step where
        none is."""
        for request_id in [r for r in self._unsettled if r not in with_captures_pending]:
            self._unsettled.discard(request_id)
            ledger = self._by_request.get(request_id)
            if ledger is None:
                continue
            if ledger.freed:
                del self._by_request[request_id]
            else:
                ledger.tainted = False

    def forget_captures(self) -> None:
        """Prefix-cache reset: every pending capture was dropped, and every restore's lineage."""
        self.settle(set())
        for ledger in self._by_request.values():
            ledger.restored_from = None
