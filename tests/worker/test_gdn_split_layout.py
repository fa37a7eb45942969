"""The in-step split's per-step layout (``worker/gdn_split.step_splits``), on host tensors.

The KV groups of a step describe one batch, each with its own state indices: the split reads all
their row layouts at once and computes one :class:`RowLayout` for the groups whose capture rows
are the same rows, so that the step pays one device read and one layout instead of one per group
(a GPU profile puts 3 of them per capture step at about 3.7 ms each). Each group
still gets its own state indices and destinations, and a group whose capture rows differ gets its
own layout: the splits equal those computed one group at a time.
"""

from __future__ import annotations

import pytest
import torch
from gdn_shadow import _metadata

from boundary_checkpoints.worker.gdn_split import step_splits

ROWS = [(1, True), (5, False), (7, False), (3, True), (70, True)]  # one decode row first
NUM_DECODES = 1


def group(first_slot: int):
    """One KV group's metadata of the batch ``ROWS`` on state blocks ``first_slot, first_slot + 1, ...``."""
    return _metadata(ROWS, NUM_DECODES, [first_slot + i for i in range(len(ROWS))], "cpu", cuda=False, padding=1)


def assert_same_split(got, want) -> None:
    for name in ("order", "slots", "destinations"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.slot_ids == want.slot_ids and got.num_kept == want.num_kept
    for name in ("without_last", "last_tokens"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.num_actual_tokens == b.num_actual_tokens and a.num_prefill_tokens == b.num_prefill_tokens
        assert torch.equal(a.non_spec_query_start_loc, b.non_spec_query_start_loc), name
        assert torch.equal(a.non_spec_state_indices_tensor, b.non_spec_state_indices_tensor), name


def test_groups_with_the_same_capture_rows_share_one_layout_and_keep_their_own_blocks():
    first, second = group(10), group(40)
    pairs = {12: 100, 14: 101, 42: 200, 44: 201}  # rows 2 and 4 capture in both groups
    a, b = step_splits([first, second], pairs, rebuild_kernel_metadata=False)
    assert a.order is b.order  # one layout
    assert a.slot_ids == (12, 14) and b.slot_ids == (42, 44)
    assert a.destinations.tolist() == [100, 101] and b.destinations.tolist() == [200, 201]
    assert a.last_tokens.non_spec_state_indices_tensor.tolist() == [12, 14]
    assert a.order[a.num_kept :].tolist() == [12, 85]  # last tokens of rows 2 (6..12) and 4 (16..85)
    assert a.num_kept == 86 - 2 and a.order[: a.num_kept].tolist() == [t for t in range(86) if t not in (12, 85)]
    assert a.without_last.non_spec_query_start_loc.tolist() == [0, 1, 6, 12, 15, 84, 84]
    assert_same_split(a, step_splits([first], pairs, False)[0])
    assert_same_split(b, step_splits([second], pairs, False)[0])


def test_a_group_with_other_capture_rows_gets_its_own_layout():
    first, second, third = group(10), group(40), group(70)
    pairs = {12: 100, 42: 200, 73: 300}  # row 2 in the first two groups, row 3 in the third
    a, b, c = step_splits([first, second, third], pairs, rebuild_kernel_metadata=False)
    assert a.order is b.order and c.order is not a.order
    assert c.order[c.num_kept :].tolist() == [15]  # row 3: tokens 13..15
    assert_same_split(c, step_splits([third], pairs, False)[0])
    assert step_splits([group(500)], pairs, False) == [None]  # no capture row in that group


def test_a_one_token_capture_row_is_refused():
    batch = _metadata([(1, True), (1, False), (4, False)], 1, [10, 11, 12], "cpu", cuda=False)
    with pytest.raises(RuntimeError, match="fewer than two tokens"):
        step_splits([batch], {11: 99}, rebuild_kernel_metadata=False)


def test_the_cuda_cores_chunk_metadata_follows_the_shortened_rows():
    """A 65-token capture row is one FLA chunk (64 tokens) in call 1, not the two it was."""
    batch = _metadata([(1, True), (5, False), (65, True)], 1, [10, 11, 12], "cpu", cuda=False)
    split = step_splits([batch], {12: 99}, rebuild_kernel_metadata=True)[0]
    assert split.without_last.prefill_query_start_loc.tolist() == [0, 5, 69]
    assert split.without_last.chunk_offsets.tolist() == [0, 1, 2]  # 1 + 1 chunks (unsplit: 1 + 2)
    assert split.without_last.chunk_indices.tolist() == [[0, 0], [1, 0]]
