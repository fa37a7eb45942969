"""Decode-path cold control: boundary schedulers that run registered spans one token per step.

A restored continuation (``bench.probe_scenario.run_probes``) resumes from the state its producer left:
the prompt ``[0, P - 1)`` computed by the prefill (chunk) kernels, then one token per engine
step -- the last prompt token (the plugin's prompt checkpoint runs it alone: the ``P - 1`` stop,
or, captured in the step, a one-token decode row inside the GDN layers, ``worker/gdn_split.py``)
and the answer's tokens ``[P, committed)`` as the producer generated them (the last answer token
was sampled, never fed). Its ordinary cold control computes those positions inside one prefill
chunk instead: two kernel paths, two roundings. A *decode-path* cold control computes the same
continuation cold (a fresh ``cache_salt``, no restore) with the span ``[P - 1, committed)`` of
its prompt run one token per step, as the producer ran it, and the rest as prefill chunks:
``[0, P - 1)``, then ``[committed, len)`` -- the chunks a restored continuation runs (where the
plugin lets a restored continuation's first chunk run past its block, ``core/chunk_stops.py``, the
control's chunk from ``committed`` does the same). (With the
span starting at ``P`` instead, the CPU engine leaves the last prompt token on the chunk path
and the control no longer matches the restore bit for bit: ``test_decode_path_cpu.py``.)

Why one-token chunks run on the decode kernels: vLLM's recurrent metadata builders classify a
one-token row of a request that is still prefilling as a decode row when the request has prior
state (``split_decodes_and_prefills(..., treat_short_extends_as_decodes=False)`` with
``decode_threshold = 1`` after the builder clears ``is_prefilling`` for such rows: the GDN builder,
used by the GDN and KDA layers, keeps only first chunks -- no prior state -- as prefills; the
Mamba builder moves one-token rows with prior state to the decode path, ``prefill_to_decode``).
Caveat (KDA): vLLM's KDA layer (``kimi_gdn_linear_attn.py``) runs every non-speculative row of
a step through its chunk kernel when that step holds any prefill row; a decode row takes the
recurrent decode kernel only in a step without prefill rows. Which kernel a producer's answer
token met depends on its batch in the same way; ``run_probes`` sends every phase as one batch of
the same prompts, so the control's steps resemble its producer's, and ``one_token_mixed`` counts
the control's one-token steps that shared their step with a longer row. The Mamba2 mixer, the
CUDA GDN layer and the CPU GDN kernels run decode rows apart from prefill rows in every step.

Hook: vLLM caps every step of a request in ``Scheduler._mamba_block_aligned_split`` (both the
running and the waiting branch of ``schedule()`` call it, before the encoder and lookahead caps),
which the plugin's scheduler already overrides for its ``P - 1`` stop; the mixin here sits before
the plugin's class and cuts its answer further: a chunk that would cross the span's start ends
there, and a chunk that starts inside the span runs one token. It only ever shortens a step, so
the plugin's own stops and captures (planned from the scheduled step, ``_plan_chunk_captures``)
still see the step that really runs.

Registry: ``decode_spans`` (a dict on the scheduler instance) maps a ``cache_salt`` to its span
``(start, end)``; ``run_probes(decode_spans=...)`` fills it with each decode-path control's fresh
salt before sending the phase (the engine core runs in the test's process). ``decode_span_counts``
records, per registered salt, how many of its span's tokens ran in one-token steps
(``one_token``), in longer steps (``longer``: the control did not do what it claims), and how
many of the one-token ones shared their step with a row of two tokens or more (``one_token_mixed``:
the caveat above).

Classes: :class:`DecodePathScheduler` / :class:`DecodePathAsyncScheduler` over the plugin's two
schedulers (``scheduler_cls=``), :func:`decode_path_class` for another plugin scheduler (the
corrupting ones of ``corrupt_restore``), :func:`install` to re-class a running engine's scheduler.
"""

from __future__ import annotations

from boundary_checkpoints.core.scheduler import BoundaryAsyncScheduler, BoundaryScheduler


