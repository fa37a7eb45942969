"""The ``glm5_next_mtp_planted`` fixture (``fixtures/glm5_next_family.py``): a tiny GLM-5.3-Flash whose one
MTP layer predicts the target's greedy answers, so that speculative decoding accepts drafts (the
GPU test of GLM under MTP, ``tests/gpu/test_gpu_families_mtp.py``, then crosses boundaries with
accepted drafts; the random ``glm5_next_mtp`` drafter has none accepted on a GPU).

Checked without an engine, mirroring ``tests/tools/test_planted_mtp.py``: the target differs from
``glm5_next_mtp`` in the embedding (exactly ``embed_scale`` = 32x) and ``lm_head`` only; vLLM's GLM MTP forward,
re-implemented here in float32 from ``models/glm5next/common/mtp.py``
(``Glm5NextMultiTokenPredictorLayer.forward``), drafts the planted successor of every token; and on
greedy answers of the target the drafts are right at least ``MIN_OFFLINE_ACCEPTANCE`` of the time --
the acceptance rate per draft at ``k = 1``. Each check is also run on ``glm5_next_mtp``, where it
must fail (negative control).

The target runs in float32 on transformers' GLM-5.3-Flash layers, but not through transformers'
model forward: transformers' ``Glm5NextTextModel`` always runs mHC (its decoder layers mix
``hc_mult`` residual streams through ``attn_hc`` / ``ffn_hc``; it has no ``mhc`` switch), while the
fixture says ``mhc: false`` and vLLM then runs a plain pre-norm residual (``Glm5NextDecoderLayer``,
``not self.mhc``). :func:`target_hidden` therefore calls each transformers layer's ``self_attn``
(KDA, or sparse MLA with the kpool indexer) and ``mlp`` with vLLM's plain residual wiring. Prompts
and answers stay far below ``index_topk`` (2048), where the indexer selects every key.
"""

from __future__ import annotations

import pytest

from bc_tools.fixtures import family_spec, glm5_next_family, qwen3_next_family
from bc_tools.fixtures import tiny_models as tm

FAMILY = "glm5_next_mtp_planted"
BASE = "glm5_next_mtp"
MTP = f"model.layers.{glm5_next_family.GLM_MTP_LAYER}."
# Measured 0.765 = 303/396 (seed 0, 36 greedy answers of 12 tokens after random prompts of 1, 40 and 97
# tokens; the 12 drafts at position 0 of the 1-token prompts cannot follow). glm5_next_mtp: 0/56.
MIN_OFFLINE_ACCEPTANCE = 0.6


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted_glm")
    return {"base": tm.make_tiny_model(root / "base", family=BASE),
            "planted": tm.make_tiny_model(root / "planted", family=FAMILY)}  # fmt: skip


def rms_norm(x, weight, eps=1e-5):
    """vLLM's ``RMSNorm`` (GLM's ``rms_norm_eps`` 1e-5): scales by ``weight``."""
    import torch

    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def mtp_logits(w: dict, next_tokens, hidden, positions, check_writers: bool = True):
    """vLLM's ``Glm5NextMTP`` draft logits for rows ``(hidden[r], next_tokens[r])`` at target
    positions ``positions[r]``, in float32.

    ``Glm5NextMultiTokenPredictorLayer.forward``: ``fused_eh_norm`` (the embedding zeroed at
    position 0, ``cat(enorm(embed(t)), hnorm(h))``), ``eh_proj``, one ``Glm5NextDecoderLayer`` run as
    an MTP layer (it returns the MLP output and the residual unsummed: attention added to the
    residual, then the dense MLP), ``shared_head.norm`` over their sum; then the shared ``lm_head``
    (``defer_lm_head``). The fixture's decoder layer writes nothing -- MLA ``o_proj`` and the MLP's
    ``down_proj`` are zero, so both branches add exact zeros -- which is asserted, not assumed
    (``check_writers``); the block is then the identity and its attention and indexer do not matter."""
    import torch

    f = {name: tensor.float() for name, tensor in w.items()}
    if check_writers:
        writers = [MTP + "self_attn.o_proj.weight", MTP + "mlp.down_proj.weight"]
        assert all(not f[name].any() for name in writers), "the MTP block writes to the residual"
    embedded = f[MTP + "embed_tokens.weight"][next_tokens]
    embedded = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(embedded), embedded)
    eh_input = torch.cat([rms_norm(embedded, f[MTP + "enorm.weight"]), rms_norm(hidden, f[MTP + "hnorm.weight"])], -1)
    residual = eh_input @ f[MTP + "eh_proj.weight"].T
    return rms_norm(residual, f[MTP + "shared_head.norm.weight"]) @ f["lm_head.weight"].T


