"""End to end: per-request sampling features on a plugin server whose prefills stop at ``P - 1``.

With ``prompt_capture: stop`` (this module's server) the plugin ends every prompt's prefill one
token early, so every request has at least one partial-prefill step whose sampled row is
discarded. (In-step capture, the default, has no such step: a prompt then prefills as in stock
vLLM; the other server tests run it.) These tests check each per-request feature that could see
that extra step (one CPU server with the plugin for the whole module):

* ``seed``: the discarded step's draw must not crash the engine (vLLM's V1 runner rewinds a CUDA
  generator's offset, which a CPU generator does not have) and must not advance the request's
  generator. Proof of "equal to an unsplit prefill": the resend of a prompt restores at ``P - 1``
  and computes the last prompt token in one step, so its prefill has no discarded step at all;
  the first send (split at ``P - 1``, plus block-grid chunks on the longer prompt) must give the
  same tokens. A fix that only skipped the rewind would leave the first send's generator one or
  more draws ahead and fail this.
"""

from __future__ import annotations

import math

import pytest
from prompts import seeded_ids
from servers import BLOCK, cached_tokens, new_salt, server_fixture

from bc_tools.bench.client import complete, complete_json
from bc_tools.bench.server import policy_config

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
CONFIG = policy_config("request_boundaries")
CONFIG["boundary_checkpoints"]["prompt_capture"] = "stop"  # the partial-prefill step under test

server = server_fixture("server_features", additional_config=CONFIG)


def _three_sends(base_url: str, prompt: list[int], **kwargs):
    """First send (cold, split at P - 1), resend (restored at P - 1), same request under a cold salt."""
    salt = new_salt()
    first = complete(base_url, prompt, cache_salt=salt, **kwargs)
    resend = complete(base_url, prompt, cache_salt=salt, **kwargs)
    cold = complete(base_url, prompt, cache_salt=new_salt(), **kwargs)
    assert (first.cached_tokens, resend.cached_tokens, cold.cached_tokens) == (0, len(prompt) - 1, 0)
    return first, resend, cold


@pytest.mark.parametrize("num_prompt_tokens", [100, 600], ids=["below-block", "above-block"])
def test_seeded_request_survives_split_and_matches_unsplit_resend(server, num_prompt_tokens):
    assert (num_prompt_tokens < BLOCK) == (num_prompt_tokens == 100)
    prompt = seeded_ids(num_prompt_tokens, seed=num_prompt_tokens)
    salt = new_salt()
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


# ---- per-request features other than the seed ------------------------------------------------
# vLLM 0.32's V1 runner treats the P - 1 stop like any chunked prefill: a partial-prefill row gets
# no grammar bitmask (the scheduler sends one only for requests with ``not is_prefill_chunk``), its
# sampled token and logprobs are dropped, and request-level state (output tokens for min_tokens
# and penalties, grammar matchers) only advances on kept tokens. Each test below sends a request
# that uses one feature three times: cold (split at P - 1), resend (restored at P - 1, one
# step), and under a cold salt, and checks that the feature took effect on the first token.


def test_prompt_logprobs_all_values_and_never_restored(server):
    """prompt_logprobs requests skip reading the prefix cache (vLLM 0.32 sets
    ``skip_reading_prefix_cache`` for them; the plugin's lookup honours it), get every one of the
    P - 1 values across the P - 1 stop, and still leave a prompt checkpoint for plain requests."""
    num = 600
    prompt = seeded_ids(num, seed=31)
    salt = new_salt()
    kwargs = dict(max_tokens=4, prompt_logprobs=1, return_tokens_as_token_ids=True)
    first = complete_json(server.base_url, prompt, cache_salt=salt, **kwargs)
    again = complete_json(server.base_url, prompt, cache_salt=salt, **kwargs)
    assert cached_tokens(first) == 0 and cached_tokens(again) == 0  # never restored, not even at P - 1

    values = first["choices"][0]["prompt_logprobs"]
    assert len(values) == num and values[0] is None
    for position, entry in enumerate(values[1:], start=1):
        assert str(prompt[position]) in entry, position  # the prompt token itself is reported
    # Same request, same chunk layout: same values.
    assert again["choices"][0]["prompt_logprobs"] == values

    # The prompt_logprobs request still captured its P - 1 checkpoint: a plain resend restores it.
    plain = complete(server.base_url, prompt, cache_salt=salt, max_tokens=4)
    assert plain.cached_tokens == num - 1
    assert plain.token_ids == first["choices"][0]["token_ids"]

    # The P - 1 stop moves no value: the prompt with one more token stops at P instead (its
    # last chunk holds position P - 1), and its first P values agree up to bf16 noise.
    longer = complete_json(server.base_url, prompt + [prompt[0]], cache_salt=new_salt(), **kwargs)
    longer_values = longer["choices"][0]["prompt_logprobs"][:num]
    worst = 0.0
    for entry, other in zip(values[1:], longer_values[1:]):
        for key, logprob in entry.items():
            if key in other:
                worst = max(worst, abs(logprob["logprob"] - other[key]["logprob"]))
    assert worst < 0.1, worst


