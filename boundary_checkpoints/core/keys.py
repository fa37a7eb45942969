"""Checkpoint keys: which exact token prefix a checkpoint resumes, and under which isolation domain.

Contract
--------
A checkpoint at ``N`` tokens lives in the hash block that holds token ``N - 1``: its *start* is
``floor((N - 1) / H) * H`` where ``H`` is the block pool's hash block size. The key is

* ``parent``: vLLM's chained block hash of the hash block that ends at ``start`` (it authenticates
  every token before ``start`` together with the cache salt and LoRA identity that vLLM folds into
  the first block), or, when ``start == 0``, the *root* discriminator ``("root", cache_salt, lora)``;
* ``tail``: the exact token ids ``[start, N)`` (at most ``H`` of them).

Two requests share a key only if they share the token prefix of length ``N`` and the isolation
domain (salt, LoRA). Lookups walk hash blocks from the deepest reachable one downwards, so the
first match is the longest.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointKey:
    parent: Hashable
    start: int
    tail: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.start + len(self.tail)


def root_discriminator(cache_salt: str | None, lora_id: int | str | None) -> tuple:
    """Isolation domain of keys whose prefix starts at token 0."""
    return ("root", cache_salt, lora_id)


def hash_block_start(num_tokens: int, hash_block_size: int) -> int:
    """First token of the hash block that holds token ``num_tokens - 1``."""
    if num_tokens <= 0:
        raise ValueError(f"a checkpoint needs at least one token, got {num_tokens}")
    return (num_tokens - 1) // hash_block_size * hash_block_size


def parent_of(start: int, block_hashes: Sequence[Hashable], hash_block_size: int, root: Hashable) -> Hashable | None:
    """The key parent for a tail beginning at ``start``; None if its hash block is not hashed yet."""
    if start == 0:
        return root
    index = start // hash_block_size - 1
    if index >= len(block_hashes):
        return None
    return block_hashes[index]


def make_key(
    tokens: Sequence[int],
    num_tokens: int,
    block_hashes: Sequence[Hashable],
    hash_block_size: int,
    root: Hashable,
) -> CheckpointKey | None:
    """Key of the prefix ``tokens[:num_tokens]``; None if the tokens or hashes do not reach it."""
    if num_tokens > len(tokens):
        return None
    start = hash_block_start(num_tokens, hash_block_size)
    parent = parent_of(start, block_hashes, hash_block_size, root)
    if parent is None:
        return None
    return CheckpointKey(parent, start, tuple(tokens[start:num_tokens]))
