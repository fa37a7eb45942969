"""Which prompts keep a checkpoint at their end: every one while such checkpoints are seen reused,
one in ``SAMPLE_EVERY`` otherwise (``prompt_admission: auto``).

Contract
--------
A prompt checkpoint costs its capture copies and private blocks (at Qwen3-Next-80B dims about 52 MB
a prompt) and pays only when a later request uses it: a resend or regenerate of the prompt, or a
next turn that repeats the prompt but not the answer (a chat template that drops the reasoning).
:class:`PromptAdmission` measures that use over the last ``WINDOW`` prompts (exponentially decayed
counts). A *reuse* is a restore of a prompt checkpoint, a prompt sent again, or a request that
the checkpoint of an earlier prompt would have served further than it was (every prompt's key is
remembered as a :class:`ReuseTracker` ghost, a bounded number of them, whether it kept a
checkpoint or not: one kept may be evicted since). For the first ``MIN_EVIDENCE`` prompts, and
while reuses are at least ``MIN_REUSE_RATE`` of prompts, every prompt is admitted; below that, one
in ``SAMPLE_EVERY``, and every prompt sent again (so a workload that turns to reuse is noticed at
its first reuses). Response and instruction checkpoints are not affected. It decides what is captured, never
what a restore reads: it cannot make an output wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from boundary_checkpoints.core.keys import CheckpointKey
from boundary_checkpoints.core.reuse import ReuseTracker

WINDOW = 64  # prompts the reuse rate is measured over (the decay's time constant)
MIN_EVIDENCE = 64  # prompts admitted before the rate is trusted
MIN_REUSE_RATE = 1 / 32  # reuses per prompt below which prompts are sampled
SAMPLE_EVERY = 16  # while sampling, one prompt in this many keeps its checkpoint


class PromptAdmission:
    def __init__(self, admit_all: bool = False) -> None:
        self.admit_all = admit_all
        self._seen = ReuseTracker()  # the prompts' keys, as ghosts
        self._prompts = 0.0
        self._reuses = 0.0
        self._count = 0

    def describe(self) -> str:
        """The rule, for the startup line."""
        if self.admit_all:
            return "every prompt (prompt_admission all)"
        return (
            f"every prompt while prompt checkpoints are seen reused (at least 1 in {round(1 / MIN_REUSE_RATE)} "
            f"of the last {WINDOW} prompts), else 1 in {SAMPLE_EVERY} and every resend"
        )

    def reuse_rate(self) -> float:
        """Reuses per prompt over the window (0 before any prompt)."""
        return self._reuses / self._prompts if self._prompts else 0.0

    def observe_reuse(self) -> None:
        self._reuses += 1

    def admit(self, key: CheckpointKey | None, resend: bool) -> bool:
        """Whether the prompt with checkpoint ``key`` at its end keeps one. ``resend``: a checkpoint
        at this prompt's end is kept or pending (a reuse). Called once per prompt."""
        decay = 1 - 1 / WINDOW
        self._prompts = self._prompts * decay + 1
        self._reuses *= decay
        self._count += 1
        if key is None:
            return True
        sent_again = self._seen.revisit(key) or resend
        self._seen.remember_evicted(key, self._seen.stamp())
        if sent_again:
            self.observe_reuse()
        return (
            sent_again
            or self.admit_all
            or self._count <= MIN_EVIDENCE
            or self.reuse_rate() >= MIN_REUSE_RATE
            or self._count % SAMPLE_EVERY == 0
        )

    def observe_lookup(
        self,
        tokens: Sequence[int],
        max_tokens: int,
        parents: Callable[[int], Hashable | None],
        hash_block_size: int,
        served_tokens: int,
        restored_prompt: bool,
    ) -> None:
        """A request's first lookup, which resumes after ``served_tokens`` of ``tokens``: a reuse when
        it restored a prompt checkpoint, or when an earlier prompt's checkpoint would have served it
        further (a prefix longer than ``served_tokens`` and at most ``max_tokens``)."""
        if restored_prompt or self._seen.regret(tokens, max_tokens, parents, hash_block_size, min_tokens=served_tokens):
            self.observe_reuse()
