"""``benchmarks/scheduler_step_overhead.py --next-turns`` on the shadow runner: the steps it times
are next turns that restore (the plugin: each response boundary; stock: its block grid)."""

from __future__ import annotations

import pytest
from script_modules import load_script

RUNNING, PROMPT, ANSWER, USER, BLOCK = 2, 600, 16, 40, 256


@pytest.mark.parametrize("policy, cached_each", [("request_boundaries", PROMPT + ANSWER - 1), ("aligned", 512)])
def test_next_turn_steps_start_restored_next_turns(tmp_path, policy, cached_each):
    module = load_script("benchmarks/scheduler_step_overhead.py", "scheduler_step_overhead_under_test")
    model_dir = module.write_model_dir(tmp_path / "model")
    us, cached = module.next_turn_step_us(model_dir, policy, RUNNING, PROMPT, ANSWER, USER, BLOCK, seed=0)
    assert us > 0 and cached == RUNNING * cached_each
