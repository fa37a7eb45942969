"""End to end: a real vLLM OpenAI server (CPU engine) on the tiny Qwen3-Next with the plugin.

One server per module (startup dominates: 20-45 s on a 2-core machine). Token-ID prompts, greedy,
``ignore_eos``, ``return_token_ids`` and ``cache_salt`` through ``/v1/completions``.
"""

from __future__ import annotations

import pytest
from prompts import seeded_ids
from servers import resend_config, server_fixture

from bc_tools.bench.client import complete, stream_complete

pytestmark = pytest.mark.slow

POLICY = "request_boundaries"  # the plugin's server; test_server_boundaries.py compares with stock
MAX_TOKENS = 16

server = server_fixture(f"server_{POLICY}", additional_config=resend_config(POLICY))


def test_token_prompt_cached_tokens_and_salt_isolation(server):
    prompt = seeded_ids(600, seed=1234)
    first = complete(server.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt="salt-a")
    assert first.prompt_tokens == 600
    assert len(first.token_ids) == MAX_TOKENS
    assert all(isinstance(t, int) and 0 <= t < 1024 for t in first.token_ids)
    assert first.cached_tokens == 0

    resend = complete(server.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt="salt-a")
    assert resend.cached_tokens == 599  # the prompt boundary P - 1, exactly
    assert resend.token_ids == first.token_ids

    other_salt = complete(server.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt="salt-b")
    assert other_salt.cached_tokens == 0
    assert other_salt.token_ids == first.token_ids


def test_streaming_reports_usage_ttft_and_same_tokens(server):
    prompt = seeded_ids(300, seed=99)
    plain = complete(server.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt="stream-a")
    streamed = stream_complete(server.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt="stream-b")
    assert streamed.token_ids == plain.token_ids
    assert streamed.prompt_tokens == 300
    assert streamed.cached_tokens == 0  # different salt: no hit
    assert streamed.ttft_s is not None and 0 < streamed.ttft_s <= streamed.latency_s
