"""GPU host: MTP speculative decoding end to end on the tiny fixtures (docs/notes/spec-decode.md
§9-10, docs/notes/model-families.md §10): Qwen3-Next (k = 1, 3: async scheduling, CUDA graphs),
Nemotron-H (k = 1, 3) and GLM-5.3-Flash (k = 1, 2, 3 at two prefix match units), each case in the
three scenarios of ``spec_families`` (tests/helpers/: the engine script, the prompt lengths, the
bounds and the checks), plus drafts accepted after a restore as often as cold
(``mtp_checks.check_acceptance``).

MTP runs on ``qwen3_next_mtp_planted``, whose MTP layer predicts the target's greedy answers
(``fixtures/qwen3_next_family.py``; ~0.7 of drafts accepted at ``k = 1`` offline and on the CPU engine), so
that the accepted-draft paths run: response bundles of a last step that accepted drafts, and the
in-flight capture of async scheduling (docs/notes/spec-decode.md §7, §10). (Its target differs
from ``qwen3_next`` in the embedding and ``lm_head``; ``MARGIN`` and ``MIN_TELLABLE`` were
measured on the random ``qwen3_next_mtp``; the planted fixture's GPU runs confirm them.)
GLM-5.3-Flash under MTP runs on ``glm5_next_mtp_planted`` (the tiny GLM plus one MTP layer,
``Glm5NextMTP``, with the same planted successor: ~0.77 of drafts accepted at ``k = 1`` offline,
``tests/tools/test_planted_glm_mtp.py``; the random ``glm5_next_mtp`` drafter has none accepted on a
GPU, 1.000 tokens per drafting step), with the plugin restoring GLM's
indexer tail ring with speculative lookahead (vLLM sizes it for a pool plus the drafts: ``ring/8
p4``, docs/notes/model-families.md §10); on a GPU the planted GLM passes at k = 1 (1.988 tokens
per drafting step). At k = 3 the plugin's engine dies on a device-side index assert in the first
batch, one stock vLLM meets too on batches with 2- and 3-token prefill rows of its own
(``support.FAILED_ON_GPU``): where that table records a failure, stock runs the batch alone first
and the test is an expected failure if stock dies (``stock_vllm_gets_through``), or if the
plugin's engines die on such an assert (``run_case``'s ``known_failure``).

``bash scripts/gpu_host.sh families -k mtp`` runs this file's cases (``-k qwen3_next_mtp`` /
``-k nemotron_h_mtp`` / ``-k glm5_next_mtp`` split it under the 10-minute command limit).
"""

from __future__ import annotations

import pytest
from mtp_checks import check_acceptance
from spec_families import (
    DECODED_BLOCK_LENGTH,
    GLM_EXTRA_LENGTHS,
    MTP_FAMILY,
    NEMOTRON_MTP_FAMILY,
    check_corrupted_run,
    check_plugin_run,
    continuation_bounds_for,
    make_case,
    run_case,
    stock_vllm_gets_through,
    vllm_keeps_prompts,
)

from bc_tools.fixtures.glm5_next_family import GLM_INDEX_TOPK, GLM_KPOOL
from boundary_checkpoints.core.layout import tail_ring_slots
from boundary_checkpoints.support import failures_on_gpu

pytestmark = pytest.mark.gpu

# Its MTP layer predicts the target (the planted successor of MTP_FAMILY, on GLM): drafts are
# accepted. The random ``glm5_next_mtp`` drafter has none accepted on a GPU (1.000 tokens per
# drafting step), so the boundaries of its runs never saw an accepted draft.
GLM_MTP_FAMILY = "glm5_next_mtp_planted"
# Least mean tokens per drafting step (``1 + accepted / steps``) of GLM's restored and cold
# continuations: drafts are really accepted at GLM's boundaries (1.000 means none ever was).
GLM_MIN_TOKENS_PER_STEP = 1.2


@pytest.mark.parametrize("k", [1, 3])
def test_qwen3_next_mtp_under_gpu_defaults(k):
    info, rows, bounds = run_case(f"{MTP_FAMILY}-k{k}", MTP_FAMILY, k=k)
    setup = info["request_boundaries"]["setup"]
    print(f"k={k} setup: {setup}")
    assert setup["async_scheduling"] is True and setup["scheduler"] == "BoundaryAsyncScheduler", setup
    assert "NONE" not in setup["cudagraph_mode"], setup
    assert info["corrupt"]["scheduler"] == "CorruptAsyncScheduler"
    check_plugin_run(info, rows, bounds, k)
    check_corrupted_run(info, rows, bounds, speculative=True)
    check_acceptance(info, k)


@pytest.mark.parametrize("k", [1, 3])
def test_nemotron_h_mtp_boundaries(k):
    """Nemotron-H under MTP (``nemotron_h_mtp_planted``: the tiny Nemotron-H plus one attention MTP
    layer, which vLLM builds as ``NemotronHMTP``, drafting the planted successor), as the Qwen MTP
    test: exact counts, the first-token bound, the negative control, and drafts accepted after a
    restore as often as cold (``check_acceptance``)."""
    name = f"{NEMOTRON_MTP_FAMILY}-k{k}"
    info, rows, bounds = run_case(name, NEMOTRON_MTP_FAMILY, k=k, extra_lengths=(DECODED_BLOCK_LENGTH,))
    setup = info["request_boundaries"]["setup"]
    print(f"{NEMOTRON_MTP_FAMILY} k={k} setup: {setup}")
    assert setup["async_scheduling"] is True and setup["scheduler"] == "BoundaryAsyncScheduler", setup
    check_plugin_run(info, rows, bounds, k)
    check_corrupted_run(info, rows, bounds, speculative=True)
    check_acceptance(info, k)


