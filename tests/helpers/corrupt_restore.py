"""Negative control: boundary schedulers whose restores are wrong by exactly one token of state.

Loaded into a real engine only by the tests, through vLLM's ``scheduler_cls`` (``--scheduler-cls
corrupt_restore.CorruptAsyncScheduler`` for a server whose engine-core process finds this directory
on ``PYTHONPATH``; ``scheduler_cls=`` for an in-process ``vllm.LLM``). The plugin keeps a configured
scheduler class that extends its mixin (``gate.unsupported_reasons``), so the corruption runs
with everything else of the plugin unchanged. The corruptions:

* prompt checkpoint: the bundle keyed ``P - 1`` holds the state after ``P`` tokens. Where the
  prefill stops at ``P - 1``, the capture copies are held back one engine step (the last prompt
  token ran in between); where the checkpoint is captured in the step, the recurrent state blocks
  are copied after that step's forward instead of split inside it. A resend reports exactly
  ``P - 1`` cached tokens -- only the state criteria can catch it;
* response checkpoint: keyed ``N - 1`` while its state and pages are those after ``N`` (the
  committed length, or the last step's first token under speculative decoding), so a continuation
  runs token ``N - 1`` a second time on top of it (its cached count, ``N - 1``, is off by one as
  well). Skipped where ``N - 1`` is a multiple of a group's block size (the bundle would have one
  block too many for ``N - 1``); the tests pick lengths that avoid it. The scheduler lists every
  response it corrupted in ``corrupted_responses`` (prompt length, answer, ``N``), read by
  :func:`corrupted_response_boundaries`;
* prompt checkpoint at ``P`` (``prompt_capture: end``, ``PromptEndCorruptScheduler``): keyed
  ``P - 1`` the same way, whenever its copies run; a prompt that extends ``P`` restores ``P - 1``.
"""

from __future__ import annotations

from boundary_checkpoints.core.boundaries import PROMPT, RESPONSE
from boundary_checkpoints.core.scheduler import BoundaryAsyncScheduler, BoundaryScheduler
from boundary_checkpoints.core.step_copies import IN_STEP_CAPTURES_ATTR, POST_FORWARD_COPIES_ATTR


class HeldPromptCopies:
    """Mixin placed before the plugin's scheduler class: the copies of each prompt capture ride the
    step after the one they were planned for, one step late."""

    def _emit_pending_copies(self, output):
        # Prompt captures planned by the previous schedule() would ride this step: keep them one more.
        fresh = [p for p in self._pending if p.ready_seq is None and p.kind == PROMPT and not hasattr(p, "held")]
        for pending in fresh:
            pending.held = True
        self._pending = [p for p in self._pending if all(p is not f for f in fresh)]
        try:
            return super()._emit_pending_copies(output)
        finally:
            self._pending.extend(fresh)


class OneTokenCorruption(HeldPromptCopies):
    """Mixin placed before the plugin's scheduler class (see the module docstring)."""

    def _emit_in_step_captures(self, output):
        # The state blocks hold the state after P once the step's forward ran: copy them then.
        pairs = super()._emit_in_step_captures(output)
        late = getattr(output, IN_STEP_CAPTURES_ATTR, None)
        if late:
            delattr(output, IN_STEP_CAPTURES_ATTR)
            setattr(output, POST_FORWARD_COPIES_ATTR, [*(getattr(output, POST_FORWARD_COPIES_ATTR, None) or ()), *late])
        return pairs

    def _plan_capture(self, request, num_tokens, kind, adopt, state_end=None, in_flight=None, in_step=False,
                      state_blocks=None):  # fmt: skip
        before = len(self._pending)
        super()._plan_capture(request, num_tokens, kind, adopt, state_end, in_flight, in_step, state_blocks)
        if kind == RESPONSE and len(self._pending) > before and _key_one_short(self, request, num_tokens):
            # Where the exact bundle was (under speculation it need not be the committed length), so
            # that a test can expect its continuation at exactly one token less (``corrupted_responses``).
            self.__dict__.setdefault("corrupted_responses", []).append(
                {"prompt_len": request.num_prompt_tokens, "answer": list(request.output_token_ids), "kept": num_tokens}
            )


