"""The player and the checks of the MTP property tests (``tests/core/test_property_spec.py``).

:class:`SpecStream` plays one example's operations (``property_ops``) on vLLM's real scheduler
with the plugin (sync, MTP with ``k`` drafts, acceptance from a script cycled per request) against
``spec_shadow.SpecShadowWorker``, and asserts after every operation: outputs equal (a prefix of)
the cold output, cached tokens stay within the longest common prefix with an earlier request of the
same salt and ``P - 1``, the retention budget holds and, with ``exact``, every retained bundle sits
where :func:`contract_boundary` puts it with the token after it; :meth:`SpecStream.finish` asserts
no leak. :func:`play_conversation` plays one request at a time on :data:`ROOMY` and asserts exact
cached counts. A failure raises ``AssertionError`` (or ``ShadowMismatch``); :class:`Totals` counts
what an example exercised, for the tests to require. The operations, the output and cached-token
checks are ``property_player.OperationPlayer``'s, shared with ``property_stream.Stream`` (the player
of ``test_property_scheduler.py``); the MTP checks and the totals are this one's.
"""

from __future__ import annotations

from dataclasses import dataclass

from property_ops import Continue, Resend, Reset
from property_player import OperationPlayer, Tracked
from shadow_scheduler import build_scheduler
from spec_shadow import SpecDriver, SpecShadowWorker

from boundary_checkpoints.core.boundaries import PROMPT, RESPONSE
from boundary_checkpoints.core.keys import make_key, root_discriminator

BLOCK = 16


# ---- the contract's boundary ------------------------------------------------------------------
def contract_boundary(step, num_tokens: int, k: int) -> int:
    """Where the response checkpoint of a request must be (0: none), from its last step as the
    shadow ran it and its final token count (scheduler contract 3, ``speculative_response_boundary``):
    the committed count when the step had no drafts, or accepted every draft and ended on the block
    grid; the state after the step's first token when it carried all ``k`` drafts; none for
    ``0 < d < k`` drafts; none unless below the final token count (a stop or cap trimmed it)."""
    sampled = step.num_accepted > 0
    computed = step.end - step.num_drafts - 1 + step.num_accepted if sampled else step.end
    if step.num_drafts == 0 or (computed == step.end and step.end % BLOCK == 0):
        boundary = computed
    elif step.num_drafts == k:
        boundary = min(computed, step.end - k)
    else:
        return 0
    return boundary if 0 < boundary < num_tokens else 0


def committed(step) -> int:
    """Tokens whose state the request computed after its last step (vLLM's num_computed_tokens)."""
    return step.end - step.num_drafts - 1 + step.num_accepted if step.num_accepted else step.end


# ---- one example's scheduler ------------------------------------------------------------------
@dataclass(frozen=True)
class Pool:
    """The block pool and budgets one example runs on (the streams test draws them)."""

    num_blocks: int
    max_num_batched_tokens: int
    max_retained_fraction: float
    reserve_full_prompt: bool
    # Not drawn: near max_model_len vLLM schedules a decode with fewer than k drafts, or none,
    # after a step that accepted drafts; vLLM 0.32's runner reads a zero-draft decode through the
    # speculative path (accepted-token offset, gpu_model_runner.py), which the spec shadow does
    # not model (it reads column 0, offset 0), so the shadow flags stock vLLM there too.
    max_model_len: int = 1024


ROOMY = Pool(400, 64, 1.0, True)  # no pressure: the conversations' pool


# ---- playing ----------------------------------------------------------------------------------
@dataclass
class Totals:
    examples: int = 0
    operations: int = 0
    requests: int = 0
    steps: int = 0
    drafted_steps: int = 0
    partial_draft_steps: int = 0  # steps with 0 < d < k drafts
    accepted_drafts: int = 0
    checkpoint_hits: int = 0
    restored_reads: int = 0
    exact_prompt_resends: int = 0  # resends that cached exactly P - 1
    response_restores: int = 0  # next turns that cached exactly a response bundle's N
    response_behind: int = 0  # response bundles published below the committed count
    max_response_gap: int = 0  # largest committed - N seen
    no_response_partial: int = 0  # producers whose last step carried 0 < d < k drafts
    stops_among_drafts: int = 0  # a stop token left vLLM's computed count past the kept tokens
    stock_over_checkpoint: int = 0  # a stock block hit longer than every retained bundle
    evictions: int = 0
    preemptions: int = 0
    aborts: int = 0
    resets: int = 0
    seconds: float = 0.0

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            if name == "max_response_gap":
                self.max_response_gap = max(self.max_response_gap, other.max_response_gap)
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))


