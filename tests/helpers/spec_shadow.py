"""The shadow engine (``shadow_engine.py``) under MTP speculative decoding, align mode.

:class:`SpecShadowWorker` mirrors what vLLM 0.32's V1 runner does with ``k`` speculative state
blocks per recurrent group (docs/notes/spec-decode.md §1.3-1.5), with hashes for states:

* A step of request ``r`` starts at ``c`` and runs ``q`` tokens, the last ``d`` of them drafts;
  its running-state column is block ``sidx = ceil((c + q) / B) - 1``. When ``sidx`` moved since
  the request's previous step, the committed state is migrated first: SSM from column
  ``prev + a - 1``, conv window from column ``prev`` at offset ``a - 1`` (``a``: the previous
  step's accepted count, 1 for a new or restored request); then ``a = 1``.
* It reads the SSM from column ``sidx + a - 1`` and the conv window at offset ``a - 1`` of
  column ``sidx`` (offset 0 and column ``sidx`` for a step without drafts), checks both against
  the recomputed prefix state, and advances over the step's actual inputs (drafts included).
* It writes the SSM after input ``t`` into column ``sidx + t`` and rolls the conv buffer of
  column ``sidx``: offset ``k - d + t`` holds the window after input ``t``, lower offsets hold
  junk. A step without drafts writes its final state at column ``sidx``, offset 0.
* A prefill row (no drafts) of recurrent kernels that save a state inside the chunk (KDA on
  FlashKDA, Mamba2: ``prefill_checkpoints``) also writes the state and conv window after vLLM's
  checkpoint position into the block column vLLM's rule names (``_internal_checkpoint``).
* Verification: draft ``t`` is accepted while it equals the target's greedy token; the step
  samples ``a`` tokens and the request's computed count becomes ``c + q - d - 1 + a``. vLLM's
  post-step copy then moves a block-aligned committed state ``n`` in ``[c + q - d, computed]``
  into block ``n // B - 1`` (resetting ``a`` to 1 when that block is ``sidx``).
* Attention blocks carry, besides the target rows, the MTP draft rows: row ``i`` holds
  :func:`mtp_row` of the prefix state after ``i + 1`` tokens and token ``i + 1`` (the drafter's
  shifted input), for the step's valid rows; rejected rows hold junk. Every step checks both kinds
  of rows below its start, so a restore whose draft row ``N - 1`` came from another token ``N``
  raises :class:`ShadowMismatch` like a wrong state does. One stock exception: the last row of a
  page that another request computed (shared through vLLM's prefix cache by its hash) holds the
  draft row of that request's next token, which may differ from this request's: vLLM keys the
  page by its own tokens only, and its EAGLE/MTP drop of the last hit page checks the next page
  by hash (``kv_cache_coordinator.py``), so stock vLLM reads such a row too. It is accepted when
  it is exactly the writer's row; a copied page (a restore) gets no such leeway.
* Drafts cut by the token budget (vLLM's scheduler trims a request's drafts to what the budget
  leaves, ``scheduler.py``: ``0 < d < k``): the conv update leaves the window after input ``t`` at
  offset ``k - d + t`` while vLLM's next step reads offset ``a - 1``. The request's next read of
  its conv window is then vLLM's own, not the plugin's, and is not checked (its SSM still is); a
  restored request's read always is.
* Drafts for the next step are proposed after every step that sampled: the first ``m`` are the
  target's true continuation and the rest are wrong, ``m = accept(request_id, step)`` (a script).
  :class:`SpecDriver` hands them to the scheduler (``update_draft_token_ids``) as vLLM's engine
  core does after each synchronous step.
* A "ring" group (the GLM indexer tail ring, ``kpool`` = the pool, block size = the ring's
  slots) holds two rings per block, the target's and the MTP layer's, with key ``(q, value)``
  at slot ``q % slots`` (docs/notes/model-families.md §10). A step of at most ``1 + k`` tokens
  runs GLM's decode path: it stashes every input position in order (the target's key is its
  state after the step's actual inputs, so a rejected draft leaves a junk key) and, when it
  completes the pool open at its start, reads that pool's keys below its start from both rings,
  which must be the committed ones. A longer step runs the prefill path: it must start on the
  pool grid and seeds only its last ``kpool`` positions. With ``uniform_decode_rows`` (vLLM's
  indexer on Hopper: a row is a decode only if it is as long as the batch's verify rows) a short
  step beside verify rows of another length runs the prefill path too. With
  ``no_short_prefill_rows`` a prefill row that starts or ends off the block grid -- at the plugin's
  restore or stop; vLLM's own chunks end on it -- must be longer than a verify row, ``1 + k``
  (docs/design.md contract 13). The MTP layer's first pass writes rows
  below the computed count with :func:`mtp_row` of that row and the next token, junk above, and
  its ``k - 1`` further passes write junk at the ``k - 1`` positions after the last computed row.
* Async scheduling (``async_scheduling=True``, driven with ``lag=1``): as vLLM's engine core,
  the driver hands no drafts to the scheduler, which schedules ``-1`` placeholders and counts a
  step's drafts at once (``async_scheduler.py``); the worker runs its own latest proposal in
  their place, and takes the scheduler's computed count of a request as the count it knows minus
  the drafts its previous step rejected (the scheduler's count is optimistic while that step's
  output is on its way; anything else is a mismatch). Its input is the last token it sampled, as
  the GPU runner's. A request the scheduler finished while its next step ran still runs that
  step (it is freed in the next ``SchedulerOutput``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shadow_engine import MOD, ZERO, ShadowMismatch, ShadowRequest, ShadowWorker, advance, sample
from shadow_scheduler import Driver

JUNK = -2  # content of a state column or draft row that depends on a rejected or padded draft


def mtp_row(state: int, next_token: int) -> int:
    """The MTP draft K/V of a row: a function of the target's state there and the next token."""
    return (advance(state, next_token) * 31 + 5) % MOD


