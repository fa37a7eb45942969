"""Which boundaries a request has, and which blocks make up a bundle at a boundary.

Contract
--------
Boundaries (all exact token counts, no alignment):

* prompt boundary ``P - 1``: the scheduler ends a prefill chunk there, so the state after ``P - 1``
  prompt tokens exists for one step, or the Gated DeltaNet layers of the step that computes the
  prompt write that state into the bundle's block (in-step capture, ``worker/gdn_split.py``); an
  exact resend then reports ``P - 1`` cached tokens and recomputes only the last prompt token to
  get its logits (vLLM never reports ``P`` of ``P``);
* instruction boundary ``N_i`` (``core/instruction.py``): the token count of the request's leading
  instructions, when the request carries a valid one; the scheduler ends a prefill chunk there, so
  the state after ``N_i`` tokens exists for one step, and many conversations that share those
  instructions restore there (kind :data:`INSTRUCTION`, evicted last, never retired by lineage);
* response boundary: the committed length when a request finishes STOPPED or LENGTH_CAPPED, i.e.
  every token whose KV and recurrent state were computed (``num_tokens - 1``, or ``num_tokens``
  when async scheduling already had the last sampled token in flight; under speculative decoding
  see :func:`speculative_response_boundary` and :func:`in_flight_response_boundary`).

A bundle at ``N`` is planned from a request's live block table (:func:`plan_bundle`): each KV
group contributes what its kind plans (``core/group_kinds.py``): full attention pages shared, the
partial tail page, the recurrent state or the indexer ring preserved (copied to a private block, or
adopted when the producer has finished), null padding where vLLM's own hits have it. Under
speculative decoding the recurrent source is the running-state column of the producer's last step,
block ``(E - 1) // B`` with ``E`` that step's end *drafts included* (``state_end``), which may lie
past ``(N - 1) // B``; the bundle still lists it at ``(N - 1) // B``.

Speculative decoding (align mode, ``k`` draft tokens, :func:`speculative_response_boundary`): a
verify step that starts at ``c`` with ``d`` drafts writes the recurrent state after ``c + 1 + t``
tokens into the SSM column ``t`` (``t <= d``) and rolls the conv window buffer of column 0, where
the window after ``c + 1`` tokens sits at offset ``k - d``. When it accepts ``a`` tokens, the
state after ``c + a`` (vLLM's committed count) is split across columns, but the state after
``c + 1`` is whole in column 0 when ``d == k`` (offset 0, where a fresh request reads it), and
depends on no draft. The response bundle is therefore taken at ``c + 1``, up to ``k`` tokens
before the committed end: never a speculative column, and rejected drafts leave no trace in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from boundary_checkpoints.core.checkpoint import BlockLike
from boundary_checkpoints.core.group_kinds import GroupGeometry
from boundary_checkpoints.core.kinds import CheckpointKind

PROMPT = CheckpointKind.PROMPT
RESPONSE = CheckpointKind.RESPONSE
INSTRUCTION = CheckpointKind.INSTRUCTION


def prompt_boundary(num_prompt_tokens: int) -> int:
    """Token count of the prompt checkpoint (0: the prompt is too short to have one)."""
    return max(num_prompt_tokens - 1, 0)


def restore_tail(num_spec_tokens: int) -> int:
    """Under speculative decoding with a pooled indexer (docs/design.md contract 13), the fewest
    tokens of a prefill row the plugin makes (after its stop, or from its restore): more than a
    verify row (``1 + k``), so that vLLM runs it as a prefill row, never as a short row among the
    decodes."""
    return num_spec_tokens + 2


def response_boundary(num_computed_tokens: int, num_tokens: int) -> int:
    """Token count of the response checkpoint of a finished request (0: none is exact).

    The scheduler's computed count includes any step still in flight, which is exactly the
    state the request's blocks hold once that step has run; it can never exceed the tokens
    whose ids are known.
    """
    if num_computed_tokens <= 0 or num_computed_tokens > num_tokens:
        return 0
    return num_computed_tokens


def speculative_response_boundary(
    num_computed_tokens: int,
    num_tokens: int,
    step_end: int,
    step_drafts: int,
    num_speculative_tokens: int,
    block_size: int,
) -> int:
    """Token count of the response checkpoint of a request whose last step (ending at
    ``step_end``, drafts included) carried ``step_drafts`` draft tokens of at most
    ``num_speculative_tokens``, on recurrent blocks of ``block_size`` (0: none is exact; see the
    module docstring). It is always below ``num_tokens``: the bundle records token ``N``, from
    which its MTP draft row ``N - 1`` was computed.

    * no drafts: the step wrote its state whole, as without speculation;
    * every draft accepted and ``step_end`` a multiple of the block: vLLM's post-step copy moved the
      committed state whole into the step's column 0 (it keeps block-aligned states), so the
      committed count is exact -- unless a stop or length cap trimmed tokens it covers;
    * otherwise, with ``k`` drafts, the state after the step's first token, ``step_end - k``
      (its first sampled token is always kept, so that is below ``num_tokens``);
    * ``0 < d < k`` drafts leave that state at an offset of the conv window that a fresh request
      does not read: no checkpoint."""
    full_and_aligned = num_computed_tokens == step_end and step_end % block_size == 0
    if step_drafts == 0 or full_and_aligned:
        boundary = num_computed_tokens
    elif step_drafts == num_speculative_tokens:
        boundary = min(num_computed_tokens, step_end - step_drafts)
    else:
        return 0
    return boundary if 0 < boundary < num_tokens else 0


def in_flight_response_boundary(
    num_computed_tokens: int, num_tokens: int, step_drafts: int, num_speculative_tokens: int
) -> int:
    """Token count of the response checkpoint of a request that finished (async scheduling) with
    one verify step still in flight, carrying ``step_drafts`` drafts (0: none is exact).

    ``num_computed_tokens`` is vLLM's count once the finishing step's rejected drafts were taken
    back: the in-flight step's end, its drafts included. That step's input is the finishing
    step's last sampled token (position ``num_tokens - 1``) unless a stop or length cap trimmed
    tokens behind it, so ``num_computed_tokens - step_drafts == num_tokens`` holds exactly when
    nothing was trimmed and no other step is in flight. The step then leaves the state after
    ``num_tokens`` tokens whole in its column 0, block ``(num_computed_tokens - 1) // B`` (SSM
    slot 0; the conv window at offset ``k - d``, which a restored request reads only for ``d``
    in ``{0, k}``) -- unless it accepts every draft and ends on a block, when vLLM's post-step
    copy overwrites that column with its own committed state (the caller checks that from the
    step's output). ``N = num_tokens``: the bundle's next token is the step's first sampled
    token, from which its MTP draft row ``N - 1`` is computed."""
    if step_drafts not in (0, num_speculative_tokens) or num_computed_tokens - step_drafts != num_tokens:
        return 0
    return num_tokens


@dataclass(frozen=True)
class BundlePlan:
    """Blocks of one bundle at ``num_tokens``.

    ``shared[g]``: blocks referenced as they are (full attention pages; null padding).
    ``sources[g]``: the block whose content must be preserved (tail page or running state),
    or None when the group needs nothing beyond ``shared[g]``.
    """

    num_tokens: int
    shared: tuple[tuple[BlockLike, ...], ...]
    sources: tuple[BlockLike | None, ...]

    def group_blocks(self, replacements: Sequence[BlockLike | None]) -> tuple[tuple[BlockLike, ...], ...]:
        """The bundle's block lists, with each group's source replaced by ``replacements[g]``."""
        out = []
        for shared, source, replacement in zip(self.shared, self.sources, replacements, strict=True):
            if source is None:
                out.append(tuple(shared))
            else:
                assert replacement is not None
                out.append((*shared, replacement))
        return tuple(out)

    def copy_sources(self) -> list[BlockLike]:
        return [source for source in self.sources if source is not None]


def plan_bundle(
    geometries: Sequence[GroupGeometry],
    request_blocks: Sequence[Sequence[BlockLike]],
    num_tokens: int,
    null_block: BlockLike,
    state_end: int | None = None,
) -> BundlePlan | None:
    """Plan a bundle at ``num_tokens`` from a request's block table, or None if it lacks a page.

    ``state_end`` (default ``num_tokens``): the end of the step that wrote the recurrent state,
    drafts included; the state source is block ``(state_end - 1) // B`` of each recurrent group."""
    if num_tokens <= 0:
        return None
    state_end = num_tokens if state_end is None else state_end
    shared: list[tuple[BlockLike, ...]] = []
    sources: list[BlockLike | None] = []
    for geometry, blocks in zip(geometries, request_blocks, strict=True):
        planned = geometry.bundle_blocks(blocks, num_tokens, null_block, state_end)
        if planned is None:
            return None
        shared.append(planned[0])
        sources.append(planned[1])
    return BundlePlan(num_tokens, tuple(shared), tuple(sources))
