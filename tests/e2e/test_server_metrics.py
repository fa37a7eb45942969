"""End to end: the plugin's Prometheus series on a real vLLM OpenAI server's ``/metrics`` (CPU
engine, tiny Qwen3-Next): a prompt, its resend (prompt-kind hit), a continuation (response-kind
hit) and an unrelated prompt (no_checkpoint miss), then exact counter values for this model.
The stat-logger entry point comes from the installed package metadata (``scripts/install.sh``
reinstalls whenever pyproject.toml changes).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from prompts import token_ids
from servers import resend_config, server_fixture

from bc_tools.bench.client import complete

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-metrics"
MAX_TOKENS = 16

server = server_fixture("server_metrics", additional_config=resend_config("request_boundaries"),
                        served_model_name=MODEL_NAME)  # fmt: skip


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(metrics, name: str, **labels) -> float | None:
    labels = {"model_name": MODEL_NAME, "engine": "0", **labels}
    return metrics.get((name, tuple(sorted(labels.items()))))


def test_metrics_count_hits_by_kind_misses_by_reason_and_restored_tokens(server):
    rng = random.Random(7)
    prompt = token_ids(rng, 600)
    args = {"max_tokens": MAX_TOKENS, "cache_salt": "metrics", "model": MODEL_NAME}
    first = complete(server.base_url, prompt, **args)  # no_checkpoint miss: nothing retained yet
    resend = complete(server.base_url, prompt, **args)  # prompt-kind hit at P - 1
    continuation = complete(server.base_url, prompt + first.token_ids + token_ids(rng, 40), **args)  # response kind
    unrelated = complete(
        server.base_url, token_ids(random.Random(8), 500), max_tokens=MAX_TOKENS, cache_salt="other", model=MODEL_NAME
    )
    responses = [first, resend, continuation, unrelated]
    assert resend.cached_tokens == 599
    assert continuation.cached_tokens == 600 + MAX_TOKENS - 1
    assert first.cached_tokens == 0 and unrelated.cached_tokens == 0

    hits = "vllm:boundary_checkpoint_hits_total"
    misses = "vllm:boundary_checkpoint_misses_total"
    deadline = time.monotonic() + 30
    while True:  # the frontend records a step's stats right after handing out its outputs
        metrics = scrape(server.base_url)
        counted = [value(metrics, hits, kind=k) for k in ("prompt", "response")]
        counted += [value(metrics, misses, reason="no_checkpoint")]
        if sum(v or 0 for v in counted) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    assert value(metrics, hits, kind="prompt") == 1
    assert value(metrics, hits, kind="response") == 1
    assert value(metrics, misses, reason="no_checkpoint") == 2
    for reason in ("diverged", "block_grid_as_long", "ineligible", "cache_bypassed"):
        assert value(metrics, misses, reason=reason) == 0, reason
    restored = value(metrics, "vllm:boundary_checkpoint_restored_tokens_total")
    assert restored == sum(r.cached_tokens for r in responses) == 599 + 615
    # The capture-copy histogram is served; behind vLLM's multiprocess executor (the CPU server)
    # the worker's timers stay in its own process, so it counts nothing here.
    assert value(metrics, "vllm:boundary_checkpoint_capture_copy_seconds_count") == 0
    for gauge in ("vllm:boundary_checkpoints_retained", "vllm:boundary_checkpoint_retained_blocks",
                  "vllm:boundary_checkpoint_retained_bytes"):  # fmt: skip
        assert value(metrics, gauge) > 0, gauge
    assert value(metrics, "vllm:boundary_checkpoint_captures_published_total") > 0
    assert value(metrics, "vllm:boundary_checkpoint_capture_copies_total") > 0
    assert value(metrics, "vllm:boundary_checkpoint_capture_copy_bytes_total") > 0
    for cause in ("budget", "pressure"):
        assert value(metrics, "vllm:boundary_checkpoint_evictions_total", cause=cause) == 0
    assert value(metrics, "vllm:boundary_checkpoint_responses_aborted_total") == 0
    # vLLM's own series for the same model are still there, next to the plugin's.
    assert value(metrics, "vllm:prefix_cache_queries_total") is not None
    # The payload never reached vLLM's logging stat logger (it would log a "KV fetch" part).
    assert "KV fetch" not in Path(server.log_path).read_text()
