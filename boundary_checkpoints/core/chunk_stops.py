"""Where the boundary scheduler ends prefill chunks: the instruction boundary, the ``P - 1`` stop
and the indexer pool grid (contracts 1, 10, 11 and 13 in ``docs/design.md``).

Contract: :class:`ChunkStopMixin` narrows vLLM's own ``_mamba_block_aligned_split`` chunk, and
widens it in one case: a restored request's first chunk from a restore point inside a block runs
past that block's end to vLLM's next stop, reading the restored state in place and leaving its
slot uncached (``compat.leave_state_slot_uncached``), so a next turn takes the engine steps of stock's
from the block grid. A step is cut only while it prefills (:func:`is_prefill_step`). It reads the
scheduler's state that ``BoundaryCheckpointMixin.__init__`` sets.
"""

from __future__ import annotations

from itertools import pairwise

from vllm.logger import init_logger

from boundary_checkpoints.compat import (
    Request,
)
from boundary_checkpoints.core.boundaries import (
    prompt_boundary,
)
from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY, instruction_boundary
from boundary_checkpoints.core.keys import CheckpointKey
from boundary_checkpoints.core.kv_manager import count_cut_chunks

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


def request_is_eligible(request: Request) -> bool:
    """Requests whose prefix is fully described by token ids, salt and LoRA identity."""
    return (
        request.sampling_params is not None
        and request.prompt_embeds is None
        and not request.mm_features
        and request.num_prompt_tokens > 0
    )


def is_prefill_step(request: Request, start: int) -> bool:
    """Whether a step from ``start`` prefills (vLLM's own test for splitting: the prompt, or output
    tokens a resumed request replays); a decode step keeps its drafts (contract 11)."""
    return start < max(request.num_prompt_tokens, request.num_tokens - 1)