class SpecStream(OperationPlayer):
    """One scheduler with MTP ``k`` drafts + the spec shadow playing one example."""

    resends_under_other_salts = False

    def __init__(self, model_dir, k: int, script: list[int], pool: Pool, scheduler_cls=None) -> None:
        scheduler, worker = build_scheduler(
            model_dir,
            num_blocks=pool.num_blocks,
            max_num_seqs=4,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_retained_fraction=pool.max_retained_fraction,
            scheduler_reserve_full_isl=pool.reserve_full_prompt,
            max_model_len=pool.max_model_len,
            num_speculative_tokens=k,
            worker_cls=SpecShadowWorker,
        )
        if scheduler_cls is not None:
            scheduler.__class__ = scheduler_cls
        self.k, self.script = k, [min(a, k) for a in script]
        self.index: dict[str, int] = {}  # request id -> position in the stream
        worker.num_spec, worker.accept = k, self._accept
        max_prompt = min(240, (pool.num_blocks - 8 - 4 * k) * BLOCK - BLOCK, pool.max_model_len - 1)
        super().__init__(SpecDriver(scheduler, worker), pool.max_retained_fraction, max_prompt, Totals(examples=1))
        self.max_model_len = pool.max_model_len
        self.exact = True  # check provenance (False: only the shadow and the outputs)

    def _accept(self, request_id: str, step: int) -> int:
        return self.script[(self.index[request_id] * 5 + step) % len(self.script)]

    def apply(self, op) -> Tracked | None:
        """Plays ``op`` and checks; returns the request it added, if any."""
        result = self.handle(op)
        self.totals.operations += 1
        self.check()
        return result if isinstance(result, Tracked) else None

    # A stream's first fresh prompt may exceed max_prompt (k = 3 on the smallest pools: 48 tokens),
    # so the operations that pick an earlier request may find none: they do nothing.
    def admitted_max_tokens(self, prompt: list[int], max_tokens: int) -> int | None:
        if len(prompt) > self.max_prompt:
            return None
        return min(max_tokens, self.max_model_len - len(prompt))  # vLLM caps there

    def _add(self, prompt, salt, max_tokens, stop_at=None) -> Tracked | bool:
        added = super()._add(prompt, salt, max_tokens, stop_at)
        if isinstance(added, Tracked):
            self.index[added.request.request_id] = len(self.tracked) - 1
        return added

    def _op_reset(self, op: Reset) -> bool:
        done = super()._op_reset(op)
        # Every running request was preempted and every bundle dropped: the whole pool is free.
        assert self.pool.get_num_free_blocks() == self.free_before, "blocks leaked across a reset"
        return done

    # -- invariants --
    def check(self) -> None:
        assert self.scheduler.checkpoint_store.budgeted_blocks <= self.budget
        self.check_requests()
        if self.exact:
            self.check_provenance()

    def response_boundary(self, t: Tracked) -> int:
        steps = self.worker.steps.get(t.request.request_id)
        return contract_boundary(steps[-1], t.request.num_tokens, self.k) if steps else 0

    def check_provenance(self) -> None:
        """Each retained bundle is exactly a boundary the contract allows, with its next token."""
        by_id = {t.request.request_id: t for t in self.tracked}
        for checkpoint in self.scheduler.checkpoint_store.checkpoints():
            n, producer = checkpoint.num_tokens, by_id[checkpoint.producer]
            tokens = list(producer.request.all_token_ids)
            if checkpoint.kind == PROMPT:
                assert n == len(producer.prompt) - 1, f"prompt checkpoint at {n}, P = {len(producer.prompt)}"
            else:
                assert checkpoint.kind == RESPONSE and producer.request.is_finished() and not producer.aborted
                step = self.worker.steps[producer.request.request_id][-1]
                assert n == self.response_boundary(producer), (
                    f"response checkpoint at {n}; the contract puts it at {self.response_boundary(producer)} "
                    f"(last step {step}, {producer.request.num_tokens} tokens, k = {self.k})"
                )
                assert committed(step) - self.k <= n <= committed(step)
            root = root_discriminator(producer.salt, None)
            assert checkpoint.key == make_key(tokens, n, producer.request.block_hashes, BLOCK, root)
            assert checkpoint.next_token == tokens[n], "the bundle must record the token after it"

    def finish(self) -> None:
        self.step_until(lambda: not self.scheduler.has_requests())
        self.driver.drain()
        assert all(t.request.is_finished() for t in self.tracked)
        self.check()
        stats = self.scheduler.boundary_stats()
        assert stats["captures_pending"] == 0, stats
        assert len(self.scheduler._ledgers) == 0, "a freed request left its ledger behind"
        retained = self.scheduler.checkpoint_store.retained_blocks
        assert self.pool.get_num_free_blocks() == self.free_before - retained, "block leak"
        self.tally()
        self.scheduler.checkpoint_store.clear()
        assert self.pool.get_num_free_blocks() == self.free_before, "block leak after clearing the store"

    def tally(self) -> None:
        stats = self.scheduler.boundary_stats()
        self.totals.checkpoint_hits, self.totals.evictions = stats["hits"], stats["evictions"]
        self.totals.restored_reads = self.worker.restored_reads
        self.totals.preemptions = sum(t.request.num_preemptions for t in self.tracked)
        for t in self.tracked:
            steps = self.worker.steps.get(t.request.request_id, [])
            drafted = [s for s in steps if s.num_drafts]
            self.totals.drafted_steps += len(drafted)
            self.totals.partial_draft_steps += sum(1 for s in drafted if s.num_drafts < self.k)
            self.totals.accepted_drafts += sum(s.num_accepted - 1 for s in drafted)
            if not steps or t.aborted:
                continue
            last = steps[-1]
            self.totals.stops_among_drafts += committed(last) > t.request.num_tokens - 1
            self.totals.no_response_partial += 0 < last.num_drafts < self.k
            n = self.response_boundary(t)
            if n:
                self.totals.response_behind += n < committed(last)
                self.totals.max_response_gap = max(self.totals.max_response_gap, committed(last) - n)


