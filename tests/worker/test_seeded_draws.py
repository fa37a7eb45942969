"""Unit: a discarded row's seeded draw is undone on the V1 runner (``worker/seeded.py``), no engine.

The fake runner below does what vLLM 0.32's V1 runner does with per-request generators: the
sampler draws once per row that has a generator (``forward_cpu``), and ``_bookkeeping_sync``
rewinds the offset of discarded rows' generators, which raises on a CPU generator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from boundary_checkpoints.worker.seeded import ExactDiscardedDrawsMixin, with_exact_discarded_draws


class _Batch:
    def __init__(self, generators):
        self.generators = generators
        self.num_reqs = 3


class _Mask:
    def __init__(self, values):
        self.np = np.array(values + [False] * 5)


class _StockLikeRunner:
    def __init__(self, generators, discarded):
        self.input_batch = _Batch(generators)
        self.discard_request_mask = _Mask(discarded)

    def _sample(self, logits, spec_decode_metadata):
        return {row: int(torch.randint(0, 2**31, (1,), generator=g)) for row, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self, *args):
        for row in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(row))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)  # RuntimeError on a CPU generator
        return "bookkeeping"


class _FixedRunner(ExactDiscardedDrawsMixin, _StockLikeRunner):
    pass


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _step(runner):
    drawn = runner._sample(None, None)
    assert runner._bookkeeping_sync() == "bookkeeping"
    return drawn


def test_stock_rewind_raises_on_cpu_generator():
    runner = _StockLikeRunner({0: _gen(5)}, [True, False, False])
    runner._sample(None, None)
    with pytest.raises(RuntimeError, match="offset"):
        runner._bookkeeping_sync()


def test_discarded_draw_is_undone_and_kept_draws_advance():
    unsplit = _FixedRunner({0: _gen(5), 2: _gen(7)}, [False, False, False])
    expected = [_step(unsplit) for _ in range(3)]

    split = _FixedRunner({0: _gen(5), 2: _gen(7)}, [True, False, True])
    _step(split)  # partial prefill of rows 0 and 2: both draws discarded and undone
    _step(split)
    split.discard_request_mask = _Mask([False, False, False])
    assert [_step(split) for _ in range(3)] == expected
    assert set(split.input_batch.generators) == {0, 2}  # hidden only during bookkeeping


def test_only_v1_runners_are_reclassed():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

    v1 = CPUModelRunner.__new__(CPUModelRunner)
    assert with_exact_discarded_draws(v1) is v1
    assert isinstance(v1, ExactDiscardedDrawsMixin) and isinstance(v1, CPUModelRunner)
    cls = type(v1)
    assert type(with_exact_discarded_draws(v1)) is cls  # idempotent

    v2 = ModelRunnerV2.__new__(ModelRunnerV2)
    with_exact_discarded_draws(v2)
    assert type(v2) is ModelRunnerV2
