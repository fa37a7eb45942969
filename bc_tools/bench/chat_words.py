"""Seeded text for chat messages of a given token length, shared by ``bc-demo`` and ``bc-bench``.

Contract (no I/O except ``tokenizer_words``, which reads one file):

- ``draw_words(rng, n, words)`` joins ``n`` words drawn uniformly (``rng.choice``) from ``words``
  with single spaces. The default ``TINY_WORDS`` is the tiny model's plain vocabulary
  ``w8`` .. ``w1023`` (ids 0..3 are special tokens, 4..7 the role words): on its word-level
  tokenizer every word is exactly one token. The draws equal ``rng.randrange(8, 1024)`` per word,
  so seeded text is the same as what ``bc-demo`` always drew.
- ``tokenizer_words(model_dir)`` reads ``tokenizer.json`` and returns words that render to one
  token each (after a space): a word-level vocabulary's plain words (not its added tokens nor the
  role words), or a BPE / SentencePiece vocabulary's space-prefixed lowercase ASCII words; None
  when there is no such file or too few such words (the caller then falls back to ``TINY_WORDS``,
  which a real tokenizer renders as about two tokens per word).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Sequence

FIRST_PLAIN_WORD_ID, TINY_VOCAB_SIZE = 8, 1024  # tiny tokenizer: 0..3 special, 4..7 role words
TINY_WORDS: tuple[str, ...] = tuple(f"w{i}" for i in range(FIRST_PLAIN_WORD_ID, TINY_VOCAB_SIZE))
ROLE_WORDS = frozenset({"system", "user", "assistant", "tool"})
MIN_WORDS = 100  # fewer single-token words than this: not worth drawing from
SPACE_MARKERS = ("\u0120", "\u2581")  # byte-level BPE's "Ġ", SentencePiece's "▁"
PLAIN_WORD = re.compile(r"^[a-z]{3,10}$")


def draw_words(rng: random.Random, n: int, words: Sequence[str] = TINY_WORDS) -> str:
    """``n`` words drawn from ``words``, joined by single spaces ('' for n = 0)."""
    return " ".join(rng.choice(words) for _ in range(n))


def tokenizer_words(model_dir: str | Path | None) -> tuple[str, ...] | None:
    """Words of ``model_dir``'s ``tokenizer.json`` that render to one token each (see the module
    docstring), sorted by token id; None without such a file or with fewer than ``MIN_WORDS``."""
    if model_dir is None:
        return None
    try:
        spec = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        model = spec.get("model") or {}
        vocab = model.get("vocab")
        if not isinstance(vocab, dict):  # Unigram: a list of (piece, score)
            vocab = {piece: i for i, (piece, _score) in enumerate(vocab or [])}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    added = {t.get("content") for t in spec.get("added_tokens") or []}
    words: list[tuple[int, str]] = []
    for token, token_id in vocab.items():
        if token in added:
            continue
        if model.get("type") == "WordLevel":
            if token not in ROLE_WORDS and token.strip() == token and token:
                words.append((token_id, token))
        elif token[:1] in SPACE_MARKERS and PLAIN_WORD.match(token[1:]):
            words.append((token_id, token[1:]))
    if len(words) < MIN_WORDS:
        return None
    return tuple(word for _, word in sorted(words))
