"""Records the prefill chunks a scheduler runs: inside an engine script, the chunks that end at
``P - 1`` (with the P - 1 stop every captured prompt has one; with in-step capture only vLLM's own
splits do: ``test_probes_cpu.py``, ``test_gpu_in_step.py``); on the shadow runner, every chunk's end
(the scheduler tests)."""

from __future__ import annotations


def record_p_minus_1_chunks(scheduler) -> list[int]:
    """Wrap ``scheduler.schedule`` on this instance; the returned list fills, step by step, with
    the prompt length of every scheduled chunk that ends at ``P - 1`` (the last prompt token then
    runs alone in a later step)."""
    lengths, schedule = [], scheduler.schedule

    def recording(*args, **kwargs):
        output = schedule(*args, **kwargs)
        for request_id, n in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            if request.num_computed_tokens - n < request.num_prompt_tokens - 1 == request.num_computed_tokens:
                lengths.append(request.num_prompt_tokens)
        return output

    scheduler.schedule = recording
    return lengths


def record_chunk_ends(scheduler) -> dict[str, list[int]]:
    """Per request, its num_computed_tokens after each ``schedule()`` that scheduled it."""
    chunk_ends: dict[str, list[int]] = {}
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        for request_id in output.num_scheduled_tokens:
            chunk_ends.setdefault(request_id, []).append(scheduler.requests[request_id].num_computed_tokens)
        return output

    scheduler.schedule = recording_schedule
    return chunk_ends
