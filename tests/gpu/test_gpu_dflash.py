"""GPU host: DFlash and DFlash2 speculative decoding end to end on the tiny Qwen3-Next
(docs/notes/spec-decode.md §11.8), and DFlash2 on the tiny GLM-5.3-Flash (below), with a
planted drafter whose drafts are accepted (a random drafter drafts 1.004 tokens per step).

Each case builds the tiny planted target (``make_tiny_model``, family ``qwen3_next_mtp_planted``:
its greedy answers follow a planted successor ~0.7 of the time; its MTP layer is not loaded) and the
planted drafter sized to it (``fixtures/dflash.py``, ``planted_seed=0``: one full-attention and one
sliding-window draft layer, window 64, context from target layers 0 and 2; draft ``j`` is
``succ^j`` of the bonus token, ``tests/tools/test_planted_dflash.py``), then runs the three scenarios of
``spec_families`` (tests/helpers/) in one fresh process with vLLM's GPU defaults (Model Runner V2, CUDA
graphs, async scheduling) and ``speculative_config={"method": "dflash", "model": <drafter>,
"num_speculative_tokens": 3}``:

1. policy ``request_boundaries`` (DFlash is in the unvalidated tier: ``auto`` would fall back);
2. the same engine re-classed to ``corrupt_restore.CorruptAsyncScheduler`` (restores one token
   of state off), the negative control;
3. stock ``aligned`` on a second engine (calibrates the bounds).

Prompt lengths of ``spec_families`` (1, B - 1, B, B + 1, 8193, 32768; ``B``: the
engine's block size) plus 65 (one past the window) and 150, 32 conversations, 16 answer tokens; a
continuation's first new token is the successor of the answer's last (``planted_seed``, as MTP).
Checked: the plugin was in force with a window group of the drafter's window among its KV
groups (its startup log line); exact cached counts (the continuation within
``[committed - k, committed]`` when producers accepted drafts, spec-decode.md §9 option B); first
tokens within the bound calibrated in the same run; the corrupted restores fail; stock never
caches more; mean accepted tokens per drafting step after a restore vs cold
(``mtp_checks.check_acceptance``: at least 0.3 k accepted drafts per step in each phase, and the
two within noise). Expected: draft ``j`` is accepted when the answer follows the successor ``j``
times running, ~``p + p^2 + p^3`` = 1.5 drafts per step for ``p`` ~0.7 (a random drafter drafts
1.004 tokens per step). The planted drafter reads no context (its
``fc`` is zero), so acceptance checks the bonus token and the target's tokens after a restore, not
the draft K/V rows below it; the scheduler tests' shadow checks those. ``BC_RESULTS_DIR``
receives ``gpu-dflash-<case>.json`` and ``.log``. Two engine starts per case, about 1 min each on
an H200-class GPU: ``bash scripts/gpu_host.sh dflash`` runs this file alone (``-k "not glm"`` for
the two Qwen3-Next cases, ``-k glm`` for the GLM case below).

GLM-5.3-Flash (``test_glm5_next_dflash2_on_the_pool_grid``, ``-k glm``; its H200 record is replayed
on the CPU by ``tests/tools/test_gpu_records.py``): the same three scenarios with DFlash2 at k = 3
on ``glm5_next_mtp_planted`` (the tiny GLM with the same planted successor, seed 0; its MTP layer
is not loaded under DFlash) and the planted drafter sized to it (4 heads of 64, 4 KV heads: GLM's
MLA has no heads to share), with the prompt lengths of the GLM MTP test (``GLM_EXTRA_LENGTHS``: 97,
200, 2103 above ``index_topk``, and ``B - 8``) instead of 65 and 150. Judged as
``test_gpu_families_mtp.test_glm5_next_mtp_boundaries``: every checkpoint on the indexer's pool
grid (docs/design.md contract 13, ``grid=GLM_KPOOL``), each resend against the bounds of its own
prompt length (``bounds_for``: rounding grows with the context), the ring group ``ring/8 p4`` and
the drafter's window group among the plugin's groups, acceptance as above. Stock vLLM first runs
the batch alone (``stock_vllm_gets_through``): GLM under MTP at k = 3 meets a device-side assert
of vLLM's on some batches, stock included, and if stock dies on this one the test is an expected
failure. One more engine start (three in all).

One departure from the defaults, DFlash2 only: its candidate top-k over the vocabulary runs on
``torch.topk`` instead of FlashInfer's ``top_k`` (``TORCH_VOCAB_TOPK``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from engine_script import probe_rows
from mtp_checks import check_acceptance
from results_out import save_json
from spec_families import (
    GLM_EXTRA_LENGTHS,
    bounds_for,
    check_corrupted_run,
    check_plugin_run,
    continuation_bounds_for,
    engine_run,
    make_case,
    stock_vllm_gets_through,
)

from bc_tools.fixtures.glm5_next_family import GLM_INDEX_TOPK, GLM_KPOOL
from boundary_checkpoints.core.layout import tail_ring_slots

pytestmark = pytest.mark.gpu

K = 3  # = fixtures.dflash.PLANTED_DRAFTS: every draft is planted
WINDOW = 64
TARGET_FAMILY = "qwen3_next_mtp_planted"  # the planted successor; vLLM skips its MTP weights here
GLM_FAMILY = "glm5_next_mtp_planted"  # the same planted successor (seed 0); vLLM skips its MTP layer here
GLM_VARIANT = "dflash2"
PLANTED_SEED = 0
LAYER_TYPES = ("full_attention", "sliding_attention")
# DFlash2 picks each draft position's candidates with LogitsProcessor.get_top_k_tokens
# (model_executor/models/qwen3_dflash2.py:408-413), whose _topk calls FlashInfer's top_k whenever
# flashinfer imports and nvcc and ninja are present (model_executor/layers/logits_processor.py:29-53).
# The GPU bundle has no FlashInfer cubins, so the first call JIT-compiles FlashInfer's whole `topk`
# module, 4 CUDA files compiled in parallel, one core each: it runs past the 360 s case on the GPU
# host, and off-host (nvcc 13.0, sm_90a, flashinfer 0.7.0.post1's own flags) its
# cub_topk.cu alone took 22 min (topk.cu 6 min), past the host's 10-minute command limit; no host
# keeps that cache between sessions. vLLM
# 0.32.0 has no setting or VLLM_* variable for this choice (VLLM_USE_FLASHINFER_SAMPLER covers the
# sampler only), so the engine script swaps the selector for one that answers None, the branch in
# which _topk calls torch.topk. This reaches the worker because the engine runs in the script's
# process (engine_script.py). Both return the k largest logits sorted, so DFlash2's candidates
# differ at most in the order of tied logits; every phase (restored, cold, stock) runs the same
# top-k, and no check here depends on which kernel ranked the draft vocabulary. DFlash (v1) never
# calls it: its drafts are argmax/sampled over full logits.
TORCH_VOCAB_TOPK = {"dflash": False, "dflash2": True}
TOPK_JIT_LINE = "Building JIT module topk"


def dflash_case(
    variant: str, drafter_dir: Path, family: str = TARGET_FAMILY, extra_lengths: tuple = (WINDOW + 1, 150)
) -> tuple[Path, dict]:
    """(the tiny ``family`` model's directory, the SCRIPT's case): the planted ``variant`` drafter
    sized to it, written into ``drafter_dir``, as the speculative config of ``K`` drafts."""
    from bc_tools.fixtures.dflash import write_dflash_drafter
    from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

    model = make_tiny_model(default_model_dir(family, 0), family=family, seed=0)
    drafter = write_dflash_drafter(
        drafter_dir, model, variant=variant, layer_types=LAYER_TYPES, window=WINDOW, planted_seed=PLANTED_SEED
    )
    speculative = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": K}
    case = make_case(K, extra_lengths, engine={"speculative_config": speculative}, planted_seed=PLANTED_SEED)
    case["torch_vocab_topk"] = TORCH_VOCAB_TOPK[variant]
    return model, case


def run_dflash_case(name: str, variant: str, model: Path, case: dict, grid: int = 0):
    """The three scenarios (module docstring) of ``case``; returns (info, rows per run, bounds, the
    engines' log); ``grid``: as ``bounds_for``'s."""
    info, log = engine_run(model, case, f"gpu-dflash-{name}.log")
    rows = probe_rows(info)
    bounds = bounds_for(rows, K, grid)
    save_json(f"gpu-dflash-{name}.json", {"variant": variant, "k": K, "bounds": bounds.as_dict(), **info})
    return info, rows, bounds, log


def active_groups(log: str) -> list[str]:
    """The plugin's KV groups from its startup line (``... active: N KV groups (a/B, ...)``)."""
    lines = re.findall(r"request_boundaries active: \d+ KV groups \(([^)]*)\)", log)
    assert lines, "the plugin's startup line is missing: boundary retention was not active"
    return lines[0].split(", ")


def check_setup(variant: str, info: dict, log: str) -> list[str]:
    """The engine ran as intended (GPU defaults, the top-k choice, the plugin with the drafter's
    window group); returns the plugin's KV groups."""
    setup = info["request_boundaries"]["setup"]
    groups = active_groups(log)
    print(f"{variant} setup: {setup}; KV groups: {groups}")
    assert setup["vocab_topk"] == ("torch.topk" if TORCH_VOCAB_TOPK[variant] else "vllm default"), setup
    assert TOPK_JIT_LINE not in log, "FlashInfer JIT-compiled its top-k: the case is out of its time budget"
    assert setup["async_scheduling"] is True and setup["scheduler"] == "BoundaryAsyncScheduler", setup
    assert "NONE" not in setup["cudagraph_mode"], setup
    assert any(re.fullmatch(rf"window/\d+ w{WINDOW}", g) for g in groups), groups  # the sliding draft layer
    assert info["corrupt"]["scheduler"] == "CorruptAsyncScheduler"
    return groups


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_dflash_restores_under_gpu_defaults(variant, tmp_path):
    model, case = dflash_case(variant, tmp_path / f"{variant}-drafter")
    info, rows, bounds, log = run_dflash_case(variant, variant, model, case)
    check_setup(variant, info, log)
    check_plugin_run(info, rows, bounds, K)
    check_corrupted_run(info, rows, bounds, speculative=True)
    check_acceptance(info, K)  # the planted drafter: drafts accepted in both phases, within noise


def test_glm5_next_dflash2_on_the_pool_grid(tmp_path):
    """GLM-5.3-Flash under DFlash2 at k = 3 (module docstring): stock alone on the batch first, then
    the three scenarios judged on the pool grid as the GLM MTP test judges them, at vLLM's block
    unit with the plugin's pool-grid stop (what ``auto`` runs). The pool as vLLM's prefix match unit
    does not apply: the drafter's sliding-window layer finds hits by whole blocks only, so vLLM
    turns its hits between blocks off (``match_unit.choose``; tests/core/test_match_unit.py)."""
    name = f"glm-{GLM_VARIANT}"
    model, case = dflash_case(GLM_VARIANT, tmp_path / f"{name}-drafter", GLM_FAMILY, GLM_EXTRA_LENGTHS)
    stock_vllm_gets_through(name, GLM_FAMILY, case, results_prefix="gpu-dflash")
    info, rows, bounds, log = run_dflash_case(name, GLM_VARIANT, model, case, grid=GLM_KPOOL)
    groups = check_setup(GLM_VARIANT, info, log)
    ring = f"ring/{tail_ring_slots(GLM_KPOOL, K)} p{GLM_KPOOL}"  # vLLM's lookahead ring: 8 slots, pool 4
    assert ring in info["request_boundaries"]["setup"]["group_labels"] and ring in groups, groups
    assert max(row.prompt_len for row in rows["request_boundaries"]) > GLM_INDEX_TOPK  # sparse selection
    continuation = continuation_bounds_for(rows, bounds, K, GLM_KPOOL)
    check_plugin_run(info, rows, bounds, K, continuation, grid=GLM_KPOOL)
    check_corrupted_run(info, rows, bounds, speculative=True, grid=GLM_KPOOL)
    check_acceptance(info, K)
