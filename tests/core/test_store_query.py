"""``CheckpointStore.query`` (pure, no engine): one scan of a request's tails answers the hit, the
next-token guard's refusal and the reason for a miss; the miss is classified (and a regret
recorded) only when asked and when no refusal longer than vLLM's own hit explains it."""

from __future__ import annotations

import pytest

import boundary_checkpoints.core.store as store_module
from boundary_checkpoints.core.checkpoint import Checkpoint
from boundary_checkpoints.core.keys import CheckpointKey
from boundary_checkpoints.core.kinds import MissReason
from boundary_checkpoints.core.store import CheckpointStore

H = 4  # hash block size
ROOT = ("root", None, None)
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]  # a request of 8 tokens: lookups reach at most 7


def parents(start: int):
    return {0: ROOT, 4: "hash-of-block-0"}.get(start)


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.is_null = False


def bundle(start: int, tail: tuple[int, ...], block_id: int, next_token: int | None = None) -> Checkpoint:
    key = CheckpointKey(parents(start), start, tail)
    return Checkpoint(key, "prompt", ((Block(block_id),),), producer=f"p{block_id}", next_token=next_token)


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """Counts the store's scans of a request's tails."""
    calls: list[int] = []
    scan = store_module.scan

    def counting_scan(*args, **kwargs):
        calls.append(1)
        return scan(*args, **kwargs)

    monkeypatch.setattr(store_module, "scan", counting_scan)
    return calls


def query(store: CheckpointStore, **kwargs):
    kwargs.setdefault("with_refusal", True)
    kwargs.setdefault("classify_miss", True)
    return store.query(TOKENS, len(TOKENS) - 1, parents, H, **kwargs)


@pytest.mark.parametrize("same_block", [False, True])
def test_one_scan_finds_the_shorter_hit_and_the_longer_refused_bundle(scans, same_block):
    """The longest bundle (6 tokens) holds the prefix but its draft row was computed from token 99,
    not 7: the hit is the shorter serving bundle, in a lower hash block or in the same one, and
    the refusal is the longer one, from the one scan. The hit, not the refusal, becomes the most
    recently used."""
    store = CheckpointStore(release=lambda blocks: None, max_blocks=8)
    shorter = bundle(4, (5,), 1) if same_block else bundle(0, (1, 2, 3), 1)
    refused = bundle(4, (5, 6), 2, next_token=99)
    other = bundle(0, (1, 2), 3)
    for ckpt in (shorter, refused, other):
        assert store.publish(ckpt)
    answer = query(store)
    assert (answer.hit, answer.refused, answer.miss_reason) == (shorter, refused, None)
    assert len(scans) == 1
    assert list(store.policy.in_order())[-1] is shorter
    assert query(store, with_refusal=False).refused is None


def test_a_serving_longest_bundle_is_no_refusal(scans):
    store = CheckpointStore(release=lambda blocks: None, max_blocks=8)
    longest = bundle(4, (5, 6), 1, next_token=7)
    assert store.publish(bundle(0, (1, 2, 3), 2)) and store.publish(longest)
    answer = query(store)
    assert (answer.hit, answer.refused, answer.miss_reason) == (longest, None, None)
    assert len(scans) == 1


def test_a_miss_is_classified_only_when_asked_and_a_refusal_longer_than_the_stock_hit_explains_it(scans):
    """No bundle serves the request: the 6-token bundle is refused by the guard, and a ghost (an
    evicted bundle that would have served) is remembered. A refusal longer than vLLM's hit is the
    reason by itself (no regret is recorded, the ghost stays); one no longer than it leaves the
    classification to the store, which finds the regret first (and forgets the ghost); without
    ``classify_miss`` nothing is classified and the ghost stays."""
    store = CheckpointStore(release=lambda blocks: None, max_blocks=8)
    refused = bundle(4, (5, 6), 1, next_token=99)
    assert store.publish(refused)
    store.reuse.remember_evicted(CheckpointKey(ROOT, 0, (1, 2, 3)), published_at=0)

    assert query(store, classify_miss=False) == store_module.StoreAnswer(None, refused, None)
    answer = query(store, stock_hit=4)
    assert (answer.hit, answer.refused, answer.miss_reason) == (None, refused, MissReason.DRAFT_NEXT_TOKEN)
    assert store.reuse.reuse_distance() is None  # no regret recorded yet
    assert query(store, stock_hit=6).miss_reason == MissReason.EVICTED
    assert store.reuse.reuse_distance() is not None
    assert query(store, stock_hit=6).miss_reason == MissReason.DRAFT_NEXT_TOKEN  # the ghost is gone
    assert query(store, with_refusal=False, stock_hit=6).miss_reason == MissReason.DRAFT_NEXT_TOKEN
    assert len(scans) == 5


@pytest.mark.parametrize(
    ("tail", "reason"),
    [((1, 2, 3, 9), MissReason.DIVERGED), ((9,), MissReason.NO_CHECKPOINT)],
)
def test_miss_reasons_without_a_refusal(tail, reason):
    store = CheckpointStore(release=lambda blocks: None, max_blocks=8)
    assert store.publish(bundle(0, tail, 1))
    assert query(store).miss_reason == reason
    assert store.query(TOKENS, 0, parents, H, with_refusal=True, classify_miss=True).miss_reason == (
        MissReason.NO_CHECKPOINT
    )


def test_a_miss_the_row_rule_caused_is_a_short_row():
    """Contract 13 lowers the lookup's limit to leave a prefill row longer than a verify row: a
    bundle that would serve the request within the limit before the rule (7 tokens) but lies past
    the lowered one (5) is a ``short_row`` miss, if it is longer than vLLM's own hit; otherwise the
    store's own classification stands. The second scan runs on such misses only."""
    store = CheckpointStore(release=lambda blocks: None, max_blocks=8)
    assert store.publish(bundle(4, (5, 6), 1))  # serves the request's first 6 tokens

    def reason(**kwargs):
        return store.query(TOKENS, 5, parents, H, with_refusal=True, classify_miss=True, **kwargs).miss_reason

    assert reason(without_row_rule=7) == MissReason.SHORT_ROW
    assert reason(without_row_rule=7, stock_hit=6) == MissReason.DIVERGED  # vLLM's hit is as long
    assert reason(without_row_rule=5) == reason() == MissReason.DIVERGED  # no rule, no second scan
    assert store.query(TOKENS, 7, parents, H, with_refusal=True, classify_miss=True, without_row_rule=7).hit
