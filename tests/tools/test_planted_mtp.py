"""The ``qwen3_next_mtp_planted`` fixture (``fixtures/qwen3_next_family.py``): a tiny Qwen3-Next whose one
MTP layer predicts the target's greedy answers, so that speculative decoding accepts drafts.

Checked without an engine (a few seconds): the target differs from ``qwen3_next`` in the embedding
(exactly 16x) and ``lm_head`` only; vLLM's MTP forward, re-implemented here in float32 from
``model_executor/models/qwen3_next_mtp.py`` (``Qwen3NextMultiTokenPredictor.forward``), drafts the
planted successor of every token; and on greedy answers of the target (transformers, float32) the
drafts are right at least ``MIN_OFFLINE_ACCEPTANCE`` of the time -- the acceptance rate per draft at
``k = 1``. ``tests/e2e/test_spec_decode_cpu.py`` measures it on the CPU engine.
"""

from __future__ import annotations

import pytest

from bc_tools.fixtures import families, family_spec, qwen3_next_family
from bc_tools.fixtures import tiny_models as tm

FAMILY = "qwen3_next_mtp_planted"
# Measured 0.69 (seed 0, 96 answers of 16 tokens after random prompts of 1, 40 and 97 tokens).
MIN_OFFLINE_ACCEPTANCE = 0.55


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    return {"base": tm.make_tiny_model(root / "base"), "planted": tm.make_tiny_model(root / "planted", family=FAMILY)}


def rms_norm(x, weight, eps=1e-6):
    """Qwen3-Next's RMSNorm: scales by ``1 + weight``."""
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.float())


def mtp_logits(w: dict, next_tokens, hidden):
    """vLLM's ``Qwen3NextMTP`` draft logits for rows ``(hidden[r], next_tokens[r])`` in float32.

    ``Qwen3NextMultiTokenPredictor.forward``: ``fc(cat(pre_fc_norm_embedding(embed(t)),
    pre_fc_norm_hidden(h)))``, one ``Qwen3NextDecoderLayer`` (full attention over the module's own
    rows, then the MoE block, each added to the residual), ``norm``; then the shared ``lm_head``.
    The fixture's decoder layer writes nothing to the residual -- ``o_proj`` and every
    ``down_proj`` are zero, so both branches add exact zeros -- which is asserted, not assumed;
    the layer is then the identity and its attention context does not matter."""
    import torch

    f = {name: tensor.float() for name, tensor in w.items()}
    layer = [name for name in f if name.startswith("mtp.layers.0.")]
    writers = [name for name in layer if name.endswith(("self_attn.o_proj.weight", "down_proj.weight"))]
    assert len(writers) == 1 + 4 + 1 and all(not f[name].any() for name in writers), writers
    embedded = rms_norm(f["model.embed_tokens.weight"][next_tokens], f["mtp.pre_fc_norm_embedding.weight"])
    hidden = rms_norm(hidden.float(), f["mtp.pre_fc_norm_hidden.weight"])
    residual = torch.cat([embedded, hidden], dim=-1) @ f["mtp.fc.weight"].T
    return rms_norm(residual, f["mtp.norm.weight"]) @ f["lm_head.weight"].T


def test_target_differs_from_qwen3_next_in_embedding_and_lm_head_only(weights):
    import torch

    base, planted = weights["base"], weights["planted"]
    changed = sorted(name for name in base if not torch.equal(base[name], planted[name]))
    assert changed == ["lm_head.weight", "model.embed_tokens.weight"]
    scale = qwen3_next_family.PLANTED_RECIPE["embed_scale"]
    assert torch.equal(planted["model.embed_tokens.weight"], base["model.embed_tokens.weight"] * scale)  # exact
    extra = set(planted) - set(base)
    assert extra and all(name.startswith("mtp.") for name in extra)


def test_mtp_drafts_the_planted_successor_of_every_token(weights):
    import torch

    successor = qwen3_next_family.planted_successor(0)
    tokens = torch.arange(family_spec.VOCAB_SIZE)
    hidden = torch.randn(len(tokens), 256, generator=torch.Generator().manual_seed(0))
    drafts = mtp_logits(weights["planted"], tokens, hidden).argmax(-1)
    wrong = tokens[drafts != successor].tolist()
    assert wrong == [family_spec.PAD_ID], wrong  # the pad's embedding is zero: no successor to read


def test_drafts_are_accepted_on_the_targets_greedy_answers(dirs, weights):
    """Acceptance per draft at ``k = 1`` on greedy answers of random prompts (``planted_acceptance``)."""
    import torch
    from planted_acceptance import offline_acceptance
    from transformers import Qwen3NextForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = Qwen3NextForCausalLM.from_pretrained(str(dirs["planted"]), dtype=torch.float32).eval()
    rate = offline_acceptance(model, lambda tokens, hidden: mtp_logits(weights["planted"], tokens, hidden))
    print(f"offline acceptance per draft (k = 1): {rate:.3f}")
    assert rate >= MIN_OFFLINE_ACCEPTANCE


def test_the_recipe_is_part_of_the_cache_digest(monkeypatch):
    before = tm._config_digest(FAMILY)
    monkeypatch.setitem(qwen3_next_family.PLANTED_RECIPE, "version", qwen3_next_family.PLANTED_RECIPE["version"] + 1)
    assert tm._config_digest(FAMILY) != before
    # Families without a recipe keep the digest of their config alone (cached directories stay valid).
    import hashlib

    config = families.FAMILIES["qwen3_next_mtp"].hf_config().to_json_string()
    assert tm._config_digest("qwen3_next_mtp") == hashlib.sha256(config.encode()).hexdigest()[:16]
