"""GPU host: the Nemotron-H, Kimi-Linear and GLM-5.3-Flash layouts without speculative decoding,
end to end on the tiny fixtures (docs/notes/model-families.md §9): policy ``request_boundaries``
against stock ``aligned`` and a corrupted restore, each case in the three scenarios of
``spec_families`` (tests/helpers/: the engine script, the prompt lengths, the bounds and the checks).

Each case adds the decode-path cold controls (``decode_path_control``): every control must have run
its span one token per step, and the quartiles of their first-token deviations are printed
(``report_decode_path``); the continuations are judged against bounds calibrated with the
cold-vs-decode-path pairs too (``continuation_bounds_for``). The prompt lengths add ``B - 8``
(GLM: 97, 200 and 2103 too, above its ``index_topk``); a GLM continuation restores the pool
boundary below the committed length. ``bash scripts/gpu_host.sh families -k "not mtp"`` runs this
file's cases (about 1 min each on an H200-class GPU).
"""

from __future__ import annotations

import pytest
from decode_path_control import span_failures
from spec_families import (
    DECODED_BLOCK_LENGTH,
    GLM_EXTRA_LENGTHS,
    check_corrupted_run,
    check_plugin_run,
    continuation_bounds_for,
    run_case,
)

from bc_tools.bench.probes import ProbeRow, first_token_deviation
from bc_tools.bench.stats import percentile
from bc_tools.fixtures.glm5_next_family import GLM_INDEX_TOPK, GLM_KPOOL

pytestmark = pytest.mark.gpu


def quartiles(values: list[float]) -> tuple[float, ...]:
    """(min, lower quartile, median, upper quartile, max), by linear interpolation."""
    return tuple(percentile(values, q) for q in (0, 25, 50, 75, 100))


def decode_path_summary(rows: list[ProbeRow]) -> dict[str, tuple[float, ...]]:
    """Quartiles (``quartiles``) of the plugin rows' first-token deviations from their decode-path
    controls (restored and cold), and restored-vs-cold for reference."""
    pairs = {
        "restored_vs_decoded": lambda r: (r.restored, r.cold_decoded),
        "cold_vs_decoded": lambda r: (r.cold, r.cold_decoded),
        "restored_vs_cold": lambda r: (r.restored, r.cold),
    }
    return {name: quartiles([first_token_deviation(*pick(r)) for r in rows]) for name, pick in pairs.items()}


def report_decode_path(name: str, info: dict, rows: dict) -> None:
    """The decode-path controls (``decode_path_control``): each ran its span one token per step
    (the only check); prints the quartiles of ``decode_path_summary`` for the GPU session to read
    (the hypothesis: a restored continuation carries its producer's decode-kernel rounding, so it
    lies much closer to its decode-path control than its chunk-path cold control does)."""
    run = info["request_boundaries"]
    spans = {salt: tuple(span) for salt, span in run["decode_spans"].items()}
    assert len(spans) == len(rows["request_boundaries"]), len(spans)
    assert span_failures(spans, run["decode_span_counts"]) == []
    mixed = sum(c["one_token_mixed"] for c in run["decode_span_counts"].values())
    total = sum(c["one_token"] for c in run["decode_span_counts"].values())
    summary = decode_path_summary(rows["request_boundaries"])
    print(f"{name} decode-path controls ({total} one-token span steps, {mixed} beside a longer row): "
          + "; ".join(f"{key} min/q1/median/q3/max " + "/".join(f"{v:.4f}" for v in values)
                      for key, values in summary.items()))  # fmt: skip


@pytest.mark.parametrize("family", ["nemotron_h", "kimi_linear"])
def test_hybrid_family_boundaries(family, monkeypatch):
    # vLLM 0.32's Kimi model imports the CuTe DSL (``cutlass``) for its GEMM + all-reduce fusion
    # unless this is off; the GPU host bundle has no CuTe DSL, and one GPU has no all-reduce to fuse.
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
    info, rows, bounds = run_case(family, family, extra_lengths=(DECODED_BLOCK_LENGTH,), decode_path=True)
    print(f"{family} setup: {info['request_boundaries']['setup']}")
    report_decode_path(family, info, rows)
    check_plugin_run(info, rows, bounds, 0, continuation_bounds_for(rows, bounds))
    check_corrupted_run(info, rows, bounds)


def test_glm5_next_boundaries_above_index_topk():
    info, rows, bounds = run_case("glm5_next", "glm5_next", extra_lengths=GLM_EXTRA_LENGTHS, decode_path=True)
    print(f"glm5_next setup: {info['request_boundaries']['setup']}")
    assert max(row.prompt_len for row in rows["request_boundaries"]) > GLM_INDEX_TOPK  # sparse selection
    report_decode_path("glm5_next", info, rows)
    check_plugin_run(info, rows, bounds, 0, continuation_bounds_for(rows, bounds), pool=GLM_KPOOL)
    assert info["request_boundaries"]["setup"]["boundary_stats"]["responses_on_pool_grid"] > 0
    check_corrupted_run(info, rows, bounds)
