"""The GLM indexer tail ring on the shadow engine: the layout's builders and the restore rounds the
ring scheduler tests share (``tests/core/test_scheduler_ring_restore.py``,
``tests/core/test_scheduler_ring_spec.py``, ``tests/core/test_scheduler_vllm_grid_prompts.py``).
The layout: an attention group, two recurrent groups and a ``CircularBufferSpec`` ring group of
``KPOOL`` slots, or under MTP the lookahead ring of ``SLOTS`` (``docs/design.md`` contracts 11-13)."""

from __future__ import annotations

from shadow_scheduler import build_scheduler, make_request, tokens
from spec_shadow import SpecDriver, SpecShadowWorker

from boundary_checkpoints.core.boundaries import restore_tail

KPOOL = 4
RING = 3  # the ring group's index: attention, two recurrent groups, ring
SLOTS = 8  # vLLM's ring for a pool of 4 at k = 1..3: 4 * next_pow2(cdiv(4 + k, 4))


def ring_scheduler(model_dir, **kwargs):
    kwargs = dict(dict(ring_kpool=KPOOL, max_num_batched_tokens=64, max_model_len=1024), **kwargs)
    return build_scheduler(model_dir, **kwargs)


def recorded_steps(scheduler) -> list:
    """Every ``SchedulerOutput`` the scheduler returns, in order."""
    outputs = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        outputs.append(schedule(*args, **kwargs))
        return outputs[-1]

    scheduler.schedule = recording_schedule
    return outputs


def spec_ring_engine(
    model_dir, k: int, accept, async_scheduling: bool = False, slots: int = SLOTS, grid_only: bool = True,
    uniform_decode_rows: bool | None = None, **engine_args,
):  # fmt: skip
    """The ring layout under MTP, on the shadow of an indexer that needs uniform decode rows
    (Hopper). ``grid_only=False`` takes the plugin's pool-grid rule away (contract 13) and, unless
    ``uniform_decode_rows`` says otherwise, models an indexer that takes short rows of any length as
    decodes (Blackwell): the off-grid restore path."""
    scheduler, worker = ring_scheduler(
        model_dir, ring_slots=slots, num_speculative_tokens=k, worker_cls=SpecShadowWorker,
        async_scheduling=async_scheduling, **engine_args,
    )  # fmt: skip
    worker.num_spec, worker.accept, worker.async_scheduling, worker.kpool = k, accept, async_scheduling, KPOOL
    scheduler._grid_only = grid_only
    scheduler._restore_tail = restore_tail(k) if grid_only else 1
    worker.uniform_decode_rows = grid_only if uniform_decode_rows is None else uniform_decode_rows
    worker.no_short_prefill_rows = grid_only
    return scheduler, worker, SpecDriver(scheduler, worker, lag=int(async_scheduling))


ACCEPT = {  # accepted drafts per step, by pattern, for k drafts
    "none": lambda k: lambda r, s: 0, "all": lambda k: lambda r, s: k, "cycle": lambda k: lambda r, s: s % (k + 1),
}  # fmt: skip


def restore_rounds(
    driver, rng, lengths=(5, 8, 15, 17, 22, 30), new_tokens: int = 13, response_at=None, resend_at=None
) -> None:
    """Per prompt length: a producer, its exact resend (restored at ``P - 1``, or ``resend_at(P)``)
    and a next turn of ``new_tokens`` more (restored at the response boundary when one was kept,
    or every time at ``response_at(committed length)``), each answering as a cold run."""
    resend_at = resend_at or (lambda length: length - 1)
    for length in lengths:
        prompt = tokens(rng, length)
        [answer] = driver.run([make_request(prompt, salt="s")])
        resend = make_request(prompt, salt="s")
        assert driver.run([resend]) == [answer]
        assert driver.cached_tokens[resend.request_id] == resend_at(length)
        follow_up = prompt + answer + tokens(rng, new_tokens)
        nxt, cold = make_request(follow_up, salt="s"), make_request(follow_up, salt=f"cold-{length}")
        assert driver.run([nxt]) == driver.run([cold])
        if response_at is not None:
            assert driver.cached_tokens[nxt.request_id] == response_at(length + len(answer) - 1)
        else:
            assert driver.cached_tokens[nxt.request_id] >= resend_at(length)
        assert driver.cached_tokens[cold.request_id] == 0
