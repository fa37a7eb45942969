"""End to end: chat instruction boundaries with the one documented flag, no ``VLLM_PLUGINS``.

The server starts with only ``--additional-config`` (the endpoint plugin is not loaded: its stats
route answers 404). The engine core learned the tiny model's template markers at startup, so
every chat request whose messages start with a system message gets the end of that block as its
instruction boundary: several conversations share a system prompt shorter than one 256-token
block, and every later conversation's first turn restores exactly its ``N`` tokens, where ``N``
is computed here by rendering the system message alone and checking it is a token prefix.
Negative control: ``chat_instruction_boundary: off`` on the same traffic caches nothing (stock
retention never hits below one block either)."""

from __future__ import annotations

import random
import urllib.error
import uuid

import pytest
from prompts import render_ids, words
from servers import BLOCK, first_turns, get_json, tiny_server

from boundary_checkpoints.frontend.plugin import STATS_PATH

pytestmark = pytest.mark.slow

CONVERSATIONS = 5


def chat_server(tiny_model_dir, tmp_path_factory, chat_instruction_boundary: str):
    section = {"policy": "request_boundaries", "chat_instruction_boundary": chat_instruction_boundary}
    return tiny_server(tiny_model_dir, tmp_path_factory, f"server_chat_instruction_{chat_instruction_boundary}",
                       additional_config={"boundary_checkpoints": section}, unset_env=("VLLM_PLUGINS",))  # fmt: skip


def test_chat_first_turns_restore_at_the_system_block_without_vllm_plugins(
    tiny_model_dir, tmp_path_factory, tiny_tokenizer
):
    rng = random.Random(33)
    system = words(rng, 97)
    users = [words(rng, 20 + i) for i in range(CONVERSATIONS)]
    # The expected N: the system message rendered alone, a token prefix of every full prompt.
    alone_text = tiny_tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    alone = tiny_tokenizer.encode(alone_text, add_special_tokens=False)
    for user in users:
        full = render_ids(tiny_tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": user}])
        assert full[: len(alone)] == alone and len(alone) < len(full)
    n = len(alone)
    assert 0 < n < BLOCK

    measured, logs = {}, {}
    for setting in ("auto", "off"):
        with chat_server(tiny_model_dir, tmp_path_factory, setting) as running:
            with pytest.raises(urllib.error.HTTPError, match="404"):
                get_json(running.base_url, STATS_PATH)  # the endpoint plugin is not loaded
            measured[setting] = [cached for _, cached in first_turns(running.base_url, system, users,
                                                                      f"{setting}-{uuid.uuid4().hex}")]  # fmt: skip
            logs[setting] = running.log_path.read_text()
    print(f"\nchat instruction boundary (N = {n}), first turns' cached tokens: {measured}")

    assert measured["auto"] == [0] + [n] * (CONVERSATIONS - 1)
    assert measured["off"] == [0] * CONVERSATIONS
    assert "chat instruction boundaries on (markers learned from the chat template" in logs["auto"]
    assert "chat instruction boundaries off: chat_instruction_boundary is off" in logs["off"]
