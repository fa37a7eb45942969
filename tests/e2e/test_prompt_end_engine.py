"""``prompt_capture: end`` without speculative decoding on the real CPU engine (tiny Qwen3-Next):
the scenario and judgement that the GPU runs on the families whose ``auto`` takes the checkpoint at
``P`` (``tests/gpu/test_gpu_spec_prompt_end.py``), here where a CPU can run it, so that the
shared script (``tests/helpers/spec_prompt_end.py`` at ``K`` = 0) is checked on every commit.

Checked: fresh prompts take no stop; an extension of a prompt restores exactly ``P`` within the
bound calibrated in the same run, and so does one with another token at ``P`` (no next-token guard
without MTP); the first resend is captured at ``P - 1`` inside its step (the CPU kernels' split)
and the second restores there. Negative control: each checkpoint at ``P`` keyed ``P - 1``.
"""

from __future__ import annotations

import json

import pytest
import spec_prompt_end
from engine_script import engine_fixture
from results_out import save_json

pytestmark = pytest.mark.slow

LENGTHS = (23, 40, 61, 97, 130, 300)  # off the 256-token block grid
MAX_TOKENS = 6
CPU_ENGINE = {"enforce_eager": True, "distributed_executor_backend": "uni"}


def _end_result(info: dict, rows: dict):
    save_json("cpu-prompt-end-engine.json", info)
    return spec_prompt_end.end_result(info, LENGTHS, reference_floor=0.0)


end_runs = engine_fixture(
    spec_prompt_end.SCRIPT, "0", str(MAX_TOKENS), json.dumps(LENGTHS), str(spec_prompt_end.tail_tokens(0)),
    json.dumps(CPU_ENGINE), runs=(), then=_end_result, name="end_runs",
)  # fmt: skip


def test_the_checkpoint_at_p_restores_exactly_without_speculative_decoding(end_runs):
    info, phases, bounds = end_runs
    assert info["scheduler"] == "BoundaryScheduler"
    print("bounds:", bounds)
    spec_prompt_end.check_end_run(info, phases, bounds, LENGTHS, next_token_guard=False, resend_mode="in_step")


def test_a_prompt_checkpoint_keyed_one_token_short_fails_the_bound(end_runs):
    info, _, bounds = end_runs
    caught, corrupted = spec_prompt_end.check_corrupted_prompts(info, bounds, LENGTHS)
    assert corrupted and len(caught) >= len(corrupted) - 1, (caught, corrupted, bounds)