def served_by(checkpoint, tracked: Tracked) -> bool:
    """Whether ``checkpoint`` serves ``tracked``'s prompt: same prefix key (salt included) and the
    same token after it (its MTP draft row depends on it), below ``P``."""
    n, prompt, request = checkpoint.num_tokens, tracked.prompt, tracked.request
    if n > len(prompt) - 1:
        return False
    key = make_key(prompt, n, request.block_hashes, BLOCK, root_discriminator(tracked.salt, None))
    return key == checkpoint.key and prompt[n] == checkpoint.next_token


def play_conversation(model_dir, k, script, ops, scheduler_cls=None, exact: bool = True) -> Totals:
    """One request at a time on a roomy pool; every lookup's result is exact (see the module
    docstring). ``exact=False`` (a negative control) leaves only the shadow's checks and the
    outputs: no provenance, presence or count assertion."""
    stream = SpecStream(model_dir, k, script, ROOMY, scheduler_cls)
    stream.exact = exact
    store = stream.scheduler.checkpoint_store
    for op in ops:
        before = list(store.checkpoints())
        t = stream.apply(op)
        if t is None:
            continue
        longest = max([c.num_tokens for c in before if served_by(c, t)], default=0)
        stream.step_until(t.request.is_finished)
        stream.driver.drain()
        if not exact:
            continue
        cached = stream.driver.cached_tokens[t.request.request_id]
        rid = t.request.request_id
        assert cached >= longest, f"{rid} cached {cached}; a retained bundle serves {longest}"
        if cached > longest:  # only a stock hit, on the block grid, may beat the retained bundles
            assert cached % BLOCK == 0, f"{rid} cached {cached}; the longest retained bundle serves {longest}"
            stream.totals.stock_over_checkpoint += 1
        if isinstance(op, Resend) and longest == len(t.prompt) - 1:
            assert cached == len(t.prompt) - 1
            stream.totals.exact_prompt_resends += 1
        if isinstance(op, Continue) and cached == longest:
            previous = stream.tracked[op.which % (len(stream.tracked) - 1)]
            if longest and longest == stream.response_boundary(previous):
                stream.totals.response_restores += 1
        # The turn's own bundles are retained where the contract puts them.
        keys = {c.key for c in store.checkpoints()}
        tokens, root = list(t.request.all_token_ids), root_discriminator(t.salt, None)
        for n in (len(t.prompt) - 1, stream.response_boundary(t)):
            if n > 0:
                key = make_key(tokens, n, t.request.block_hashes, BLOCK, root)
                assert key in keys, f"{rid}: no bundle retained at {n} (P = {len(t.prompt)}, {len(tokens)} tokens)"
    stream.finish()
    return stream.totals
