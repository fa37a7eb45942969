"""End to end: the instruction boundary on the real OpenAI server (CPU engine, tiny Qwen3-Next).

Many conversations share one system prompt and differ after it. With the plugin's endpoint plugin
loaded (``VLLM_PLUGINS=boundary_checkpoints``), a chat request's leading system message is
rendered on its own; its token count goes to the engine as the instruction boundary, the first
conversation's prefill stops there and keeps a checkpoint, and every later conversation's FIRST
turn restores exactly there. Stock retention (``{"policy": "aligned"}``) on the same traffic
hits only on its 256-token block grid (or not at all below one block). ``/v1/completions`` takes
the boundary as ``vllm_xargs``; bad values are answered with HTTP 400 naming the field.
The endpoint plugin's entry point comes from the installed package metadata
(``scripts/install.sh`` reinstalls whenever pyproject.toml changes).
"""

from __future__ import annotations

import random
import uuid

import pytest
from prompts import words
from servers import BLOCK, first_turns, get_json, tiny_server

from bc_tools.bench.client import CompletionError, chat, complete
from bc_tools.bench.server import policy_config
from bc_tools.fixtures.tiny_models import FIRST_PLAIN_ID, VOCAB_SIZE
from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY, REQUEST_FIELD
from boundary_checkpoints.frontend.plugin import STATS_PATH

pytestmark = pytest.mark.slow

CONVERSATIONS = 16
SHORT_CONVERSATIONS = 8
# A template whose system block depends on later messages (it prints the message count in every
# block): the system-only rendering is not a prefix of the full prompt.
COUNTING_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} w{{ messages|length + 10 }} "
    "{{ message['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def plugin_env() -> dict[str, str]:
    """vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them (general plugins too)."""
    return {"VLLM_PLUGINS": "boundary_checkpoints"}


def server(tiny_model_dir, tmp_path_factory, env, policy: str, extra_args=()):
    return tiny_server(tiny_model_dir, tmp_path_factory, f"server_instruction_{policy}",
                       additional_config=policy_config(policy), env=env, extra_args=extra_args)  # fmt: skip


def test_chat_conversations_restore_at_the_shared_system_prompt(tiny_model_dir, tmp_path_factory, plugin_env):
    rng = random.Random(14)
    # The template renders "<s> system CONTENT </s> ": N_i = words + 3.
    long_system, short_system = words(rng, 297), words(rng, 97)
    long_users = [words(rng, 20 + i) for i in range(CONVERSATIONS)]
    short_users = [words(rng, 30 + i) for i in range(SHORT_CONVERSATIONS)]
    measured: dict[str, dict[str, list]] = {}
    for policy in ("request_boundaries", "aligned"):
        salt = f"{policy}-{uuid.uuid4().hex}"
        with server(tiny_model_dir, tmp_path_factory, plugin_env, policy) as running:
            measured[policy] = {
                "long": first_turns(running.base_url, long_system, long_users, salt),
                "short": first_turns(running.base_url, short_system, short_users, salt),
            }
            stats = get_json(running.base_url, STATS_PATH)
        assert stats.get("chat_boundary_set") == CONVERSATIONS + SHORT_CONVERSATIONS, stats
    print("\ninstruction boundary, first turns (prompt tokens, cached tokens):")
    for policy, runs in measured.items():
        for size, turns in runs.items():
            print(f"  {policy:18s} {size:5s} {[cached for _, cached in turns]}")

    plugin, stock = measured["request_boundaries"], measured["aligned"]
    for size, n_i in (("long", 300), ("short", 100)):
        assert [cached for _, cached in plugin[size]] == [0] + [n_i] * (len(plugin[size]) - 1)
        stock_cached = [cached for _, cached in stock[size]]
        assert all(cached % BLOCK == 0 and cached < n_i for cached in stock_cached), stock_cached
        if size == "short":
            assert stock_cached == [0] * len(stock_cached)  # below one block stock never hits


def test_completions_vllm_xargs_and_chat_templates(tiny_model_dir, tmp_path_factory, plugin_env):
    rng = random.Random(15)
    shared = [rng.randrange(FIRST_PLAIN_ID, VOCAB_SIZE) for _ in range(150)]
    salt = uuid.uuid4().hex

    def prompt(n_user: int) -> list[int]:
        return shared + [rng.randrange(FIRST_PLAIN_ID, VOCAB_SIZE) for _ in range(n_user)]

    extra_args = ["--trust-request-chat-template"]
    with server(tiny_model_dir, tmp_path_factory, plugin_env, "request_boundaries", extra_args) as running:
        url = running.base_url
        xargs = {"vllm_xargs": {INSTRUCTION_TOKENS_KEY: 150}}
        cached = [complete(url, prompt(40 + i), max_tokens=4, cache_salt=salt, **xargs).cached_tokens
                  for i in range(4)]  # fmt: skip
        assert cached == [0, 150, 150, 150]

        p = prompt(40)
        for bad in (0, -1, len(p), len(p) + 7, "150", 2.5, [150]):
            with pytest.raises(CompletionError) as err:
                complete(url, p, max_tokens=4, cache_salt=salt, vllm_xargs={INSTRUCTION_TOKENS_KEY: bad})
            assert "HTTP 400" in str(err.value) and REQUEST_FIELD in str(err.value), str(err.value)
        # A text prompt is validated against its own token count (3 or 4 tokens).
        with pytest.raises(CompletionError, match="HTTP 400"):
            complete(url, "w10 w11 w12", max_tokens=4, vllm_xargs={INSTRUCTION_TOKENS_KEY: 50})
        # Explicit values on chat are validated the same way.
        with pytest.raises(CompletionError, match=REQUEST_FIELD.replace(".", r"\.")):
            chat(url, [{"role": "user", "content": "w10 w11"}], max_tokens=4,
                 vllm_xargs={INSTRUCTION_TOKENS_KEY: 99})  # fmt: skip
        # The server keeps serving, and the checkpoint is still there.
        assert complete(url, prompt(33), max_tokens=4, cache_salt=salt, **xargs).cached_tokens == 150

        # A template whose system block depends on later messages: the frontend sets no boundary
        # (counted); the engine still finds the block's end from the template's markers ("<s> system
        # w12 ... </s>": 120 words + 4), and both two-message prompts share exactly those tokens.
        system = words(rng, 120)
        cached = []
        for user in (words(rng, 20), words(rng, 21)):
            out = chat(url, [{"role": "system", "content": system}, {"role": "user", "content": user}],
                       max_tokens=4, cache_salt=salt, chat_template=COUNTING_TEMPLATE)  # fmt: skip
            cached.append(out.cached_tokens)
        assert cached == [0, 124]
        # No system message, or nothing after it: nothing to do.
        chat(url, [{"role": "user", "content": words(rng, 10)}], max_tokens=4, cache_salt=salt)
        stats = get_json(url, STATS_PATH)
        assert stats.get("chat_skipped_not_a_prefix") == 2, stats
        assert stats.get("rejected_out_of_range", 0) >= 5 and stats.get("rejected_not_an_integer") == 3, stats
        assert "chat_boundary_set" not in stats, stats