class ChunkStopMixin:
    """Chunk stops of the boundary scheduler (module docstring)."""

    def _instruction_target(self, request: Request, start: int | None = None) -> int | None:
        """The request's instruction boundary N_i (a valid explicit value, else the end of its leading
        system block by the chat template's markers), or None; validated and counted once, for a
        prefill from ``start`` (default: the computed count)."""
        request_id = request.request_id
        ledger = self._ledgers[request_id]
        if ledger.instruction_checked:
            return ledger.instruction_target
        extra_args = request.sampling_params.extra_args if request.sampling_params is not None else None
        target, reason = instruction_boundary(extra_args, request.num_prompt_tokens)
        if reason:
            self._count_instruction(f"instruction_ignored_{reason}")
            logger.warning(
                "boundary_checkpoints: request %s: instruction boundary %r ignored (%s; prompt of %d tokens)",
                request_id,
                extra_args.get(INSTRUCTION_TOKENS_KEY),
                reason,
                request.num_prompt_tokens,
            )
        if target is None and self._chat_markers.markers is not None:
            target = self._chat_markers.markers.boundary(request.prompt_token_ids)
            if target is not None:
                self._count_instruction("instruction_from_template")
        if target is not None and self._grid_only:  # contract 13
            target = self._on_pool_grid(target)
            start = request.num_computed_tokens if start is None else start
            prompt = self._grid_prompt_target(request, start)
            ends = self._vllm_chunk_ends(request, start)
            if not start < target or not self._adds_prefill_rows_only(request, target, start, ends, end=prompt):
                target = None
        if target is not None:
            self._count_instruction("instruction_requests")
        ledger.instruction_checked, ledger.instruction_target = True, target
        return target

    def _count_instruction(self, name: str) -> None:
        self._instruction_counts[name] = self._instruction_counts.get(name, 0) + 1

    # ---- chunk stop -----------------------------------------------------------------------
    def _mamba_block_aligned_split(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if not is_prefill_step(request, start):
            return num_new_tokens  # a decode step: vLLM's split keeps it too, no stop applies, none cut
        requested = num_new_tokens
        num_new_tokens = super()._mamba_block_aligned_split(
            request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
        if not self.boundaries_active:
            return num_new_tokens
        vllm_tokens = num_new_tokens
        past_block = self._past_restore_block(request, start, requested, num_new_local_computed_tokens)
        if past_block is not None:
            num_new_tokens = past_block
        cut = self._boundary_split(request, start, num_new_tokens)
        block_size = self.cache_config.block_size
        if past_block is not None and start + cut > (start // block_size + 1) * block_size:
            self._leave_slot_uncached(request.request_id, start // block_size)
        else:
            self._restores_past_block.pop(request.request_id, None)
            num_new_tokens, cut = vllm_tokens, min(cut, vllm_tokens)
        if cut < num_new_tokens and not is_prefill_step(request, start + num_new_tokens):
            self._cut_prefill_ends[request.request_id] = start + cut  # vLLM's chunk reached the prefill's end
            count_cut_chunks(self._coordinator)  # its blocks are counted to the cut end
        else:
            self._cut_prefill_ends.pop(request.request_id, None)
        return cut

    def _past_restore_block(self, request: Request, start: int, num_new_tokens: int, local: int) -> int | None:
        """A restored request's first chunk from a restore point ``start`` inside a block: vLLM
        stops it at the block's end, so that the recurrent slot of that block holds the state after
        its last token, and the rest of the prompt takes one more engine step than stock's from the
        block grid. The slot holds only the restored state, which the chunk reads; so the
        chunk runs on to vLLM's next stop from the block's start (the same end), and the slot is left
        uncached (``compat.leave_state_slot_uncached``). Returns that chunk's tokens, or None where
        it does not reach past the block (or the layout keeps the stop: ``compat``)."""
        block_size = self.cache_config.block_size
        offset = start % block_size
        if not offset or not self._runs_restores_past_block or request.num_computed_tokens:
            return None
        ledger = self._ledgers.get(request.request_id)
        if ledger is None or ledger.restored_from is None or ledger.restored_from.num_tokens != start:
            return None
        return self._chunk_past_block(request, start, num_new_tokens, local)

    def _chunk_past_block(self, request: Request, start: int, num_new_tokens: int, local: int) -> int | None:
        """vLLM's chunk of ``num_new_tokens`` from ``start`` with every stop but the end of the
        block ``start`` is in (its split from that block's start, the same end): its tokens from
        ``start``, or None where it does not reach past that block."""
        offset = start % self.cache_config.block_size
        tokens = super()._mamba_block_aligned_split(request, num_new_tokens + offset, local - offset, 0) - offset
        return tokens if offset + tokens > self.cache_config.block_size else None

    def _leave_slot_uncached(self, request_id: str, slot: int) -> None:
        """The allocations of this ``schedule()`` cache the request's recurrent blocks from
        ``slot + 1`` on (``kv_manager.counting_coordinator_class``)."""
        self._restores_past_block[request_id] = slot
        count_cut_chunks(self._coordinator)

    def _boundary_split(self, request: Request, start: int, num_new_tokens: int) -> int:
        """The plugin's chunk stops (contract 1) applied to vLLM's prefill chunk ``[start, start +
        num_new_tokens)``: the number of tokens to schedule."""
        if self._kpool and start % self._kpool:  # a prefill step (the caller's fast path took decodes)
            num_new_tokens = min(num_new_tokens, self._open_pool_step(start))  # off the pool grid (item 11)
        if not request_is_eligible(request):
            return num_new_tokens
        instruction = self._instruction_target(request, start)
        # contract 13: the step that ends at a stop is a prefill row, whatever cut it short before it
        # (vLLM's token budget, a restore); elsewhere ``_restore_tail`` is 1
        if instruction is not None and start + self._restore_tail <= instruction < start + num_new_tokens:
            key = self._key(request, instruction)
            if key is not None and not self._kept_or_pending(key):
                self._count_instruction("instruction_stops")
                return instruction - start
        if not self._prompt_captures_on:
            return num_new_tokens
        stop = self._prompt_target(request, start)
        if not start + self._restore_tail <= stop < start + num_new_tokens:
            return num_new_tokens
        if not self._keeps_prompt_checkpoint(request, start):
            return num_new_tokens
        if self._captures_in_step(request, start, start + num_new_tokens):
            return num_new_tokens
        self._ledgers[request.request_id].stopped_at = stop  # counted once the step is scheduled
        return stop - start

    def _open_pool_step(self, start: int) -> int:
        """Tokens a prefill step from ``start``, off the indexer's pool grid, may take (contract 11):
        every token of the open pool but its last, which then runs alone as a decode step and
        completes the pool from the ring. Under speculative decoding every step is one token."""
        if self.num_spec_tokens:
            return 1
        return max(1, self._kpool - 1 - start % self._kpool)

    def _prompt_target(self, request: Request, start: int | None = None) -> int:
        """Token count of ``request``'s prompt checkpoint (0: none): ``P - 1``, except under
        ``prompt_capture: end``, where it is ``P`` unless the prompt is a resend (:meth:`_is_resend`):
        a resend keeps ``P - 1`` (in step or by the stop, ``PromptCaptureDecision.resend``), so the
        sends after it restore all but the last token; under speculative decoding with a pooled
        indexer, a pool boundary below ``P - 1`` (contract 13, :meth:`_grid_prompt_target`, for a
        prefill from ``start``). 0 for a prompt that prompt admission skips (:meth:`_prompt_admitted`)."""
        if not self._prompt_admitted(request):
            return 0
        if self._prompt_at_end and not self._is_resend(request):
            prompt = request.num_prompt_tokens
            return prompt if self._beats_vllm_state(request, prompt) else 0
        if self._grid_only:
            return self._grid_prompt_target(request, start)
        target = prompt_boundary(request.num_prompt_tokens)
        return target if self._beats_vllm_state(request, target) else 0

    # ---- contract 13: the plugin's rows under speculative decoding -----------------------------
    def _grid_prompt_target(self, request: Request, start: int | None = None) -> int:
        """The prompt checkpoint under contract 13 (0: none): the highest pool boundary below
        ``P - 1`` whose stop adds only prefill rows (:meth:`_adds_prefill_rows_only`) to a prefill
        from ``start`` (default: the one chosen for, else the computed count). Chosen once the request
        has started; until then again for each start (a waiting request is looked up again every
        step). None for a request that replays its answer after a preemption."""
        if request.num_tokens > request.num_prompt_tokens:
            return 0  # a resumed request replays its answer: its prompt checkpoint was taken or not
        ledger = self._ledgers[request.request_id]
        cached = ledger.grid_target
        if cached is not None and (start is None or request.num_computed_tokens or cached[0] == start):
            return cached[1]
        start = request.num_computed_tokens if start is None else start
        ends = self._vllm_chunk_ends(request, start)
        target = self._on_pool_grid(prompt_boundary(request.num_prompt_tokens))
        while target > start and not self._adds_prefill_rows_only(request, target, start, ends):
            target -= self._kpool
        target = target if target > start else 0
        ledger.grid_target = (start, target)
        return target

    def _adds_prefill_rows_only(self, request: Request, point: int, start: int, ends: list[int], end: int = 0) -> bool:
        """Whether a stop or a restore at ``point`` of a prefill from ``start`` whose chunks vLLM
        ends at ``ends`` leaves the rows around it prefill rows (contract 13, ``boundaries.restore_tail``):
        the row vLLM runs from ``point`` (up to ``end``, a later stop of the plugin, where that
        comes first) and the row that ends there, from the last of ``ends`` below it, are
        ``_restore_tail`` long or more, and after that vLLM's rows go on as before. A point
        where vLLM itself ends a chunk adds no row."""
        if point in ends:
            return True
        tail = self._restore_tail
        below = max((e for e in ends if e < point), default=start)
        after = self._vllm_chunk_ends(request, point, first_only=True)[0]
        if point < end < after:
            after = end
        return point - below >= tail and after - point >= tail and (after in ends or after == end)

    def _runs_short_rows_from(self, request: Request, start: int) -> bool:
        """Whether vLLM's own split of the prompt's prefill from ``start`` runs a row shorter than
        ``_restore_tail`` that starts or ends off the block grid before ``P`` (contract 13; a row
        from a block boundary to ``P`` is one stock runs after any block-grid hit). A start inside
        a block, from a hit at a prefix match unit finer than the block, runs to the block's end
        or to vLLM's stop at its prompt checkpoint first."""
        block, prompt = self.cache_config.block_size, request.num_prompt_tokens
        ends = self._vllm_chunk_ends(request, start)
        return any(
            end - begin < self._restore_tail and (begin % block or (end < prompt and end % block))
            for begin, end in pairwise([start, *ends])
        )

    def _vllm_chunk_ends(self, request: Request, start: int, first_only: bool = False) -> list[int]:
        """Where vLLM's own split (``_mamba_block_aligned_split``, no budget) ends the prompt's
        prefill chunks from ``start``, through ``P``."""
        ends, position, prompt = [], start, request.num_prompt_tokens
        while position < prompt:
            row = super()._mamba_block_aligned_split(request, prompt - position, position - request.num_computed_tokens)
            position += max(row, 1)
            ends.append(position)
            if first_only:
                break
        return ends or [prompt]

    def _reaches_a_pool_past(self, num_tokens: int, vllm_hit: int) -> bool:
        """Whether a bundle at ``num_tokens`` is worth keeping and restoring on a layout with an
        indexer pool (outside contract 13): it reaches at least one pool past ``vllm_hit``, the
        hit vLLM's own cache gives (or will give) that prefix. A restore off the pool grid runs its
        open pool in steps of its own (contract 11); fewer tokens than a pool recompute faster
        inside vLLM's own step from its hit. True on layouts without a pool."""
        return not self._kpool or self._grid_only or num_tokens - vllm_hit >= self._kpool

    def _beats_vllm_state(self, request: Request, num_tokens: int) -> bool:
        """Whether a bundle of ``request`` at ``num_tokens`` reaches a pool past the longest
        prefix whose recurrent state vLLM's cache keeps from ``request`` (:meth:`_reaches_a_pool_past`):
        the block boundary its prompt's chunks ended at (vLLM's block-aligned split), not one its
        decode steps crossed."""
        block_size = self.cache_config.block_size
        vllm_state = min(num_tokens, request.num_prompt_tokens) // block_size * block_size
        return self._reaches_a_pool_past(num_tokens, vllm_state)

    def _on_pool_grid(self, num_tokens: int) -> int:
        """The indexer's pool boundary at or below ``num_tokens``."""
        return num_tokens // self._kpool * self._kpool

    def _response_on_grid(self, num_tokens: int) -> bool:
        """Whether a response bundle at ``num_tokens`` serves under contract 13: on the pool grid,
        and a next turn restored there runs a prefill row up to the block boundary where vLLM ends
        a chunk that starts inside a block (``_restore_tail`` tokens or more)."""
        offset = num_tokens % self.cache_config.block_size
        return not num_tokens % self._kpool and (
            not offset or self.cache_config.block_size - offset >= self._restore_tail
        )

    def _is_resend(self, request: Request) -> bool:
        """Whether a bundle at this very prompt (``P``) is retained or pending when the request's
        prefill starts; decided once per request. A resend of a prompt whose bundle was evicted or
        refused is no resend here, but records the reuse distance (``ReuseTracker.revisit``)."""
        ledger = self._ledgers[request.request_id]
        if ledger.resend is None:
            key = self._key(request, request.num_prompt_tokens)
            ledger.resend = key is not None and self._kept_or_pending(key)
            if key is not None and not ledger.resend:
                self.checkpoint_store.reuse.revisit(key)
        return ledger.resend

    def _prompt_admitted(self, request: Request) -> bool:
        """Whether ``request``'s prompt keeps a checkpoint (``core/admission.py``); decided once per
        request, when its prefill is first planned. A skipped prompt counts in the store's
        ``prompts_skipped``."""
        ledger = self._ledgers[request.request_id]
        if ledger.prompt_admitted is None:
            key = self._key(request, request.num_prompt_tokens)
            ledger.prompt_admitted = self._prompt_admission.admit(key, self._is_resend(request))
            self.checkpoint_store.counters.prompts_skipped += not ledger.prompt_admitted
        return ledger.prompt_admitted

    def _kept_or_pending(self, key: CheckpointKey) -> bool:
        """Whether a bundle with ``key`` is retained or its capture is pending."""
        return key in self.checkpoint_store or any(p.key == key for p in self._pending)

    def _keeps_prompt_checkpoint(self, request: Request, start: int) -> bool:
        """Whether a prefill step from ``start`` that reaches the prompt checkpoint keeps it
        (``prompt_checkpoint_min_tokens``)."""
        return self._prompt_target(request) - start >= self.boundary_config.prompt_checkpoint_min_tokens

    def _captures_in_step(self, request: Request, start: int, end: int) -> bool:
        """Whether the prefill step ``[start, end)`` that crosses ``P - 1`` takes the prompt
        checkpoint inside itself rather than stopping there (contract 1): in-step capture is on,
        the step ends at ``P``, and the part before ``P - 1`` would run as a prefill row of its
        own (a first chunk, or two tokens or more), as it does after the stop."""
        stop = prompt_boundary(request.num_prompt_tokens)
        return self._prompt_in_step and end == request.num_prompt_tokens and (start == 0 or stop - start >= 2)
