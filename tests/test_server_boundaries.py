"""End to end on the real OpenAI server (CPU engine, tiny Qwen3-Next): exact boundaries vs stock.

Eight conversations at once per server, prompt lengths around the engine's block (256 tokens on
the CPU engine). Each conversation sends: a cold producer, the exact resend, the continuation
(prompt + answer + new tokens) and a cold control of the continuation under a fresh
``cache_salt``. The plugin (``request_boundaries``) and stock (``aligned``) run in the same test
session on identical workloads. ``BC_RESULTS_DIR`` (if set) receives ``cpu-server-probes.json``.
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from boundary_checkpoints.bench.client import complete
from boundary_checkpoints.bench.probes import same_greedy_output
from boundary_checkpoints.bench.server import RunningServer, policy_config

pytestmark = pytest.mark.slow

BLOCK = 256  # the CPU engine's block size for the tiny model
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 77, 3 * BLOCK]
CONVERSATIONS = 8
MAX_TOKENS = 24
NEW_TOKENS = 40


def conversation(base_url: str, index: int, run: str) -> dict:
    rng = random.Random(index)
    prompt = [rng.randrange(4, 1024) for _ in range(LENGTHS[index % len(LENGTHS)])]
    send = lambda ids, salt: complete(  # noqa: E731
        base_url, ids, max_tokens=MAX_TOKENS, cache_salt=salt, logprobs=2, return_tokens_as_token_ids=True
    )
    producer = send(prompt, run)
    resend = send(prompt, run)
    continuation = prompt + producer.token_ids + [rng.randrange(4, 1024) for _ in range(NEW_TOKENS)]
    restored = send(continuation, run)
    cold = send(continuation, f"{run}-cold-{index}")
    verdict, detail = same_greedy_output(restored.token_ids, cold.token_ids, restored.top_logprobs, cold.top_logprobs)
    return {
        "prompt_len": len(prompt),
        "producer_cached": producer.cached_tokens,
        "resend_cached": resend.cached_tokens,
        "resend_same": resend.token_ids == producer.token_ids,
        "committed": len(prompt) + len(producer.token_ids) - 1,
        "continuation_cached": restored.cached_tokens,
        "continuation_vs_cold": verdict,
        "divergence": detail,
        "cold_cached": cold.cached_tokens,
    }


def run_policy(model_dir: Path, log_dir: Path, policy: str) -> list[dict]:
    with RunningServer(model_dir, log_dir / f"{policy}.log", additional_config=policy_config(policy), timeout=300) as server:
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            return list(pool.map(lambda i: conversation(server.base_url, i, f"run-{policy}"), range(CONVERSATIONS)))


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server_boundaries")
    out = {policy: run_policy(tiny_model_dir, log_dir, policy) for policy in ("request_boundaries", "aligned")}
    if os.environ.get("BC_RESULTS_DIR"):
        target = Path(os.environ["BC_RESULTS_DIR"])
        target.mkdir(parents=True, exist_ok=True)
        (target / "cpu-server-probes.json").write_text(json.dumps(out, indent=2))
    return out


def test_plugin_hits_every_boundary_exactly_with_cold_outputs(results):
    for row in results["request_boundaries"]:
        assert row["producer_cached"] == 0, row
        assert row["resend_cached"] >= row["prompt_len"] - 1, row
        assert row["resend_same"], row
        assert row["continuation_cached"] >= row["committed"], row
        assert row["continuation_vs_cold"] in ("identical", "tie"), row
        assert row["cold_cached"] == 0, row


def test_stock_stays_on_the_block_grid_in_the_same_run(results):
    for row in results["aligned"]:
        assert row["resend_cached"] % BLOCK == 0, row
        assert row["resend_cached"] <= (row["prompt_len"] - 1) // BLOCK * BLOCK, row
        assert row["continuation_cached"] % BLOCK == 0, row
        assert row["continuation_cached"] <= row["committed"], row
        assert row["cold_cached"] == 0, row
    plugin_total = sum(r["continuation_cached"] for r in results["request_boundaries"])
    stock_total = sum(r["continuation_cached"] for r in results["aligned"])
    assert plugin_total > stock_total