def test_first_token_logprobs(server):
    prompt = seeded_ids(300, seed=32)
    first, resend, cold = _three_sends(
        server.base_url, prompt, max_tokens=4, logprobs=5, return_tokens_as_token_ids=True
    )
    assert first.token_ids == resend.token_ids == cold.token_ids
    for completion in (first, resend, cold):
        assert len(completion.top_logprobs) == 4  # one entry per kept token, none for the split step
        assert completion.token_ids[0] in completion.top_logprobs[0]
        assert len(completion.top_logprobs[0]) >= 5
    assert first.top_logprobs == cold.top_logprobs  # same chunk layout
    for token, logprob in first.top_logprobs[0].items():  # restored: bf16 noise only
        assert math.isclose(logprob, resend.top_logprobs[0][token], abs_tol=0.05)


@pytest.mark.parametrize(
    "num_prompt_tokens, structured",
    [(100, {"choice": ["w100", "w200", "w300"]}), (300, {"regex": "w1[0-9][0-9]"})],
    ids=["choice-below-block", "regex-above-block"],
)
def test_structured_output_constrains_first_token(server, num_prompt_tokens, structured):
    """xgrammar over the tiny tokenizer's words ("w<id>"): the one guided token is the first one.

    (Other grammars, e.g. a repeated regex, or this choice on the 300-token prompt, end in
    "grammar rejected tokens [0]" on this random-weight model with stock retention too.)
    """
    prompt = seeded_ids(num_prompt_tokens, seed=33)
    allowed = range(100, 400) if "choice" in structured else range(100, 200)
    free = complete(server.base_url, prompt, max_tokens=2, cache_salt=new_salt())
    assert free.token_ids[0] not in allowed  # the grammar has something to do
    guided = dict(max_tokens=4, ignore_eos=False, structured_outputs=structured)
    first, resend, cold = _three_sends(server.base_url, prompt, **guided)
    assert first.token_ids[0] in allowed and first.finish_reason == "stop", first.token_ids
    assert first.token_ids == resend.token_ids == cold.token_ids


def test_min_tokens_holds_back_stop_token_on_first_token(server):
    prompt = seeded_ids(300, seed=34)
    plain = complete(server.base_url, prompt, max_tokens=8, cache_salt=new_salt())
    stop = dict(max_tokens=8, ignore_eos=False, stop_token_ids=[plain.token_ids[0]])
    stopped = complete(server.base_url, prompt, cache_salt=new_salt(), **stop)
    assert stopped.finish_reason == "stop" and stopped.completion_tokens == 1
    first, resend, cold = _three_sends(server.base_url, prompt, min_tokens=4, **stop)
    assert first.completion_tokens >= 4
    assert first.token_ids[0] != plain.token_ids[0]  # the stop token was masked on the first token
    assert first.token_ids == resend.token_ids == cold.token_ids


def test_logit_bias_min_p_and_penalties(server):
    prompt = seeded_ids(300, seed=35)
    biased = dict(max_tokens=4, logit_bias={"777": 100})
    first, resend, cold = _three_sends(server.base_url, prompt, **biased)
    assert first.token_ids == resend.token_ids == cold.token_ids == [777] * 4

    seeded_min_p = dict(max_tokens=12, temperature=1.0, min_p=0.05, seed=11)
    first, resend, cold = _three_sends(server.base_url, prompt, **seeded_min_p)
    assert first.token_ids == resend.token_ids == cold.token_ids

    penalties = dict(max_tokens=12, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5)
    unpenalized = complete(server.base_url, prompt, max_tokens=12, cache_salt=new_salt())
    first, resend, cold = _three_sends(server.base_url, prompt, **penalties)
    assert first.token_ids != unpenalized.token_ids  # the penalties change this greedy answer
    assert first.token_ids == resend.token_ids == cold.token_ids


def test_seeded_n2_children_match_resend(server):
    """n=2 with a seed: each child draws from its own generator (seed + index)."""
    prompt = seeded_ids(150, seed=36)
    salt = new_salt()
    kwargs = dict(max_tokens=8, temperature=0.8, seed=5, n=2)
    first = complete_json(server.base_url, prompt, cache_salt=salt, **kwargs)
    resend = complete_json(server.base_url, prompt, cache_salt=salt, **kwargs)
    assert cached_tokens(first) == 0 and cached_tokens(resend) > 0
    by_index = lambda payload: {c["index"]: c["token_ids"] for c in payload["choices"]}  # noqa: E731
    assert by_index(first) == by_index(resend)
    assert by_index(first)[0] != by_index(first)[1]
