"""The ``nemotron_h_mtp_planted`` fixture (``fixtures/nemotron_h_family.py``): a tiny Nemotron-H whose
one MTP layer predicts the target's greedy answers, so that speculative decoding accepts drafts
(the GPU test of Nemotron-H under MTP, ``tests/gpu/test_gpu_families_mtp.py``, judges acceptance
with it; the random ``nemotron_h_mtp`` drafter has none accepted).

Checked without an engine, as ``test_planted_mtp.py`` checks the Qwen3-Next one: the target differs
from ``nemotron_h_mtp`` in the embedding (exactly ``embed_scale`` = 2x) and ``lm_head`` only; vLLM's
MTP forward, re-implemented here in float32 from ``model_executor/models/nemotron_h_mtp.py``
(``NemotronHMTPAttentionDecoderLayer.forward``), drafts the planted successor of every token; and on
greedy answers of the target (transformers, float32) the drafts are right at least
``MIN_OFFLINE_ACCEPTANCE`` of the time. Each check also runs on ``nemotron_h_mtp``, where it must
fail (negative control).
"""

from __future__ import annotations

import pytest

from bc_tools.fixtures import family_spec, nemotron_h_family, qwen3_next_family
from bc_tools.fixtures import tiny_models as tm

FAMILY = "nemotron_h_mtp_planted"
BASE = "nemotron_h_mtp"
MTP = nemotron_h_family.MTP_LAYER
# Measured 0.72 of answer tokens following the successor (seed 0, 96 answers of 16 tokens after
# random prompts of 1, 40 and 97 tokens); nemotron_h_mtp: 0.
MIN_OFFLINE_ACCEPTANCE = 0.55


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted_nemotron")
    return {name: tm.make_tiny_model(root / name, family=name) for name in (BASE, FAMILY)}


@pytest.fixture(scope="module")
def weights(dirs):
    from safetensors.torch import load_file

    return {name: load_file(str(path / "model.safetensors")) for name, path in dirs.items()}


def rms_norm(x, weight, eps=1e-5):
    """vLLM's RMSNorm (``layer_norm_epsilon`` 1e-5): scales by ``weight``."""
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def mtp_logits(w: dict, next_tokens, hidden):
    """vLLM's ``NemotronHMTP`` draft logits for rows ``(hidden[r], next_tokens[r])`` in float32:
    ``eh_proj(cat(enorm(embed(t)), hnorm(h)))``, one attention block added to the residual, then
    ``final_layernorm`` and ``lm_head``. The block writes nothing when ``o_proj`` is zero, which is
    asserted; otherwise (the random drafter) its attention over the module's own rows is left out,
    which only a negative control reads."""
    import torch

    f = {name: tensor.float() for name, tensor in w.items()}
    embedded = rms_norm(f["backbone.embeddings.weight"][next_tokens], f[MTP + "enorm.weight"])
    hidden = rms_norm(hidden.float(), f[MTP + "hnorm.weight"])
    residual = torch.cat([embedded, hidden], dim=-1) @ f[MTP + "eh_proj.weight"].T
    return rms_norm(residual, f[MTP + "final_layernorm.weight"]) @ f["lm_head.weight"].T


def test_target_differs_from_nemotron_h_mtp_in_embedding_and_lm_head_only(weights):
    import torch

    base, planted = weights[BASE], weights[FAMILY]
    assert set(base) == set(planted)
    target = [name for name in base if not name.startswith("mtp.")]
    changed = sorted(name for name in target if not torch.equal(base[name], planted[name]))
    assert changed == ["backbone.embeddings.weight", "lm_head.weight"]
    scale = nemotron_h_family.NEMOTRON_PLANTED_RECIPE["embed_scale"]
    assert torch.equal(planted["backbone.embeddings.weight"], base["backbone.embeddings.weight"] * scale)  # exact
    assert not planted[MTP + "mixer.o_proj.weight"].any()


@pytest.mark.parametrize("family", [FAMILY, BASE])
def test_mtp_drafts_the_planted_successor_of_every_token(weights, family):
    import torch

    successor = qwen3_next_family.planted_successor(0)
    tokens = torch.arange(family_spec.VOCAB_SIZE)
    hidden = torch.randn(len(tokens), 256, generator=torch.Generator().manual_seed(0))
    drafts = mtp_logits(weights[family], tokens, hidden).argmax(-1)
    wrong = tokens[drafts != successor].tolist()
    if family == FAMILY:
        assert wrong == [], wrong  # the pad too: Nemotron-H's pad embedding is not zero
    else:
        assert len(wrong) > family_spec.VOCAB_SIZE // 2  # the random drafter knows no successor


def acceptance(model_dir, w: dict) -> float:
    """``planted_acceptance.offline_acceptance`` of the target in ``model_dir`` and the drafter ``w``."""
    import torch
    from planted_acceptance import offline_acceptance
    from transformers import NemotronHForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = NemotronHForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return offline_acceptance(model, lambda tokens, hidden: mtp_logits(w, tokens, hidden))


def test_drafts_are_accepted_on_the_targets_greedy_answers(dirs, weights):
    planted = acceptance(dirs[FAMILY], weights[FAMILY])
    random = acceptance(dirs[BASE], weights[BASE])
    print(f"offline acceptance per draft (k = 1): planted {planted:.3f}, random {random:.3f}")
    assert planted >= MIN_OFFLINE_ACCEPTANCE > random


def test_the_recipe_is_part_of_the_cache_digest(monkeypatch):
    before = tm._config_digest(FAMILY)
    recipe = nemotron_h_family.NEMOTRON_PLANTED_RECIPE
    monkeypatch.setitem(recipe, "version", recipe["version"] + 1)
    assert tm._config_digest(FAMILY) != before
