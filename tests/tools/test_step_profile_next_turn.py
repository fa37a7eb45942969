"""``benchmarks/step_profile.py --next-turn`` on the CPU engine with the tiny Qwen3-Next.

One run (``aligned`` then ``in_step``; 300-token prompts answered with 16 tokens, then resent with
40 more at batch 1 and 2, one round) and checks of what the timed calls were: next turns. Each row
of a plugin call restores its response boundary (300 + 16 - 1 = 315 tokens cached, 41 computed in
one step that captures the new prompt's end); each stock row its block grid (256 cached, 100
computed). A run whose timed calls were fresh prompts (the mode ignored) caches nothing and fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_profile.py"
PROMPT, ANSWER, FOLLOW_UP, BLOCK = 300, 16, 40, 256
BATCHES = (1, 2)
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def data(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("next_turn") / "profile.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--configs", "aligned,in_step",
           "--batch", ",".join(map(str, BATCHES)), "--repeat", "1", "--warmup", "0", "--prompt-len", str(PROMPT),
           "--answer", str(ANSWER), "--next-turn", str(FOLLOW_UP), "--out", str(out)]  # fmt: skip
    env = dict(os.environ)
    env.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("config, cached", [("in_step", PROMPT + ANSWER - 1), ("aligned", BLOCK)])
def test_every_timed_row_resumes_its_conversation(data, config, cached):
    assert data["settings"]["next_turn"] == FOLLOW_UP and data["settings"]["answer"] == ANSWER
    total = PROMPT + ANSWER + FOLLOW_UP
    for call in data["configs"][config]["calls"]:
        batch = call["batch"]
        assert call["cached_tokens"] == batch * cached, call
        steps = [s for s in call["steps"] if s["tokens"] > 0]
        assert [(s["tokens"], s["rows"]) for s in steps] == [(batch * (total - cached), batch)], steps
        assert all(s["carries_captures"] for s in steps) == (config == "in_step"), steps
