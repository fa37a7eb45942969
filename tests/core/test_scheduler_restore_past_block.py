"""A restored request's first chunk runs past the block its restore point is in (shadow runner).

vLLM stops a chunk that starts inside a block at that block's end. A next turn restored at the
previous answer's end ``N`` (inside a block) then took one more engine step than stock's next turn
from the block grid below ``N``, and under KV pressure that step's blocks took cached ones. The
plugin runs the first chunk on to vLLM's next stop (``core/chunk_stops.py``) and leaves the slot
that holds the restored state uncached. Checked: the next turn's prefill chunks end where
stock's do, vLLM's own stop at the prompt's last block boundary included; on GLM's layout (the
indexer's pool grid) and under speculative decoding the stop stays.
Negative control: with the plugin's chunk left to vLLM's split, the next turn runs one chunk more.
Exactness and the uncached slot on the real engine: ``tests/e2e/test_restore_past_block_cpu.py``.
"""

from __future__ import annotations

import random

import pytest
from shadow_scheduler import Driver, build_scheduler, make_request, tokens

BLOCK = 16


def next_turn_chunks(model_dir, policy: str, **kwargs) -> tuple[list[int], object, object]:
    """(the next turn's chunk ends, the scheduler, the next turn) for a 40-token prompt answered
    with 8 tokens, then a next turn of 50 more tokens (restored at 47, inside block 2; 98 tokens),
    prompt checkpoints at the prompt's end (no P - 1 stop)."""
    scheduler, worker = build_scheduler(model_dir, policy=policy, num_blocks=96, prompt_capture="end", **kwargs)
    driver = Driver(scheduler, worker)
    rng = random.Random(5)
    first = make_request(tokens(rng, 40), salt="a", max_tokens=8)
    driver.run([first])
    second = make_request(list(first.prompt_token_ids) + list(first.output_token_ids) + tokens(rng, 50), salt="a")
    scheduler.add_request(second)
    ends = []
    while second.num_computed_tokens < second.num_prompt_tokens:
        output = driver.step()
        if second.request_id in output.num_scheduled_tokens:
            ends.append(second.num_computed_tokens)
    driver.finish([second])
    return ends, scheduler, second


def test_a_restored_next_turn_runs_the_chunks_of_stock_s_next_turn(model_dir):
    stock, _, _ = next_turn_chunks(model_dir, "aligned")
    plugin, scheduler, second = next_turn_chunks(model_dir, "request_boundaries")
    assert scheduler.checkpoint_store.counters.hits == 1
    assert stock == [96, 98]  # from the block grid (32) to the prompt's last block boundary, then the rest
    assert plugin == [96, 98]  # from 47, past block 2's end (48)


def test_negative_control_with_vllm_s_split_the_restored_next_turn_runs_one_chunk_more(model_dir, monkeypatch):
    from boundary_checkpoints.core.chunk_stops import ChunkStopMixin

    monkeypatch.setattr(ChunkStopMixin, "_past_restore_block", lambda self, *args: None)
    plugin, scheduler, _ = next_turn_chunks(model_dir, "request_boundaries")
    assert scheduler.checkpoint_store.counters.hits == 1
    assert plugin == [48, 96, 98]


@pytest.mark.parametrize("layout", [{"ring_kpool": 16}, {"num_speculative_tokens": 1}])
def test_the_stop_at_the_block_end_stays_where_the_layout_needs_it(model_dir, layout):
    scheduler, _ = build_scheduler(model_dir, num_blocks=96, **layout)
    assert not scheduler._runs_restores_past_block
