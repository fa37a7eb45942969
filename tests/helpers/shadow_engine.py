"""A shadow model runner that mirrors vLLM's KV cache block by block and checks every read.

It stands in for the model runner under vLLM's real scheduler, KV cache manager, block pool and
coordinator (built and driven by ``shadow_scheduler``). :class:`ShadowWorker` mirrors what
vLLM's V1 runner (behind the plugin's worker) does with a ``SchedulerOutput`` in "align" mode --
apply the plugin's capture copies, zero new attention blocks, apply ``kv_cache_block_copies``, then
per request read the recurrent state from the block of the previous step (``(num_computed - 1) //
B`` for a new or resumed request), advance it through the scheduled tokens, write it into block
``ceil(end / B) - 1`` and write attention rows -- except that the "state" is a hash of the token
prefix. Every read is checked against the hash recomputed from the request's tokens, so any wrong
restore, missing copy, or block reused too early shows up as a :class:`ShadowMismatch`. Greedy
"sampling" is a function of the state, so a wrong state also changes the tokens.

In-step prompt captures (``prompt_capture: in_step``) are modelled like the plugin's GDN layers do
them: a request whose recurrent state block of this step is the source of a pair in
``boundary_in_step_captures`` gets the state after all but its step's last token written into the
pair's destination (a step of fewer than two tokens, or a pair no request takes, is a mismatch);
``boundary_post_forward_copies`` are applied after every request's forward.

``parallel_rows`` (on unless a test turns it off): a step's rows read their recurrent states as the
step found them (after its copies), as a GPU's rows run at once: a row that reads a state another
row of the same step writes sees the old one, so a hit admitted on a state computed in its own step
is a mismatch.

A "ring" group (the GLM indexer tail ring, block size = the pool size ``kpool``) holds, in the
request's one block, the tokens of the pool in progress. Like GLM's indexer, a step that starts off
the pool grid and completes the open pool must be a single (decode) token, which reads the ring; a
longer (prefill) step there never writes the pool's key. Such a step, or a step off the grid whose
ring does not hold exactly the tokens ``[start // kpool * kpool, start)``, is a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MOD = (1 << 61) - 1
EMPTY_STATE = 7
ZERO = -1  # content of a freshly zeroed attention row


def advance(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 11) % MOD


def sample(state: int, vocab: int = 1000) -> int:
    return 4 + state % vocab


class ShadowMismatch(AssertionError):
    pass


@dataclass
class ShadowRequest:
    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int
    state_idx: int | None = None
    _prefix: list[int] = field(default_factory=lambda: [EMPTY_STATE])

    def prefix_state(self, length: int) -> int:
        """Hash state after ``tokens[:length]`` (cached; tokens only ever grow)."""
        while len(self._prefix) <= length:
            self._prefix.append(advance(self._prefix[-1], self.tokens[len(self._prefix) - 1]))
        return self._prefix[length]


@dataclass
class ShadowWorker:
    """Block contents keyed by block id: attention rows and recurrent states."""

    group_kinds: list[str]  # "attention" | "recurrent" | "ring" per KV cache group
    block_sizes: list[int]
    rows: dict[int, list[int]] = field(default_factory=dict)
    states: dict[int, int] = field(default_factory=dict)
    rings: dict[int, tuple[int, ...]] = field(default_factory=dict)
    requests: dict[str, ShadowRequest] = field(default_factory=dict)
    copies_applied: int = 0
    restored_reads: int = 0
    in_step_captures: int = 0
    in_step: dict[int, int] = field(default_factory=dict)  # this step's in-step capture pairs
    # Recurrent kernels that export a block-boundary state from inside a chunk (KDA, Mamba2):
    # (hash block, state block, alignment, cache-hit alignment) for vLLM's own placement rule.
    prefill_checkpoints: tuple[int, int, int, int] | None = None
    drop_eagle_block: bool = False  # vLLM's use_eagle_block_drop (MTP, DFlash), for that placement rule
    internal_checkpoints: int = 0  # such states written into a real (not the null) block
    parallel_rows: bool = True  # recurrent reads see the states at the step's start (module docstring)
    _step_states: dict[int, int] | None = None

    def execute(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids or ():
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = ShadowRequest(
                list(new.prompt_token_ids), [list(ids) for ids in new.block_ids], new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.requests[req_id] = ShadowRequest(
                    list(cached.all_token_ids[req_id]), [list(ids) for ids in new_ids], cached.num_computed_tokens[i]
                )
                continue
            req = self.requests[req_id]
            known = cached.all_token_ids.get(req_id)
            if known is not None and list(known) != req.tokens[: len(known)]:
                raise ShadowMismatch(f"{req_id}: scheduler and worker disagree on the tokens")
            if new_ids is not None:
                for group, ids in enumerate(new_ids):
                    req.block_ids[group].extend(ids)
            if req.num_computed != cached.num_computed_tokens[i]:
                raise ShadowMismatch(
                    f"{req_id}: worker computed {req.num_computed}, scheduler says {cached.num_computed_tokens[i]}"
                )
        # The plugin's worker applies capture copies before the runner zeroes and copies.
        for src, dst in getattr(so, "boundary_capture_copies", None) or ():
            self._copy(src, dst)
        for block_id in so.new_block_ids_to_zero or ():
            self.rows[block_id] = [ZERO] * max(self.block_sizes)
            self.rings.pop(block_id, None)
        for copy in so.kv_cache_block_copies or ():
            self._copy(copy.src_block_id, copy.dst_block_id)

        self.in_step = dict(getattr(so, "boundary_in_step_captures", None) or ())
        self._step_states = dict(self.states) if self.parallel_rows else None
        req_ids, sampled = [], []
        for req_id, num in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            sampled.append(self._forward(req_id, req, num))
            req_ids.append(req_id)
        if self.in_step:
            raise ShadowMismatch(f"in-step captures {self.in_step} taken by no request")
        for src, dst in getattr(so, "boundary_post_forward_copies", None) or ():
            self._copy(src, dst)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def _ring_step(self, req_id: str, req: ShadowRequest, group: int, start: int, end: int) -> None:
        kpool, [block] = self.block_sizes[group], req.block_ids[group]
        if start % kpool:
            if end - start > 1 and end >= start // kpool * kpool + kpool:
                raise ShadowMismatch(f"{req_id}: a {end - start}-token step from {start} completes the open pool")
            if self.rings.get(block) != tuple(req.tokens[start // kpool * kpool : start]):
                raise ShadowMismatch(f"{req_id}: ring group {group} at {start} is wrong")
        self.rings[block] = tuple(req.tokens[end // kpool * kpool : end])

    def _copy(self, src: int, dst: int) -> None:
        self.copies_applied += 1
        if src in self.rows:
            self.rows[dst] = list(self.rows[src])
        else:
            self.rows.pop(dst, None)
        if src in self.states:
            self.states[dst] = self.states[src]
        else:
            self.states.pop(dst, None)
        if src in self.rings:
            self.rings[dst] = self.rings[src]
        else:
            self.rings.pop(dst, None)

    def _internal_checkpoint(self, start: int, end: int, blocks: list[int]) -> tuple[int, int] | None:
        """``(position, block)``: where vLLM's worker writes the state after ``position`` tokens
        of the chunk ``[start, end)`` (``compute_mamba_prefill_checkpoints``, which knows no prefill
        end: into the null block, id 0, where the manager reserved none), or None."""
        if self.prefill_checkpoints is None:
            return None
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        hash_block, state_block, alignment, hit_alignment = self.prefill_checkpoints
        [offset], [col] = compute_mamba_prefill_checkpoints(
            [end], [end - start], hash_block_size=hash_block, mamba_block_size=state_block,
            checkpoint_alignment=alignment, drop_eagle_block=self.drop_eagle_block,
            cache_hit_alignment_tokens=hit_alignment,
        )  # fmt: skip
        if col < 0:
            return None
        block = blocks[col] if col < len(blocks) else 0
        self.internal_checkpoints += block != 0
        return start + offset, block

    def _forward(self, req_id: str, req: ShadowRequest, num: int) -> list[int]:
        start, end = req.num_computed, req.num_computed + num
        if end > len(req.tokens):
            raise ShadowMismatch(f"{req_id}: scheduled past its known tokens ({end} > {len(req.tokens)})")
        final_state = None
        previous_state_idx = req.state_idx
        for group, (kind, size) in enumerate(zip(self.group_kinds, self.block_sizes)):
            blocks = req.block_ids[group]
            if kind == "ring":
                self._ring_step(req_id, req, group, start, end)
            elif kind == "attention":
                for row in range(start):
                    got = self.rows.get(blocks[row // size], [])
                    value = got[row % size] if row % size < len(got) else None
                    if value != req.prefix_state(row + 1):
                        raise ShadowMismatch(f"{req_id}: attention group {group} row {row} is wrong")
                for row in range(start, end):
                    page = self.rows.setdefault(blocks[row // size], [ZERO] * size)
                    page[row % size] = req.prefix_state(row + 1)
            else:
                prev = previous_state_idx if previous_state_idx is not None else (start - 1) // size
                read = self.states if self._step_states is None else self._step_states
                state = EMPTY_STATE if start == 0 else read.get(blocks[prev])
                if start and previous_state_idx is None:
                    self.restored_reads += 1
                if state != req.prefix_state(start):
                    raise ShadowMismatch(f"{req_id}: recurrent group {group} state at {start} is wrong")
                current = -(-end // size) - 1
                destination = self.in_step.pop(blocks[current], None)
                internal = self._internal_checkpoint(start, end, blocks)
                for position, token in enumerate(req.tokens[start:end], start):
                    if internal is not None and position == internal[0]:
                        self.states[internal[1]] = state
                    if destination is not None and position == end - 1:
                        if end - start < 2:
                            raise ShadowMismatch(f"{req_id}: in-step capture of a {end - start}-token step")
                        self.states[destination] = state
                        self.in_step_captures += 1
                    state = advance(state, token)
                self.states[blocks[current]] = state
                req.state_idx = current
                final_state = state
        req.num_computed = end
        if end < len(req.tokens):
            return []  # a prefill chunk samples nothing
        token = sample(final_state)
        req.tokens.append(token)
        return [token]