@dataclass(frozen=True)
class SpecStep:
    """One step of one request: start, scheduled tokens (drafts included), drafts, accepted."""

    start: int
    num_scheduled: int
    num_drafts: int
    num_accepted: int

    @property
    def end(self) -> int:
        return self.start + self.num_scheduled


@dataclass
class SpecShadowWorker(ShadowWorker):
    """The shadow worker with ``num_spec`` speculative state columns (see the module docstring)."""

    num_spec: int = 1
    accept: Callable[[str, int], int] = lambda request_id, step: 0
    conv: dict[int, list[int]] = field(default_factory=dict)
    draft_rows: dict[int, list[int]] = field(default_factory=dict)
    draft_next: dict[int, list[int | None]] = field(default_factory=dict)  # token each computed row drafted from
    accepted: dict[str, int] = field(default_factory=dict)  # vLLM's num_accepted_tokens per request
    async_scheduling: bool = False
    rejected: dict[str, int] = field(default_factory=dict)  # drafts the request's last step rejected
    steps: dict[str, list[SpecStep]] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # proposed for the next step
    kpool: int = 0  # the ring groups' pool (index_kpool); their block size is the ring's slots
    ring_reads: int = 0  # decode steps that completed a pool from keys below their start
    uniform_decode_rows: bool = False  # the indexer's decode rows must be as long as the verify rows
    no_short_prefill_rows: bool = False  # the plugin's prefill rows are longer than a verify row
    _verify_lengths: set = field(default_factory=set)  # this step's verify rows' lengths
    _spec_tokens: dict = field(default_factory=dict)

    def execute(self, so):
        self._spec_tokens = so.scheduled_spec_decode_tokens or {}
        self._verify_lengths = {so.num_scheduled_tokens[r] for r, drafts in self._spec_tokens.items() if drafts}
        if self.async_scheduling:
            so = self._as_the_worker_knows_it(so)
        for block_id in so.new_block_ids_to_zero or ():  # zeroed before any copy into them
            self.draft_rows.pop(block_id, None)
            self.draft_next.pop(block_id, None)
        # vLLM's input batch adds a new or resumed request (preemption drops it) with
        # num_accepted_tokens 1 (``InputBatch.add_request``).
        for new in so.scheduled_new_reqs:
            self.accepted.pop(new.req_id, None)
        for req_id in so.scheduled_cached_reqs.resumed_req_ids:
            self.accepted.pop(req_id, None)
        return super().execute(so)

    def _as_the_worker_knows_it(self, so):
        """``so`` with the worker's own drafts and computed counts (async scheduling)."""
        drafts = {}
        for req_id, placeholders in self._spec_tokens.items():
            proposal = self.drafts.get(req_id, [])
            if any(token != -1 for token in placeholders) or len(proposal) < len(placeholders):
                raise ShadowMismatch(f"{req_id}: {list(placeholders)} scheduled, {proposal} proposed")
            drafts[req_id] = proposal[: len(placeholders)]
        self._spec_tokens = drafts
        cached = so.scheduled_cached_reqs
        counts = list(cached.num_computed_tokens)
        for i, req_id in enumerate(cached.req_ids):
            req = self.requests.get(req_id)
            if req is None or req_id in cached.resumed_req_ids or counts[i] == req.num_computed:
                continue
            if counts[i] - self.rejected.get(req_id, 0) != req.num_computed:
                raise ShadowMismatch(f"{req_id}: worker computed {req.num_computed}, scheduler says {counts[i]}")
            counts[i] = req.num_computed
        so = copy.copy(so)
        so.scheduled_cached_reqs = replace(cached, num_computed_tokens=counts)
        return so

    def take_drafts(self):
        """The drafts proposed since the last call, as vLLM's ``DraftTokenIds``."""
        from vllm.v1.outputs import DraftTokenIds

        drafts, self.drafts = self.drafts, {}
        return DraftTokenIds(list(drafts), list(drafts.values()))

    def _copy(self, src: int, dst: int) -> None:
        super()._copy(src, dst)
        for table in (self.conv, self.draft_rows):
            if src in table:
                table[dst] = list(table[src])
            else:
                table.pop(dst, None)
        self.draft_next.pop(dst, None)  # a copied row is exact or wrong, never a stock share

    def _forward(self, req_id: str, req: ShadowRequest, num: int) -> list[int]:
        drafts = list(self._spec_tokens.get(req_id, ()))
        start, end = req.num_computed, req.num_computed + num
        num_known = num - len(drafts)
        if start + num_known > len(req.tokens):
            raise ShadowMismatch(f"{req_id}: scheduled past its known tokens")
        if self.no_short_prefill_rows and not drafts and num <= 1 + self.num_spec:
            block = self.block_sizes[0]
            if (start and start % block) or (end < len(req.tokens) and end % block):
                raise ShadowMismatch(
                    f"{req_id}: a {num}-token prefill row [{start}, {end}), no longer than a verify row"
                )
        inputs = req.tokens[start : start + num_known] + drafts
        states, chain = [], req.prefix_state(start)
        for token in inputs:
            chain = advance(chain, token)
            states.append(chain)
        self._check_attention(req_id, req, start)
        previous = req.state_idx  # None: a new, resumed or restored request
        for group, (kind, size) in enumerate(zip(self.group_kinds, self.block_sizes)):
            if kind == "recurrent":
                blocks = req.block_ids[group]
                self._run_recurrent(req_id, req, blocks, size, previous, start, end, len(drafts), states)
        sampled = self._verify(req, start, num_known, drafts, states)
        num_accepted = len(sampled)
        self.rejected[req_id] = len(drafts) - num_accepted + 1 if sampled else 0
        req.num_computed = start + num_known - 1 + num_accepted if sampled else end
        self._write_attention(req, start, end, states)
        for group, kind in enumerate(self.group_kinds):
            if kind == "ring":
                self._run_ring(req_id, req, group, start, end, states)
        self._post_copy(req_id, req, start + num_known, len(drafts), num_accepted)
        self.steps.setdefault(req_id, []).append(SpecStep(start, num, len(drafts), num_accepted))
        if sampled:
            self._propose(req_id, req)
        return sampled

    def _check_attention(self, req_id: str, req: ShadowRequest, start: int) -> None:
        """Target and MTP rows below ``start`` must be the ones a cold run computed."""
        for group, (kind, size) in enumerate(zip(self.group_kinds, self.block_sizes)):
            if kind != "attention":
                continue
            blocks = req.block_ids[group]
            for row in range(start):
                page = self.rows.get(blocks[row // size], [])
                if row % size >= len(page) or page[row % size] != req.prefix_state(row + 1):
                    raise ShadowMismatch(f"{req_id}: attention group {group} row {row} is wrong")
                drafts = self.draft_rows.get(blocks[row // size], [])
                want = mtp_row(req.prefix_state(row + 1), req.tokens[row + 1])
                if row % size >= len(drafts) or drafts[row % size] != want:
                    if not self._shared_by_stock(blocks[row // size], row % size, size, req.prefix_state(row + 1)):
                        raise ShadowMismatch(f"{req_id}: MTP draft row {row} of attention group {group} is wrong")

    def _shared_by_stock(self, block: int, slot: int, size: int, state: int) -> bool:
        """Whether a draft row that differs from this request's is the last row of a page another
        request computed, drafted from that request's next token (the module docstring)."""
        if slot != size - 1 or block not in self.draft_next:  # written beside draft_rows[block]
            return False
        written_for = self.draft_next[block][slot]
        return written_for is not None and self.draft_rows[block][slot] == mtp_row(state, written_for)

    def _run_recurrent(self, req_id, req, blocks, size, previous, start, end, num_drafts, states) -> None:
        """Migrate, read and check, then write the state columns of one recurrent group."""
        k = self.num_spec
        column = -(-end // size) - 1
        restored = previous is None
        if restored:
            previous = (start - 1) // size
            self.restored_reads += bool(start)
        accepted = self.accepted.get(req_id, 1)
        if start and previous != column:  # vLLM's pre-step migration into the new column
            self.states[blocks[column]] = self.states.get(blocks[previous + accepted - 1])
            window = self.conv.get(blocks[previous], [None] * (k + 1))[accepted - 1]
            self.conv[blocks[column]] = [window] + [JUNK] * k
            accepted = 1
        offset = accepted - 1 if num_drafts else 0
        if start:
            ssm = self.states.get(blocks[column + offset])
            window = self.conv.get(blocks[column], [None] * (k + 1))[offset]
            if not restored and 0 < self.steps[req_id][-1].num_drafts < k:
                window = req.prefix_state(start)  # vLLM's own read after a budget-cut step (docstring)
            if ssm != req.prefix_state(start) or window != req.prefix_state(start):
                raise ShadowMismatch(f"{req_id}: recurrent state at {start} is wrong (column {column}+{offset})")
        if num_drafts:
            for t in range(num_drafts + 1):
                self.states[blocks[column + t]] = states[len(states) - 1 - num_drafts + t]
            self.conv[blocks[column]] = [JUNK] * (k - num_drafts) + states[len(states) - 1 - num_drafts :]
        else:
            self.states[blocks[column]] = states[-1]
            self.conv[blocks[column]] = [states[-1]] + [JUNK] * k
            internal = self._internal_checkpoint(start, end, blocks)  # a prefill row's in-chunk state
            if internal is not None:
                position, block = internal
                self.states[block] = req.prefix_state(position)
                self.conv[block] = [req.prefix_state(position)] + [JUNK] * k
        req.state_idx = column

    def _verify(self, req, start, num_known, drafts, states) -> list[int]:
        """Greedy verification: the tokens the step samples (none for a prefill chunk)."""
        if start + num_known < len(req.tokens):
            return []
        first = num_known - 1  # the output after the last known input
        sampled = [sample(states[first])]
        for t, draft in enumerate(drafts):
            if draft != sampled[-1]:
                break
            sampled.append(sample(states[first + t + 1]))
        req.tokens.extend(sampled)
        return sampled

    def _write_attention(self, req, start, end, states) -> None:
        """Target rows of every input; MTP rows of the valid ones (``< num_computed``), junk after."""
        for group, (kind, size) in enumerate(zip(self.group_kinds, self.block_sizes)):
            if kind != "attention":
                continue
            blocks = req.block_ids[group]
            for row in range(start, end):
                block = blocks[row // size]
                page = self.rows.setdefault(block, [ZERO] * size)
                page[row % size] = states[row - start] if row < req.num_computed else JUNK
                drafts = self.draft_rows.setdefault(block, [ZERO] * size)
                valid = row < req.num_computed
                drafts[row % size] = mtp_row(req.prefix_state(row + 1), req.tokens[row + 1]) if valid else JUNK
                self.draft_next.setdefault(block, [None] * size)[row % size] = req.tokens[row + 1] if valid else None

    def _run_ring(self, req_id, req, group, start, end, states) -> None:
        """Read (decode path, completing the open pool) and write both rings of one step, once
        the step's verification set ``req.num_computed`` (the module docstring)."""
        slots, [block] = self.block_sizes[group], req.block_ids[group]
        target, mtp = (list(ring) for ring in self.rings.get(block, ((None,) * slots, (None,) * slots)))
        decode_path = end - start <= 1 + self.num_spec and (
            not self.uniform_decode_rows or not self._verify_lengths or end - start == max(self._verify_lengths)
        )
        if not decode_path and start % self.kpool:
            raise ShadowMismatch(f"{req_id}: a {end - start}-token step starts off the pool grid at {start}")
        open_pool = start // self.kpool * self.kpool
        if decode_path and start % self.kpool and open_pool + self.kpool <= end:
            for q in range(open_pool, start):
                if target[q % slots] != (q, req.prefix_state(q + 1)) or mtp[q % slots] != self._mtp_key(req, q):
                    raise ShadowMismatch(f"{req_id}: ring group {group} at {start} is wrong (position {q})")
            self.ring_reads += 1
        for q in range(start, end) if decode_path else range(max(start, end - self.kpool), end):
            target[q % slots] = (q, states[q - start])
            mtp[q % slots] = self._mtp_key(req, q) if q < req.num_computed else (q, JUNK)
        for q in range(req.num_computed, req.num_computed + self.num_spec - 1):  # the drafter's later passes
            mtp[q % slots] = (q, JUNK)
        self.rings[block] = (tuple(target), tuple(mtp))

    @staticmethod
    def _mtp_key(req, q: int) -> tuple[int, int]:
        """The MTP layer's ring key at a computed position: its row and the token after it."""
        return q, mtp_row(req.prefix_state(q + 1), req.tokens[q + 1])

    def _post_copy(self, req_id, req, running, num_drafts, num_accepted) -> None:
        """vLLM's post-step copy of a block-aligned committed state (align mode, speculative)."""
        self.accepted[req_id] = num_accepted or 1
        if not num_drafts:
            return
        for group, (kind, size) in enumerate(zip(self.group_kinds, self.block_sizes)):
            if kind != "recurrent":
                continue
            aligned = req.num_computed // size * size
            if aligned < running:
                continue
            blocks, column, bias = req.block_ids[group], req.state_idx, aligned - running
            destination = aligned // size - 1
            self.states[blocks[destination]] = self.states.get(blocks[column + bias])
            window = self.conv[blocks[column]][self.num_spec - num_drafts + bias]
            self.conv[blocks[destination]] = [window] + [JUNK] * self.num_spec
            if destination == column:
                self.accepted[req_id] = 1

    def _propose(self, req_id: str, req: ShadowRequest) -> None:
        """Drafts for the next step: the true continuation, wrong after ``accept(...)`` tokens."""
        correct = self.accept(req_id, len(self.steps[req_id]) - 1)
        state, proposal = req.prefix_state(len(req.tokens)), []
        for j in range(self.num_spec):
            token = sample(state)
            if j >= correct:
                token = 4 + (token - 4 + 1) % 1000  # a wrong draft, still a valid token id
            proposal.append(token)
            state = advance(state, token)
        self.drafts[req_id] = proposal


@dataclass
class SpecDriver(Driver):
    """The shadow driver that hands the worker's drafts to the scheduler after every step."""

    def _process(self, output, runner_output) -> None:
        super()._process(output, runner_output)
        if not self.worker.async_scheduling:
            self.scheduler.update_draft_token_ids(self.worker.take_drafts())
