"""End to end: per-request sampling features on a plugin server whose prefills stop at ``P - 1``.

The plugin ends every prompt's prefill one token early, so every request has at least one
partial-prefill step whose sampled row is discarded. These tests check each per-request feature
that could see that extra step (one CPU server with the plugin for the whole module):

* ``seed``: the discarded step's draw must not crash the engine (vLLM's V1 runner rewinds a CUDA
  generator's offset, which a CPU generator does not have) and must not advance the request's
  generator. Proof of "equal to an unsplit prefill": the resend of a prompt restores at ``P - 1``
  and computes the last prompt token in one step, so its prefill has no discarded step at all;
  the first send (split at ``P - 1``, plus block-grid chunks on the longer prompt) must give the
  same tokens. A fix that only skipped the rewind would leave the first send's generator one or
  more draws ahead and fail this.
"""

from __future__ import annotations

import random
import uuid

import pytest

from boundary_checkpoints.bench.client import complete
from boundary_checkpoints.bench.server import RunningServer, policy_config

pytestmark = pytest.mark.slow

BLOCK = 256  # the CPU engine's block for the tiny model (attention and recurrent groups)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server_features.log"
    with RunningServer(
        tiny_model_dir, log_path, additional_config=policy_config("request_boundaries"), timeout=300
    ) as running:
        yield running


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1024) for _ in range(n)]


def _salt() -> str:
    return uuid.uuid4().hex


@pytest.mark.parametrize("num_prompt_tokens", [100, 600], ids=["below-block", "above-block"])
def test_seeded_request_survives_split_and_matches_unsplit_resend(server, num_prompt_tokens):
    assert (num_prompt_tokens < BLOCK) == (num_prompt_tokens == 100)
    prompt = _prompt(num_prompt_tokens, seed=num_prompt_tokens)
    salt = _salt()
    seeded = dict(max_tokens=MAX_TOKENS, temperature=0.8, seed=5)

    first = complete(server.base_url, prompt, cache_salt=salt, **seeded)  # split at P - 1
    assert first.cached_tokens == 0
    assert len(first.token_ids) == MAX_TOKENS

    resend = complete(server.base_url, prompt, cache_salt=salt, **seeded)  # one step, no split
    assert resend.cached_tokens == num_prompt_tokens - 1
    assert resend.token_ids == first.token_ids

    # The seed decides the tokens: another seed on the same (cached) prompt gives other tokens,
    # so the equality above is not an accident of a peaked distribution.
    other_seed = complete(server.base_url, prompt, cache_salt=salt, **{**seeded, "seed": 6})
    assert other_seed.cached_tokens == num_prompt_tokens - 1
    assert other_seed.token_ids != first.token_ids

    # The engine is still alive and serves greedy requests.
    greedy = complete(server.base_url, prompt, cache_salt=salt, max_tokens=4)
    assert len(greedy.token_ids) == 4
