"""The in-step split on a real Gated DeltaNet layer: one mixed batch (decode rows, ordinary prefill
rows and capture rows) through the plugin's layer against every row run alone in the two steps of
the ``P - 1`` stop with vLLM's own core (``gdn_shadow.compare``, run in the engine's worker).

CPU: outputs, captured states and final states bit for bit, and the state after ``P`` (what a
capture after ``P`` keeps) differs from the state after ``P - 1`` for every capture row -- the
negative control that shows the comparison can fail. GPU (FLA Triton core, marked ``gpu``): the
same comparison; bit-exact is recorded; captured states must be within 1% of the negative
control's smallest difference, and each row's outputs and final states no further from the
reference than stock's own step (the whole batch through vLLM's core) moves that row, plus 1%
(of the output magnitude; of the negative control): :func:`row_failures`.

On CUDA the captured states are bit-exact. A bound of 1% of the negative control per row is too
tight: stock's own step moves every row as far from the reference (which runs rows alone; the
kernels round a row differently in a mixed batch) -- final conv states about 4.3 off, SSM 0.059,
outputs 0.0089 -- and the split stays within 0.05% of stock on every row. ``max(stock, 1%)`` is
too tight as well: the split's own two calls round one capture row's SSM state 2e-5 past stock's
(0.039799 against 0.039781). The bound is therefore stock's deviation plus 1%, and
:func:`test_row_criterion_on_the_recorded_h200_rows` holds it to rows recorded on an H200 and to a
row moved by 2% of the negative control.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_script import HELPERS_DIR, run_engine_script
from results_out import save_json

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])  # tests/helpers/: gdn_shadow
from vllm import LLM
from gdn_shadow import compare
extra = json.loads(sys.argv[3])
llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
          enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True, seed=0, **extra,
          additional_config={"gdn_prefill_backend": "triton", "boundary_checkpoints": {"policy": "request_boundaries",
                                                                                 "prompt_capture": "in_step"}})
print("RESULT " + json.dumps(llm.collective_rpc(compare)[0]))
"""


def run_compare(model_dir: Path, **engine_args) -> dict:
    result, _ = run_engine_script(SCRIPT, str(model_dir), HELPERS_DIR, json.dumps(engine_args))
    save_json(f"gdn-split-{result['device']}.json", result)
    return result


def check_negative_control(result: dict) -> float:
    """Every capture row's state after P differs from its state after P - 1; returns the smallest
    such difference."""
    assert result["after_p"] and not any(exact for _, exact in result["after_p"]), result
    return min(diff for diff, _ in result["after_p"])


@pytest.mark.slow
def test_split_matches_the_two_step_stop_bit_for_bit_on_cpu(tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU kernels run on CPU machines (the GPU test below covers CUDA)")
    result = run_compare(tiny_model_dir)
    assert result["device"] == "cpu" and result["untaken"] == []
    assert result["outputs"] == [0.0, True], result
    assert all(exact for _, exact in result["final"]), result
    assert len(result["captured"]) == 2 * 5 and all(exact for _, exact in result["captured"]), result
    check_negative_control(result)


@pytest.mark.gpu
def test_split_matches_the_two_step_stop_on_gpu(tiny_model_dir):
    result = run_compare(tiny_model_dir, gpu_memory_utilization=0.3)
    assert result["device"] == "cuda" and result["untaken"] == []
    floor = check_negative_control(result)
    print(f"\n[gdn split, cuda] bit-exact: outputs {result['outputs'][1]}, captured "
          f"{all(e for _, e in result['captured'])}, final {all(e for _, e in result['final'])}; "
          f"negative control floor {floor:.4g}, output scale {result['output_scale']:.4g}")  # fmt: skip
    for row in result["rows"]:
        print(f"  row {row}")
    assert all(diff <= 0.01 * floor for diff, _ in result["captured"]), result
    assert not row_failures(result, floor), row_failures(result, floor)


def row_failures(result: dict, floor: float) -> list[dict]:
    """The rows of ``result`` (``gdn_shadow.compare``) whose outputs or final states are further
    from the reference than stock's own step moves them by more than 1% of the output magnitude
    (outputs) or of the negative control's smallest difference ``floor`` (states)."""
    output_slack = 0.01 * result["output_scale"]
    return [
        row
        for row in result["rows"]
        if row["outputs"] > row["stock_outputs"] + output_slack
        or any(got > stock + 0.01 * floor for got, stock in zip(row["final"], row["stock_final"]))
    ]


RECORDED_H200 = Path(__file__).resolve().parents[2] / "docs/results/gpu/run24-gdn-split/gdn-split-cuda.json.gz"


def test_row_criterion_on_the_recorded_h200_rows():
    """The per-row bound passes the rows recorded on an H200 and fails the same rows with
    one capture row's SSM state moved 2% of the negative control further from the reference, or
    one row's outputs moved 2% of the output magnitude."""
    import copy
    import gzip

    result = json.loads(gzip.decompress(RECORDED_H200.read_bytes()))
    floor = check_negative_control(result)
    assert row_failures(result, floor) == []
    capture = next(i for i, row in enumerate(result["rows"]) if row["capture"])
    moved_state = copy.deepcopy(result)
    moved_state["rows"][capture]["final"][1] = result["rows"][capture]["stock_final"][1] + 0.02 * floor
    assert row_failures(moved_state, floor) == [moved_state["rows"][capture]]
    moved_output = copy.deepcopy(result)
    moved_output["rows"][0]["outputs"] = result["rows"][0]["stock_outputs"] + 0.02 * result["output_scale"]
    assert row_failures(moved_output, floor) == [moved_output["rows"][0]]