# The prefix match unit under MTP: the plugin's pool-grid stop (vLLM's own unit, the block), or the
# pool as vLLM's unit where FlashKDA saves states in the chunk (match_unit.py: the plugin sets it;
# stock is given it, so that resends compare with the same vLLM states). The unit's case runs the
# plugin at its defaults (``policy: auto``), as a user gets it: GLM + MTP at every k <= 3 is on
# ``support.MATCH_UNIT_SPECULATIVE`` (k = 3 there only: ``support.MATCH_UNIT_ONLY_K``).
GLM_UNITS = {
    "pool_grid_stop": ({"prefix_match_unit": "vllm"}, None),
    "vllm_unit": ({"policy": "auto", "prompt_capture": "auto"}, {"prefix_match_unit": 16}),
}


# k = 3 at vLLM's block unit is refused at startup (``gate.match_unit_reasons``; the CPU test
# tests/core/test_scheduler_vllm_grid_prompts.py), as the device-side assert it hit there takes engines down.
GLM_MTP_CASES = [(k, unit) for unit in GLM_UNITS for k in (1, 2, 3) if (k, unit) != (3, "pool_grid_stop")]


@pytest.mark.parametrize(("k", "unit"), GLM_MTP_CASES, ids=[f"{k}-{unit}" for k, unit in GLM_MTP_CASES])
def test_glm5_next_mtp_boundaries(k, unit):
    """GLM-5.3-Flash under MTP (``glm5_next_mtp_planted``: the tiny GLM plus one planted MTP layer,
    which vLLM builds as ``Glm5NextMTP``: one more sparse MLA layer with its own indexer and tail ring), as the
    Qwen MTP test and the GLM test above (prompts of 2103, 8193 and 32768 tokens: above ``index_topk``).

    Under MTP vLLM sizes each ring for a pool plus ``k`` drafts (8 slots for the pool of 4); the
    plugin accepts it as one ring group over the pool (``ring/8 p4``). It keeps every checkpoint on
    the pool grid (docs/design.md contract 13): where vLLM's indexer needs uniform decode rows
    (Hopper) a one-token step that completes a pool beside verify rows would run the indexer's
    prefill path (docs/notes/model-families.md §13), and no restore on the grid needs one. The
    resends are judged against bounds calibrated per prompt length (``bounds_for``). The
    planted drafter's drafts are accepted (~0.77 per draft offline), so acceptance is checked as
    the Qwen MTP test's (``mtp_checks.MIN_ACCEPTED_SHARE``, restored vs cold) and the mean tokens
    per drafting step of both phases must exceed ``GLM_MIN_TOKENS_PER_STEP``. At k = 3 stock runs
    the first batch alone first (``stock_vllm_gets_through``).

    ``unit`` (``GLM_UNITS``): ``pool_grid_stop`` keeps vLLM's unit (the block) and the plugin's
    prompt checkpoint on the pool grid; ``vllm_unit`` runs the plugin at its defaults (``auto``),
    which set the pool's multiple with FlashKDA's alignment (16) as vLLM's prefix match unit, and
    gives stock the same unit: the
    plugin then takes no prompt checkpoint (``grid_targets`` 0), a resend restores vLLM's own state
    (stock's count), and a continuation a response bundle where the response ended on the grid,
    else vLLM's state. Its pass (k = 1, 2, 3) put GLM + MTP on ``support.MATCH_UNIT_SPECULATIVE``
    and k = 3 on ``support.MATCH_UNIT_ONLY_K``."""
    name = f"{GLM_MTP_FAMILY}-k{k}-{unit}"
    plugin, stock_engine = GLM_UNITS[unit]
    known_failure = "; ".join(failures_on_gpu(["Glm5NextForCausalLM"], "mtp", k))
    if known_failure:
        stock_case = make_case(k, GLM_EXTRA_LENGTHS, stock_engine=stock_engine)
        stock_vllm_gets_through(name, GLM_MTP_FAMILY, stock_case)
    info, rows, bounds = run_case(
        name, GLM_MTP_FAMILY, k=k, extra_lengths=GLM_EXTRA_LENGTHS, grid=GLM_KPOOL, known_failure=known_failure,
        plugin=plugin, stock_engine=stock_engine,
    )  # fmt: skip
    setup = info["request_boundaries"]["setup"]
    if stock_engine:
        assert setup["prefix_match_unit"] == stock_engine["prefix_match_unit"], setup  # the plugin chose it
        assert vllm_keeps_prompts(info), setup  # no prompt checkpoint of its own
    print(f"{GLM_MTP_FAMILY} k={k} setup: {setup}")
    assert f"ring/{tail_ring_slots(GLM_KPOOL, k)} p{GLM_KPOOL}" in setup["group_labels"], setup
    assert max(row.prompt_len for row in rows["request_boundaries"]) > GLM_INDEX_TOPK  # sparse selection
    check_plugin_run(info, rows, bounds, k, continuation_bounds_for(rows, bounds, k, GLM_KPOOL), grid=GLM_KPOOL)
    check_corrupted_run(info, rows, bounds, speculative=True, grid=GLM_KPOOL)
    stats = check_acceptance(info, k)
    for phase in ("restored", "cold"):
        assert stats[phase]["tokens_per_step"] > GLM_MIN_TOKENS_PER_STEP, (phase, stats)
