"""GPU host: DFlash and DFlash2 speculative decoding end to end on the tiny Qwen3-Next
(docs/notes/spec-decode.md §11.8), with a planted drafter whose drafts are accepted (a random
drafter drafts 1.004 tokens per step).

Each case builds the tiny planted target (``make_tiny_model``, family ``qwen3_next_mtp_planted``:
its greedy answers follow a planted successor ~0.7 of the time; its MTP layer is not loaded) and the
planted drafter sized to it (``fixtures/dflash.py``, ``planted_seed=0``: one full-attention and one
sliding-window draft layer, window 64, context from target layers 0 and 2; draft ``j`` is
``succ^j`` of the bonus token, ``tests/tools/test_planted_dflash.py``), then runs the three scenarios of
``test_gpu_spec_families.py`` in one fresh process with vLLM's GPU defaults (Model Runner V2, CUDA
graphs, async scheduling) and ``speculative_config={"method": "dflash", "model": <drafter>,
"num_speculative_tokens": 3}``:

1. policy ``request_boundaries`` (DFlash is in the unvalidated tier: ``auto`` would fall back);
2. the same engine re-classed to ``corrupt_restore.CorruptAsyncScheduler`` (restores one token
   of state off), the negative control;
3. stock ``aligned`` on a second engine (calibrates the bounds).

Prompt lengths of ``test_gpu_spec_families.py`` (1, B - 1, B, B + 1, 8193, 32768; ``B``: the
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
an H200-class GPU: ``bash scripts/gpu_host.sh dflash`` runs this file alone (``-k dflash2`` or
``-k "not dflash2"`` to split it).

One departure from the defaults, DFlash2 only: its candidate top-k over the vocabulary runs on
``torch.topk`` instead of FlashInfer's ``top_k`` (``TORCH_VOCAB_TOPK``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from engine_script import HELPERS_DIR, probe_rows, run_engine_script
from mtp_checks import check_acceptance
from results_out import results_dir, save_json
from test_gpu_spec_families import CASE_TIMEOUT_S, SCRIPT, bounds_for, check_corrupted_run, check_plugin_run, make_case

pytestmark = pytest.mark.gpu

K = 3  # = fixtures.dflash.PLANTED_DRAFTS: every draft is planted
WINDOW = 64
TARGET_FAMILY = "qwen3_next_mtp_planted"  # the planted successor; vLLM skips its MTP weights here
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


def run_dflash_case(variant: str, drafter_dir: Path):
    """The three scenarios (module docstring) with a ``variant`` drafter; returns (info, rows per
    run, bounds, the engines' log)."""
    from bc_tools.fixtures.dflash import write_dflash_drafter
    from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

    model = make_tiny_model(default_model_dir(TARGET_FAMILY, 0), family=TARGET_FAMILY, seed=0)
    drafter = write_dflash_drafter(
        drafter_dir, model, variant=variant, layer_types=LAYER_TYPES, window=WINDOW, planted_seed=PLANTED_SEED
    )
    speculative = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": K}
    case = make_case(K, (WINDOW + 1, 150), engine={"speculative_config": speculative}, planted_seed=PLANTED_SEED)
    case["torch_vocab_topk"] = TORCH_VOCAB_TOPK[variant]
    info, log = run_engine_script(SCRIPT, str(model), HELPERS_DIR, json.dumps(case), timeout=CASE_TIMEOUT_S)
    out = results_dir()
    if out is not None:
        (out / f"gpu-dflash-{variant}.log").write_text(log)
    rows = probe_rows(info)
    bounds = bounds_for(rows, K)
    save_json(f"gpu-dflash-{variant}.json", {"variant": variant, "k": K, "bounds": bounds.as_dict(), **info})
    return info, rows, bounds, log


def active_groups(log: str) -> list[str]:
    """The plugin's KV groups from its startup line (``... active: N KV groups (a/B, ...)``)."""
    lines = re.findall(r"request_boundaries active: \d+ KV groups \(([^)]*)\)", log)
    assert lines, "the plugin's startup line is missing: boundary retention was not active"
    return lines[0].split(", ")


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_dflash_restores_under_gpu_defaults(variant, tmp_path):
    info, rows, bounds, log = run_dflash_case(variant, tmp_path / f"{variant}-drafter")
    setup = info["request_boundaries"]["setup"]
    groups = active_groups(log)
    print(f"{variant} setup: {setup}; KV groups: {groups}")
    assert setup["vocab_topk"] == ("torch.topk" if TORCH_VOCAB_TOPK[variant] else "vllm default"), setup
    assert TOPK_JIT_LINE not in log, "FlashInfer JIT-compiled its top-k: the case is out of its time budget"
    assert setup["async_scheduling"] is True and setup["scheduler"] == "BoundaryAsyncScheduler", setup
    assert "NONE" not in setup["cudagraph_mode"], setup
    assert any(re.fullmatch(rf"window/\d+ w{WINDOW}", g) for g in groups), groups  # the sliding draft layer
    assert info["corrupt"]["scheduler"] == "CorruptAsyncScheduler"
    check_plugin_run(info, rows, bounds, K)
    check_corrupted_run(info, rows, bounds, speculative=True)
    check_acceptance(info, K)  # the planted drafter: drafts accepted in both phases, within noise
