"""GPU host: ``prompt_capture: end``, the prompt checkpoint at ``P`` with no stop, with vLLM's GPU
defaults (CUDA graphs, async scheduling): the scenario and judgement of
``tests/helpers/spec_prompt_end.py``, which the CPU engine runs in ``tests/e2e/test_spec_decode_cpu.py``
(MTP) and ``tests/e2e/test_prompt_end_engine.py`` (without speculative decoding).

* Under MTP k = 1 and 3 on the tiny planted Qwen3-Next (``qwen3_next_mtp_planted``, drafts
  accepted): the checkpoint serves only prompts whose token ``P`` is the first sampled token. Passed on
  an H200, so ``auto`` takes it there (``support.PROMPT_END_SPECULATIVE``); under other drafters
  it stops every prompt at ``P - 1`` (``prompt_capture.SPECULATIVE_AUTO_REASON``).
* Under MTP k = 1 and 3 on Nemotron-H (``nemotron_h_mtp_planted``) and under DFlash and DFlash2 k = 3
  on Qwen3-Next (``test_gpu_dflash.py``'s planted drafter; no next-token guard: a DFlash draft row
  below ``P`` reads the first ``P`` tokens only). Passed on an H100 but for Nemotron-H at k = 3, where
  the fixture forgets a one-token-off state within the k + 2 tokens after ``P`` and the control
  tells none apart; ``auto`` takes ``P`` where they passed (``support.PROMPT_END_SPECULATIVE``).
* Without speculative decoding on Kimi-Linear, Nemotron-H and GLM-5.3-Flash (tiny fixtures), whose
  ``auto`` takes the checkpoint at ``P`` (copied after the step, as a response checkpoint is); a
  resend is captured at ``P - 1`` by the stop (their recurrent layers have no in-step split).

The first-token bound is calibrated per prompt length, one ``LOGIT_STEP`` above the largest
reference pair of that length (``LengthBounds.one_step_above``; ``SPEC_ROW_REFERENCE`` the least
reference under MTP: ``tests/helpers/spec_families.py``; the resend restored at ``P - 1`` runs
its last token alone, under MTP as a padded speculative row, a path no reference pair takes). The negative control keys
each checkpoint at ``P`` as ``P - 1`` (``corrupt_restore.PromptKeyedOneShort``): every such restore
that deviates from its cold control more than the largest reference pair by a logit step must fail
the bound, and at least ``MIN_TELLABLE`` of them must. (Copies held back one step were the control
before: on this runner the verify step leaves the copied block intact, so they restored the exact
state.)
"""

from __future__ import annotations

import json

import pytest
import spec_prompt_end
from engine_script import HELPERS_DIR, run_engine_script
from results_out import save_json
from spec_families import (
    CASE_TIMEOUT_S,
    LOGIT_STEP,
    MARGIN,
    MIN_TELLABLE,
    MTP_FAMILY,
    NEMOTRON_MTP_FAMILY,
    SPEC_ROW_REFERENCE,
)

pytestmark = pytest.mark.gpu

# Around the block (256 on this fixture) and past it, none a multiple of it.
LENGTHS = (23, 40, 61, 97, 130, 255, 300, 700)
MAX_TOKENS = 6
GPU_ENGINE = {"gpu_memory_utilization": 0.3, "max_num_seqs": 32, "additional_config": {"gdn_prefill_backend": "triton"}}


# The same for the other fixtures, whose blocks may be smaller: neither P nor P - 1 a multiple of
# 16 (a resend's block-grid hit must stay below P - 1).
FAMILY_LENGTHS = (23, 42, 61, 103, 130, 255, 300, 700)
# Families whose ``auto`` takes the checkpoint at P without speculative decoding (compatibility.md).
FAMILIES_AT_P = ("kimi_linear", "nemotron_h", "glm5_next")
# GLM also above its indexer's index_topk (2048), where the selection is sparse.
LONGER = {"glm5_next": ((2103,), {"max_model_len": 4096})}