def load_target(model_dir):
    """transformers' ``Glm5NextTextModel`` in float32 with the checkpoint's text tensors (the names
    transformers' ``glm5_next`` conversion mapping would give them: ``model.language_model.`` is
    dropped, KDA's forget-gate tensors move under ``forget_gate.``, its q/k/v convolutions are
    concatenated into ``conv1d``), plus ``lm_head``. Its mHC tensors, which the checkpoint lacks,
    stay as drawn and are never used (:func:`target_hidden`)."""
    import torch
    from safetensors.torch import load_file
    from transformers import Glm5NextTextModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = glm5_next_family.glm5_next_hf_config().text_config
    model = Glm5NextTextModel(config).float().eval()
    w = {name: t.float() for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    state = {}
    for name, tensor in w.items():
        if not name.startswith("model.") or name.startswith(MTP):
            continue
        name = name[len("model.") :]
        for part in ("A_log", "dt_bias", "f_a_proj", "f_b_proj"):
            name = name.replace(f"self_attn.{part}", f"self_attn.forget_gate.{part}")
        if name.endswith("self_attn.q_conv1d.weight"):
            stem = name[: -len("q_conv1d.weight")]
            tensor = torch.cat([w[f"model.{stem}{x}_conv1d.weight"] for x in "qkv"], 0)
            name = stem + "conv1d.weight"
        elif name.endswith(("self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight")):
            continue
        state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("_hc." in name for name in missing), (missing, unexpected)
    return model, w["lm_head.weight"]


def target_hidden(model, ids):
    """The target's final hidden states (after ``model.norm``) of ``ids`` ``[B, S]``, as vLLM's
    ``Glm5NextDecoderLayer`` computes them with ``mhc`` off: per layer ``h += self_attn(
    input_layernorm(h))``, ``h += mlp(post_attention_layernorm(h))``."""
    import torch

    mask = torch.ones(ids.shape, dtype=torch.bool)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    h = model.embed_tokens(ids)
    for layer in model.layers[: model.config.num_hidden_layers]:
        x = layer.input_layernorm(h)
        if layer.block_type == "linear_attention":
            a = layer.self_attn(hidden_states=x, cache_params=None, attention_mask=mask)
        else:
            a = layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=positions, past_key_values=None,
                                position_embeddings=None, prev_topk_indices=None)[0]  # fmt: skip
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def greedy(model, lm_head, prompts, new_tokens):
    """Greedy answers (no cache: the whole sequence again per token); returns the ids and the final
    hidden states of the whole sequence."""
    import torch

    ids = prompts
    with torch.no_grad():
        for _ in range(new_tokens):
            hidden = target_hidden(model, ids)
            ids = torch.cat([ids, (hidden[:, -1] @ lm_head.T).argmax(-1, keepdim=True)], 1)
        return ids, target_hidden(model, ids)


def offline_acceptance(model_dir, w, lengths=(1, 40, 97), batch=12, new_tokens=12):
    """Acceptance per draft at ``k = 1`` on greedy answers of random prompts: each answer token
    after the first was drafted from the previous row's target hidden state and token (vLLM's MTP
    row ``r`` is ``f(h[r], t[r + 1])`` at position ``r`` and drafts ``t[r + 2]``)."""
    import torch

    model, lm_head = load_target(model_dir)
    generator = torch.Generator().manual_seed(1)
    accepted = drafted = 0
    for length in lengths:
        prompts = torch.randint(4, family_spec.VOCAB_SIZE, (batch, length), generator=generator)
        ids, hidden = greedy(model, lm_head, prompts, new_tokens)
        rows = torch.arange(length - 1, ids.shape[1] - 2)  # rows whose drafted token is an answer token
        drafts = mtp_logits(w, ids[:, rows + 1], hidden[:, rows], rows, check_writers=False).argmax(-1)
        accepted += int((drafts == ids[:, rows + 2]).sum())
        drafted += drafts.numel()
    return accepted, drafted