class PromptKeyedOneShort:
    """Mixin placed before the plugin's scheduler class, for ``prompt_capture: end``: each prompt
    checkpoint at ``P`` is keyed ``P - 1`` while its state and pages are those after ``P``, whenever
    its copies run. (Holding the copies back instead depends on where the runner writes the next
    step's state: under MTP on vLLM's GPU runner the verify step leaves the block copied intact.)
    The prompt lengths it re-keyed are listed in ``corrupted_prompts``."""

    def _plan_capture(self, request, num_tokens, kind, adopt, state_end=None, in_flight=None, in_step=False,
                      state_blocks=None):  # fmt: skip
        before = len(self._pending)
        super()._plan_capture(request, num_tokens, kind, adopt, state_end, in_flight, in_step, state_blocks)
        if kind == PROMPT and len(self._pending) > before and _key_one_short(self, request, num_tokens):
            self.__dict__.setdefault("corrupted_prompts", []).append(num_tokens)


def _key_one_short(scheduler, request, num_tokens: int) -> bool:
    """Key the bundle ``scheduler`` just planned at ``num_tokens`` as ``num_tokens - 1``, its state
    unchanged. False where it cannot: ``num_tokens - 1`` a multiple of a group's block size (the
    bundle would have one block too many), no key, or the short key already held (then the exact
    bundle is dropped too, so no restore finds a correct checkpoint at ``num_tokens``)."""
    if num_tokens < 2 or any((num_tokens - 1) % g.block_size == 0 for g in scheduler._geometries):
        return False
    pending = scheduler._pending[-1]
    key = scheduler._key(request, num_tokens - 1)
    if key is None:
        return False
    if key in scheduler.checkpoint_store or any(p.key == key for p in scheduler._pending[:-1]):
        scheduler._pending.pop()
        scheduler._discard(pending)
        return False
    pending.checkpoint.key = key
    if pending.checkpoint.next_token is not None or pending.in_flight is not None:
        # Speculative decoding: the guard follows (an in-flight step's token is not needed).
        pending.checkpoint.next_token = request.all_token_ids[num_tokens - 1]
        pending.in_flight = None
    return True


class CorruptScheduler(OneTokenCorruption, BoundaryScheduler):
    """Synchronous scheduler with one-token-off restores."""


class CorruptAsyncScheduler(OneTokenCorruption, BoundaryAsyncScheduler):
    """Async scheduler with one-token-off restores."""


class PromptEndCorruptScheduler(PromptKeyedOneShort, BoundaryScheduler):
    """Synchronous scheduler whose prompt checkpoints at ``P`` are keyed one token short."""


class PromptEndCorruptAsyncScheduler(PromptKeyedOneShort, BoundaryAsyncScheduler):
    """Async scheduler whose prompt checkpoints at ``P`` are keyed one token short."""


def corrupted_pairs(prompt_len: int, committed: int, block_size: int) -> set[str]:
    """Which restores of a probe row (``"resend"``, ``"continuation"``) these schedulers corrupt.

    A prompt of ``P`` tokens with ``P - 1`` a multiple of the block keeps its ``P - 1`` state in a
    block the last prompt token no longer writes (aligned mode moves on to the next block), so the
    late copy is still exact; vLLM's own align-mode split ends a chunk at such a ``P - 1`` (the last
    block boundary below ``P``), so those prompts take the copy path under in-step capture too,
    and every other prompt's in-step capture holds the state after ``P``. ``P = 1`` has no prompt
    checkpoint. Responses: see the docstring."""
    out = set()
    if prompt_len > 1 and (prompt_len - 1) % block_size:
        out.add("resend")
    if committed >= 2 and (committed - 1) % block_size:
        out.add("continuation")
    return out


def corrupted_response_boundaries(responses: list[dict]) -> dict[tuple[int, tuple[int, ...]], int]:
    """``{(prompt length, answer): N}`` from a corrupting scheduler's ``corrupted_responses``: the
    exact response boundary of each producer whose bundle was keyed ``N - 1``."""
    return {(r["prompt_len"], tuple(r["answer"])): r["kept"] for r in responses}
