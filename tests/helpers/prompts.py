"""Prompts for the tiny model's word-level vocabulary (``fixtures.tiny_models``: ids below
``FIRST_PLAIN_ID`` are the specials and role words, ids ``FIRST_PLAIN_ID``..``VOCAB_SIZE - 1`` the
words ``w8``..``w1023``), their chat rendering, and token-list comparisons, for every test that
builds prompts (server, engine and scheduler tests alike)."""

from __future__ import annotations

import random

from bc_tools.fixtures.tiny_models import FIRST_PLAIN_ID, VOCAB_SIZE


def token_ids(rng: random.Random, n: int, low: int = 4) -> list[int]:
    """``n`` token ids drawn from ``rng`` in ``[low, VOCAB_SIZE)`` (by default any id past the
    four special tokens, role words included)."""
    return [rng.randrange(low, VOCAB_SIZE) for _ in range(n)]


def seeded_ids(n: int, seed: int) -> list[int]:
    """:func:`token_ids` of a fresh ``random.Random(seed)``: the same prompt for the same seed."""
    return token_ids(random.Random(seed), n)


def word_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` ids of plain words only (no special token, no role word)."""
    return token_ids(rng, n, low=FIRST_PLAIN_ID)


def words(rng: random.Random, n: int) -> str:
    """``n`` plain words as text (``"w17 w503 ..."``): one token each for the tiny tokenizer."""
    return " ".join(f"w{t}" for t in word_ids(rng, n))


def render_ids(tokenizer, messages: list[dict], template: str | None = None) -> list[int]:
    """The prompt ids a server renders for ``messages`` (template text, then tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
    return tokenizer.encode(text, add_special_tokens=False)


def common_prefix(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