def test_target_differs_from_glm5_next_mtp_in_embedding_and_lm_head_only(weights):
    import torch

    base, planted = weights["base"], weights["planted"]
    assert set(base) == set(planted)
    changed = sorted(name for name in base if not torch.equal(base[name], planted[name]))
    target_changed = [name for name in changed if not name.startswith(MTP)]
    assert target_changed == ["lm_head.weight", "model.embed_tokens.weight"]
    scale = glm5_next_family.GLM_PLANTED_RECIPE["embed_scale"]
    assert torch.equal(planted["model.embed_tokens.weight"], base["model.embed_tokens.weight"] * scale)  # exact
    assert torch.equal(planted[MTP + "embed_tokens.weight"], planted["model.embed_tokens.weight"])
    # The MTP layer: only the tensors the closed form sets (and its embedding copy) changed.
    assert [name[len(MTP):] for name in changed if name.startswith(MTP)] == [
        "eh_proj.weight", "embed_tokens.weight", "mlp.down_proj.weight", "self_attn.o_proj.weight"]  # fmt: skip


def test_mtp_drafts_the_planted_successor_of_every_token(weights):
    import torch

    successor = qwen3_next_family.planted_successor(0)
    tokens = torch.arange(family_spec.VOCAB_SIZE)
    hidden = torch.randn(len(tokens), 256, generator=torch.Generator().manual_seed(0))
    positions = torch.full_like(tokens, 5)
    drafts = mtp_logits(weights["planted"], tokens, hidden, positions).argmax(-1)
    wrong = tokens[drafts != successor].tolist()
    assert wrong == [family_spec.PAD_ID], wrong  # the pad's embedding is zero: no successor to read
    # vLLM zeroes the embedding at position 0: nothing is read there (the draft does not follow).
    at_zero = mtp_logits(weights["planted"], tokens, hidden, torch.zeros_like(tokens)).argmax(-1)
    assert (at_zero == successor).float().mean() < 0.01
    # Negative control: the random drafter of glm5_next_mtp does not know the successor.
    with pytest.raises(AssertionError, match="writes to the residual"):
        mtp_logits(weights["base"], tokens, hidden, positions)
    unplanted = mtp_logits(weights["base"], tokens, hidden, positions, check_writers=False).argmax(-1)
    assert (unplanted == successor).float().mean() < 0.01


def test_drafts_are_accepted_on_the_targets_greedy_answers(dirs, weights):
    accepted, drafted = offline_acceptance(dirs["planted"], weights["planted"])
    rate = accepted / drafted
    print(f"offline acceptance per draft (k = 1): {accepted}/{drafted} = {rate:.3f}")
    assert rate >= MIN_OFFLINE_ACCEPTANCE
    # Negative control: glm5_next_mtp's random drafter on its own target's answers.
    accepted, drafted = offline_acceptance(dirs["base"], weights["base"], lengths=(40,), batch=8, new_tokens=8)
    print(f"glm5_next_mtp offline acceptance: {accepted}/{drafted}")
    assert accepted / drafted < MIN_OFFLINE_ACCEPTANCE / 4


def test_the_recipe_is_part_of_the_cache_digest(monkeypatch):
    before = tm._config_digest(FAMILY)
    monkeypatch.setitem(
        glm5_next_family.GLM_PLANTED_RECIPE, "version", glm5_next_family.GLM_PLANTED_RECIPE["version"] + 1
    )
    assert tm._config_digest(FAMILY) != before
    assert tm._config_digest(BASE) != tm._config_digest(FAMILY)
