"""Prompt admission (``core/admission.py``): which prompts keep a checkpoint at their end."""

from __future__ import annotations

from boundary_checkpoints.core.admission import MIN_EVIDENCE, SAMPLE_EVERY, PromptAdmission
from boundary_checkpoints.core.keys import CheckpointKey
from boundary_checkpoints.core.reuse import ReuseTracker

ROOT = ("root", None, None)
HASH_BLOCK = 16


def prompt_key(i: int) -> CheckpointKey:
    """A 10-token prompt of its own (under the root: no full hash block)."""
    return CheckpointKey(ROOT, 0, (i, i + 1, i + 2, 7, 7, 7, 7, 7, 7, 7))


def parents(start: int):
    return ROOT if start == 0 else None


def admit_fresh(admission: PromptAdmission, first: int, count: int) -> list[bool]:
    return [admission.admit(prompt_key(1000 + i), resend=False) for i in range(first, first + count)]


def test_every_prompt_under_all():
    assert all(admit_fresh(PromptAdmission(admit_all=True), 0, 4 * MIN_EVIDENCE))


def test_fresh_prompts_are_sampled_after_the_evidence():
    admission = PromptAdmission()
    assert all(admit_fresh(admission, 0, MIN_EVIDENCE))
    later = admit_fresh(admission, MIN_EVIDENCE, 10 * SAMPLE_EVERY)
    assert sum(later) == 10  # one in SAMPLE_EVERY
    assert admission.reuse_rate() == 0


def test_reused_prompts_keep_every_checkpoint():
    admission = PromptAdmission()
    decisions = []
    for i in range(4 * MIN_EVIDENCE):
        decisions.append(admission.admit(prompt_key(1000 + i), resend=False))
        if i % 8 == 0:
            admission.observe_reuse()  # one prompt in 8 is used again
    assert all(decisions)


def test_a_resend_is_admitted_and_counts_as_a_reuse():
    admission = PromptAdmission()
    admit_fresh(admission, 0, MIN_EVIDENCE + 1)
    assert admission.admit(prompt_key(5), resend=True)
    assert admission.reuse_rate() > 0


def test_a_skipped_prompt_sent_again_is_admitted():
    admission = PromptAdmission()
    decisions = admit_fresh(admission, 0, MIN_EVIDENCE + 2)
    assert decisions[-1] is False  # skipped: its key is remembered
    skipped = prompt_key(1000 + MIN_EVIDENCE + 1)
    assert admission.admit(skipped, resend=False)
    assert admission.reuse_rate() > 0
    # control: a prompt never seen is still sampled out
    assert not admission.admit(prompt_key(5000), resend=False)


def test_a_lookup_a_skipped_prompt_would_have_served_further_is_a_reuse():
    admission = PromptAdmission()
    admit_fresh(admission, 0, MIN_EVIDENCE + 2)
    skipped = prompt_key(1000 + MIN_EVIDENCE + 1)
    next_turn = list(skipped.tail) + [3, 4, 5]
    # control: served as far as the skipped prompt reached (or further): no reuse
    admission.observe_lookup(next_turn, len(next_turn) - 1, parents, HASH_BLOCK, len(skipped.tail), False)
    assert admission.reuse_rate() == 0
    admission.observe_lookup(next_turn, len(next_turn) - 1, parents, HASH_BLOCK, 0, False)
    assert admission.reuse_rate() > 0


def test_a_restored_prompt_checkpoint_is_a_reuse():
    admission = PromptAdmission()
    admit_fresh(admission, 0, 4)
    admission.observe_lookup([1, 2, 3], 2, parents, HASH_BLOCK, 2, restored_prompt=True)
    assert admission.reuse_rate() > 0


def test_regret_ignores_ghosts_no_longer_than_what_was_served():
    tracker = ReuseTracker()
    key = prompt_key(1)
    tracker.remember_evicted(key, tracker.stamp())
    tokens = list(key.tail) + [9, 9]
    assert not tracker.regret(tokens, len(tokens), parents, HASH_BLOCK, min_tokens=len(key.tail))
    assert tracker.regret(tokens, len(tokens), parents, HASH_BLOCK, min_tokens=len(key.tail) - 1)