def run_and_check(
    family: str, k: int, lengths: tuple[int, ...], name: str, engine: dict | None = None, guard: bool | None = None
) -> None:  # fmt: skip
    """Run the scenario on ``family``'s tiny fixture with prompts of ``lengths`` under k = ``k``
    drafts (MTP unless ``engine`` names another drafter; 0: none) and ``engine`` over
    ``GPU_ENGINE``, save its record as ``name``, and :func:`judge` it (``guard``: whether the
    next-token guard applies; default: under MTP)."""
    from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

    model = make_tiny_model(default_model_dir(family, 0), family=family, seed=0)
    engine_args = json.dumps({**GPU_ENGINE, **(engine or {})})
    argv = (str(k), str(MAX_TOKENS), json.dumps(lengths), str(spec_prompt_end.tail_tokens(k)), engine_args)
    info, _ = run_engine_script(spec_prompt_end.SCRIPT, str(model), HELPERS_DIR, *argv, timeout=CASE_TIMEOUT_S)
    save_json(name, info)
    assert info["scheduler"] == "BoundaryAsyncScheduler", info["scheduler"]
    judge(info, k, lengths, label=f"{family} k={k}", guard=guard)


def judge(info: dict, k: int, lengths: tuple[int, ...], label: str = "", guard: bool | None = None) -> None:
    """One run's judgement (also replayed on recorded runs, ``tests/tools/test_gpu_records.py``):
    exact counts, the bounds calibrated per prompt length, and the negative control, which must
    catch every corrupted restore a reference pair of its length tells apart (``guard``: the
    next-token guard applies; default: under a drafter, as under MTP)."""
    floor = SPEC_ROW_REFERENCE if k else 0.0  # under a drafter the restored resend's padded row
    info, phases, bounds = spec_prompt_end.end_result(info, lengths, reference_floor=floor, margin=MARGIN)
    bounds = bounds.one_step_above(LOGIT_STEP)
    print(f"{label} bounds: {bounds}")
    spec_prompt_end.check_end_run(info, phases, bounds, lengths, next_token_guard=k > 0 if guard is None else guard)
    caught, corrupted = spec_prompt_end.check_corrupted_prompts(info, bounds, lengths)
    tellable = spec_prompt_end.tellable_prompts(info, bounds, lengths, LOGIT_STEP)
    assert corrupted and set(tellable) <= set(caught), (tellable, caught, bounds)
    assert len(tellable) >= MIN_TELLABLE * len(corrupted), (tellable, corrupted, bounds)


@pytest.mark.parametrize("k", [1, 3])
def test_prompt_checkpoint_at_p_under_mtp_on_the_gpu(k):
    run_and_check(MTP_FAMILY, k, LENGTHS, f"gpu-spec-prompt-end-k{k}.json")


@pytest.mark.parametrize("family", FAMILIES_AT_P)
def test_prompt_checkpoint_at_p_on_other_families(family, monkeypatch):
    # vLLM 0.32's Kimi model imports the CuTe DSL for a fusion one GPU does not use (test_gpu_families)
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
    longer, engine = LONGER.get(family, ((), {}))
    run_and_check(family, 0, FAMILY_LENGTHS + longer, f"gpu-prompt-end-{family}.json", engine)


@pytest.mark.parametrize("k", [1, 3])
def test_prompt_checkpoint_at_p_on_nemotron_h_under_mtp(k):
    """Nemotron-H under MTP (its planted MTP layer, drafts accepted): the checkpoint at ``P`` with
    the next-token guard, the prompt lengths of the other families."""
    run_and_check(NEMOTRON_MTP_FAMILY, k, FAMILY_LENGTHS, f"gpu-spec-prompt-end-nemotron-k{k}.json")


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_prompt_checkpoint_at_p_under_dflash(variant, tmp_path):
    """Qwen3-Next under DFlash and DFlash2 at k = 3 (``test_gpu_dflash.py``'s planted drafter, its
    sliding-window layer of 64 among the bundle's groups): no next-token guard (a DFlash draft row
    below ``P`` reads the first ``P`` tokens only), so a prompt with another token at ``P`` restores
    ``P`` too."""
    from test_gpu_dflash import LAYER_TYPES, PLANTED_SEED, TORCH_VOCAB_TOPK, WINDOW

    from bc_tools.fixtures.dflash import write_dflash_drafter
    from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

    k = 3
    model = make_tiny_model(default_model_dir(MTP_FAMILY, 0), family=MTP_FAMILY, seed=0)
    drafter = write_dflash_drafter(tmp_path / variant, model, variant=variant, layer_types=LAYER_TYPES, window=WINDOW,
                                   planted_seed=PLANTED_SEED)  # fmt: skip
    engine = {"speculative_config": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k},
              "torch_vocab_topk": TORCH_VOCAB_TOPK[variant]}  # fmt: skip
    run_and_check(MTP_FAMILY, k, LENGTHS, f"gpu-spec-prompt-end-{variant}.json", engine, guard=False)
