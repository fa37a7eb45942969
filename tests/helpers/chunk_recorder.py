"""Records, inside an engine script, the prefill chunks that end at ``P - 1``: with the P - 1 stop
every captured prompt has one; with in-step capture only vLLM's own splits do
(``test_probes_cpu.py``, ``test_gpu_in_step.py``)."""

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
