"""The acceptance check the MTP end-to-end tests share (CPU engine: ``test_spec_decode_cpu.py``,
GPU host: ``test_gpu_families_mtp.py``), on the ``qwen3_next_mtp_planted`` fixture, whose MTP
layer predicts the target's greedy answers (``fixtures/qwen3_next_family.py``; ~0.7 of drafts accepted at
``k = 1``); and the plugin's own account of continuations that could not restore their producer's
response bundle (:func:`unserved_responses`, also used by ``test_scheduler_spec.py``)."""

from __future__ import annotations

import math

# Acceptance may differ, restored vs cold, by this many standard errors of the difference.
NOISE_SIGMAS = 3.0
# Least accepted drafts per drafting step, as a share of k, restored and cold alike: the drafter
# works. The planted fixture measured 0.6-0.9 per phase at k = 1 on the CPU engine;
# at k = 3 a draft counts only after every earlier one was accepted (~0.5 expected).
MIN_ACCEPTED_SHARE = 0.3


# Counters (``boundary_stats``) of lookups that restored less than a response bundle, or of
# responses that kept none, under MTP: a next turn whose token ``N`` is not the one the bundle's
# draft row was computed from (the next-token guard) restores a shorter checkpoint (a fallback,
# usually the prompt's at ``P - 1``) or none (a miss: a prompt of one token keeps no prompt
# checkpoint); an answer trimmed with a step in flight keeps no response bundle at all.
UNSERVED_COUNTERS = ("draft_next_token_fallbacks", "miss_draft_next_token", "responses_spec_in_flight")


def unserved_responses(stats: dict) -> int:
    """How many lookups or responses the plugin's counters say could not be served a response
    bundle (:data:`UNSERVED_COUNTERS`): an upper bound on continuations that restore only ``P - 1``.
    The counters cover every phase of a run (producers, resends and cold runs keep response
    bundles too), so it bounds, not equals, the count of one phase."""
    return sum(stats.get(name, 0) for name in UNSERVED_COUNTERS)


def acceptance_stats(drafting_steps: int, accepted: int, k: int) -> tuple[float, float]:
    """(mean accepted drafts per drafting step, its standard error). Per step the accepted count
    lies in ``[0, k]``, so its variance is at most ``mean * (k - mean)`` (Bhatia-Davis; the
    binomial variance at ``k = 1``): a conservative error from the counts alone."""
    mean = accepted / drafting_steps
    return mean, math.sqrt(max(mean * (k - mean), 0.0) / drafting_steps)


def check_acceptance(info: dict, k: int, min_share: float = MIN_ACCEPTED_SHARE) -> dict[str, dict[str, float]]:
    """Acceptance of the restored continuations vs their cold controls, from
    ``info["request_boundaries"]["acceptance"]`` (per phase ``[drafting steps, accepted drafts]``;
    vLLM's ``spec_decode_num_drafts`` counts drafting steps). A restore that lost the MTP context
    (draft K/V rows below ``N``, docs/notes/spec-decode.md §1.5) or fed the drafter another state
    would change the drafts, not the target's tokens, so only acceptance shows it. (The planted
    fixture's drafter reads only the next token -- its decoder layer is an identity -- so on it
    this check sees the drafts and the target's tokens, not the draft K/V.)

    Asserted: each phase accepts at least ``min_share * k`` drafts per drafting step (drafts are
    really accepted, so the accepted-draft paths ran), and the two means differ by at most
    ``NOISE_SIGMAS`` standard errors of the difference (:func:`acceptance_stats`) plus one
    accepted draft over the smaller phase (the counts are integers). Both are printed (mean tokens
    per drafting step, ``1 + accepted / steps``) and returned."""
    acceptance = info["request_boundaries"]["acceptance"]
    stats = {}
    for phase in ("restored", "cold"):
        steps, accepted = acceptance[phase]
        assert steps > 0, acceptance
        mean, error = acceptance_stats(steps, accepted, k)
        stats[phase] = {"steps": steps, "accepted": accepted, "tokens_per_step": 1 + mean, "stderr": error}
    gap = abs(stats["restored"]["tokens_per_step"] - stats["cold"]["tokens_per_step"])
    noise = math.hypot(stats["restored"]["stderr"], stats["cold"]["stderr"])
    allowed = NOISE_SIGMAS * noise + 1 / min(stats["restored"]["steps"], stats["cold"]["steps"])
    restored, cold = stats["restored"], stats["cold"]
    print(f"k={k}: mean tokens per drafting step: restored {restored['tokens_per_step']:.3f} "
          f"+- {restored['stderr']:.3f}, cold {cold['tokens_per_step']:.3f} +- {cold['stderr']:.3f}; "
          f"gap {gap:.3f}, allowed {allowed:.3f} (all phases: {acceptance})")  # fmt: skip
    for phase, values in stats.items():
        assert values["accepted"] >= min_share * k * values["steps"], (phase, stats)
    assert gap <= allowed, (gap, allowed, stats)
    return stats