class DecodePathControl:
    """Mixin placed before the plugin's scheduler class (see the module docstring)."""

    @property
    def decode_spans(self) -> dict[str, tuple[int, int]]:
        """``cache_salt -> (start, end)``: prompt positions run one token per step."""
        return self.__dict__.setdefault("_decode_spans", {})  # set lazily: a re-classed instance

    @property
    def decode_span_counts(self) -> dict[str, dict]:
        """``cache_salt -> {"span", "one_token", "longer", "one_token_mixed"}`` (module docstring)."""
        return self.__dict__.setdefault("_decode_span_counts", {})

    def _decode_span(self, request) -> tuple[int, int] | None:
        salt = getattr(request, "cache_salt", None)
        return self.decode_spans.get(salt) if salt is not None else None

    def _mamba_block_aligned_split(
        self,
        request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        requested = num_new_tokens
        num_new_tokens = super()._mamba_block_aligned_split(
            request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
        span = self._decode_span(request)
        if span is None:
            return num_new_tokens
        begin, end = span
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if start == end and num_new_tokens and self._runs_restores_past_block:
            # the rest of the prompt in the chunk a restored continuation runs: past the block
            past = self._chunk_past_block(request, start, requested, num_new_local_computed_tokens)
            if past is not None:
                self._leave_slot_uncached(request.request_id, start // self.cache_config.block_size)
                return past
        if num_new_tokens <= 1:
            return num_new_tokens
        if start < begin < start + num_new_tokens:
            return begin - start  # the chunk before the span ends at its start
        if begin <= start < end:
            return 1
        return num_new_tokens

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        if not self.decode_spans:
            return output
        mixed = any(n > 1 for n in output.num_scheduled_tokens.values())
        for request_id, n in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            span = self._decode_span(request)
            if span is None:
                continue
            end = request.num_computed_tokens  # vLLM advanced it by this step's tokens
            overlap = max(0, min(end, span[1]) - max(end - n, span[0]))
            counts = self.decode_span_counts.setdefault(
                request.cache_salt, {"span": list(span), "one_token": 0, "longer": 0, "one_token_mixed": 0}
            )
            if n == 1:
                counts["one_token"] += overlap
                counts["one_token_mixed"] += overlap if mixed else 0
            else:
                counts["longer"] += overlap
        return output


class DecodePathScheduler(DecodePathControl, BoundaryScheduler):
    """Synchronous plugin scheduler with decode-path controls."""


class DecodePathAsyncScheduler(DecodePathControl, BoundaryAsyncScheduler):
    """Async plugin scheduler with decode-path controls."""


_CLASSES: dict[type, type] = {BoundaryScheduler: DecodePathScheduler, BoundaryAsyncScheduler: DecodePathAsyncScheduler}


def decode_path_class(base: type) -> type:
    """``base`` (a plugin scheduler class, e.g. ``corrupt_restore.CorruptScheduler``) with
    :class:`DecodePathControl` before it; one class per base."""
    if issubclass(base, DecodePathControl):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(f"DecodePath{base.__name__}", (DecodePathControl, base), {})
    return _CLASSES[base]


def install(scheduler) -> dict[str, tuple[int, int]]:
    """Re-class ``scheduler`` (same instance: single inheritance of a mixin without slots keeps its
    layout) to run decode-path controls; returns its registry for ``run_probes(decode_spans=...)``."""
    scheduler.__class__ = decode_path_class(type(scheduler))
    return scheduler.decode_spans


def span_failures(spans: dict[str, tuple[int, int]], counts: dict[str, dict]) -> list[str]:
    """Registered spans that did not run wholly in one-token steps (empty when every one did)."""
    failures = []
    for salt, (begin, end) in spans.items():
        got = counts.get(salt)
        if got is None or got["one_token"] != end - begin or got["longer"]:
            failures.append(f"{salt}: span [{begin}, {end}) ran {got} (want one_token = {end - begin}, longer = 0)")
    return failures
