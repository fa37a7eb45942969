"""Restored rows fit a CUDA graph (``graph_fit_tokens``): a step whose restored prefills would
cross the largest CUDA graph a batch with prefills replays runs as two graph steps instead of one
eager step.

Contract: the KV cache manager opens each step with :meth:`GraphFit.step_starts`, reports every
allocation that succeeds (running and new requests, with the tokens vLLM scheduled) to
:meth:`GraphFit.allocated`, and asks :meth:`GraphFit.waits` before a new request's first
allocation; True is vLLM's "not in this step" (vLLM then admits no more new requests in the step).
A restored request waits when the step so far fits the ceiling and would cross it with this
request, and the next step fits it: that step's rows known now (the rest of each prefill in this
step, a decode row for each other) plus this request and the waiting requests behind it, whole
(:func:`defers`). After a step where requests waited, none waits. It changes when a request starts,
never what it computes.

Why: a restore leaves a next turn about its new message to compute, so a few restored next turns
together exceed the graph ceiling (128 tokens at ``--max-num-seqs 64``, 512 at vLLM's defaults)
where none of stock's would fit one anyway; eagerly the step waits on the host. Eight at 24 layers
of Qwen3-Next-80B dims: 96-101 ms eagerly, 41-46 ms in a graph
(``docs/results/gpu-next-turn-step-24l-h100.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


def crosses(step_tokens: int, row_tokens: int, ceiling: int) -> bool:
    """Whether a row of ``row_tokens`` takes this step so far (``step_tokens``: at least one row, at
    most ``ceiling``) past ``ceiling``."""
    return 0 < step_tokens <= ceiling < step_tokens + row_tokens


def defers(step_tokens: int, row_tokens: int, next_tokens: int, rest: Sequence[int | None], ceiling: int) -> bool:
    """Whether a new row of ``row_tokens`` waits for the next step: this step so far
    (``step_tokens``: at least one row, at most ``ceiling``) would cross ``ceiling`` with it, and
    the next step fits ``ceiling`` with ``next_tokens`` (from the rows in this step) and ``rest``
    (this row and the waiting rows behind it, whole; None: a row the rule cannot size, which may be
    long). Otherwise waiting would only add a step to an eager one."""
    if not crosses(step_tokens, row_tokens, ceiling) or any(row is None for row in rest):
        return False
    return next_tokens + sum(row for row in rest if row is not None) <= ceiling


def waiting_rows(
    waiting: Iterable[Any], limit: int, tokens_after_restore: Callable[[Any], int | None]
) -> list[int | None]:
    """The first ``limit`` of ``waiting`` requests' tokens to compute, in queue order: a new
    request's ``tokens_after_restore`` (None: not a restore), None for one resumed after a preemption."""
    rows: list[int | None] = []
    for request in waiting:
        if len(rows) >= limit:
            break
        rows.append(None if request.num_computed_tokens else tokens_after_restore(request))
    return rows


class GraphFit:
    """This step's tokens so far, and whether a new restored request waits (module docstring)."""

    def __init__(
        self,
        ceiling: int,
        decode_tokens: int,
        is_restored: Callable[[Any], bool],
        rows_behind: Callable[[Any], list[int | None]],
        on_wait: Callable[[int], None],
    ) -> None:
        self.ceiling = ceiling
        self.decode_tokens = decode_tokens  # a decode row's tokens (1 + speculative tokens)
        self._is_restored = is_restored
        self._rows_behind = rows_behind  # the waiting requests' rows after a request (waiting_rows)
        self._on_wait = on_wait  # (requests that wait)
        self._step_tokens = 0
        self._next_tokens = 0
        self._waited = False  # in this step
        self._waited_last_step = False

    def step_starts(self) -> None:
        """A new step: nothing allocated yet."""
        self._waited_last_step, self._waited = self._waited, False
        self._step_tokens = self._next_tokens = 0

    def waits(self, request: Any, start: int, num_new_tokens: int) -> bool:
        """Whether the new ``request``, computing ``num_new_tokens`` from ``start`` (its hit), starts
        a step later."""
        past = crosses(self._step_tokens, num_new_tokens, self.ceiling)
        if self._waited_last_step or not past or not self._is_restored(request):
            return False  # the waiting queue is read only where the step would cross the ceiling
        rest = [request.num_tokens - start, *self._rows_behind(request)]
        if not defers(self._step_tokens, num_new_tokens, self._next_tokens, rest, self.ceiling):
            return False
        if not self._waited:
            self._waited = True
            self._on_wait(len(rest))
        return True

    def allocated(self, request: Any, start: int, num_new_tokens: int) -> None:
        """``request`` computes ``num_new_tokens`` from ``start`` in this step."""
        self._step_tokens += num_new_tokens
        left = request.num_tokens - start - num_new_tokens
        self._next_tokens += left if left > 0 else self.decode_tokens


def graph_fit_for(
    setting: int | str,
    ceiling: int,
    num_spec_tokens: int,
    is_restored: Callable[[Any], bool],
    rows_behind: Callable[[Any], list[int | None]],
    counters: Any,
) -> GraphFit | None:
    """The rule for ``setting`` (``graph_fit_tokens``: ``auto`` for ``ceiling``, vLLM's largest
    graph for batches with prefills, or a number of tokens; 0 turns it off), counting the requests
    that wait in ``counters.rows_fit_to_graph``; None where there is no ceiling to fit."""
    tokens = ceiling if setting == "auto" else int(setting)
    if tokens <= 0:
        return None

    def count(waiting: int) -> None:
        counters.rows_fit_to_graph += waiting

    return GraphFit(tokens, 1 + num_spec_tokens, is_restored, rows_behind, count)


def startup_phrase(rule: GraphFit | None, setting: int | str) -> str:
    """What the startup line says of the rule: its ceiling, or why ``auto`` left it off."""
    if rule is not None:
        return (
            f", restored prompts that would take a step past {rule.ceiling} tokens (the largest CUDA graph with "
            "prefills, graph_fit_tokens) start in the next step when they fit its graph"
        )
    if setting == "auto":
        return ", restored prompts not fitted to CUDA graphs (auto: batches with prefills run without them)"
    return ""
