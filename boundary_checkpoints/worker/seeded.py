"""Seeded sampling across partial-prefill steps on vLLM's V1 model runner (the CPU engine's runner).

Why: the plugin ends every prompt's prefill at ``P - 1``, so every request has a partial-prefill
step whose sampled row is discarded. vLLM's V1 runner samples that row anyway (with the request's
own ``torch.Generator`` when the request has a ``seed``) and then, in ``_bookkeeping_sync``, tries
to undo the draw by moving the generator's offset back by 4. That works for CUDA (Philox)
generators only: a CPU generator has no offset and raises ``CPU Generator does not use offset``,
which kills the engine. Stock vLLM reaches that line only when its own chunking cuts a seeded
prompt; with the plugin every seeded request reaches it.

Contract: for every row whose sampled token the runner discards (``discard_request_mask``), the
row's generator leaves the step in exactly the state it entered it, on every device: the state is
saved before the sampler runs and put back right after it, and the row's generator is hidden from
``_bookkeeping_sync`` so that vLLM's own offset rewind neither runs (CPU: it would raise) nor
applies on top (CUDA: it would rewind twice). A seeded request therefore draws from its generator
only in the steps whose token it keeps, i.e. exactly as with an unsplit prefill, whatever the number
of chunks.

Model Runner V2 (the GPU default, and the CPU V2 runner) needs none of this: its Gumbel noise is a
stateless hash of (request seed, token position), so a discarded row consumes nothing and the
kept row at position ``P - 1`` draws the same noise as an unsplit prefill. Only instances of the V1
runner class (see :func:`boundary_checkpoints.compat.v1_model_runner_class`) are re-classed.
"""

from __future__ import annotations

from boundary_checkpoints import compat


class ExactDiscardedDrawsMixin:
    """Put a discarded row's generator back to its state before the sampler (see module doc)."""

    _boundary_restored_rows: tuple[int, ...] = ()

    def _sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        saved = []
        if generators:
            discarded = self.discard_request_mask.np[: self.input_batch.num_reqs]
            for row, generator in generators.items():
                if row < len(discarded) and discarded[row]:
                    saved.append((row, generator, generator.get_state()))
        try:
            return super()._sample(*args, **kwargs)
        finally:
            for _, generator, state in saved:
                generator.set_state(state)
            self._boundary_restored_rows = tuple(row for row, _, _ in saved)

    def _bookkeeping_sync(self, *args, **kwargs):
        rows, self._boundary_restored_rows = self._boundary_restored_rows, ()
        generators = self.input_batch.generators
        hidden = {row: generators.pop(row) for row in rows if row in generators}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(hidden)


_SUBCLASSES: dict[type, type] = {}


def with_exact_discarded_draws(runner):
    """Re-class a V1 model runner instance to its :class:`ExactDiscardedDrawsMixin` subclass.

    Any other runner (Model Runner V2) is returned unchanged. Idempotent.
    """
    base = compat.v1_model_runner_class()
    cls = type(runner)
    if not isinstance(runner, base) or isinstance(runner, ExactDiscardedDrawsMixin):
        return runner
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"ExactDiscardedDraws{cls.__name__}", (ExactDiscardedDrawsMixin, cls), {})
    compat.reclass_instance(runner, _SUBCLASSES[cls])
    return runner
