"""The graph-fit rule (``graph_fit_tokens``, ``core/graph_fit.py``) on the real CPU engine, through
``benchmarks/step_profile.py --next-turn``: eight conversations' next turns sent at once, each
restored at its response boundary with 21 tokens to compute (300-token prompts, 8-token answers,
20 new tokens; block 256).

With a ceiling of 100 tokens (the CPU runs no CUDA graphs, so ``auto`` is off and the test names
the ceiling) the 168 tokens start as two steps of 84 (four rows each: the four left over fit the
next step beside the first four's decode rows); with the rule off (``auto`` on a CPU, the negative
control) they share one step. Both restore every row at its boundary (cached tokens 8 x 307).
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
FIT = '{"policy": "request_boundaries", "prompt_capture": "in_step", "graph_fit_tokens": 100}'
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def calls(tiny_model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """Each configuration's calls (``in_step``: the plugin at its defaults; ``fit``: ceiling 100)."""
    out = tmp_path_factory.mktemp("graph_fit") / "profile.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--configs", "in_step",
           "--variant", f"fit={FIT}", "--batch", "8", "--repeat", "1", "--warmup", "0", "--prompt-len", "300",
           "--next-turn", "20", "--answer", "8", "--out", str(out)]  # fmt: skip
    env = dict(os.environ)
    env.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    data = json.loads(out.read_text())
    return {config: section["calls"] for config, section in data["configs"].items()}


def prefill_steps(call: dict) -> list[tuple[int, int]]:
    return [(step["tokens"], step["rows"]) for step in call["steps"] if step["tokens"] > 0]


def test_with_the_rule_off_the_eight_restored_next_turns_share_one_step(calls):
    assert calls["in_step"], "no calls measured"
    for call in calls["in_step"]:
        assert prefill_steps(call) == [(168, 8)]
        assert call["cached_tokens"] == 8 * 307


def test_past_the_ceiling_they_start_in_two_steps_that_fit_it(calls):
    assert calls["fit"], "no calls measured"
    for call in calls["fit"]:
        assert prefill_steps(call) == [(84, 4), (84, 4)]
        assert call["cached_tokens"] == 8 * 307
        assert call["output_tokens"] == 8
