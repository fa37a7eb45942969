"""The tiny-model fixture: deterministic bytes, intended layer layout, a usable tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from bc_tools.fixtures import tiny_models as tm

MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Seed 0 twice and seed 1 once, each in its own fresh directory."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": tm.make_tiny_model(root / "seed0_a", seed=0),
        "b": tm.make_tiny_model(root / "seed0_b", seed=0),
        "c": tm.make_tiny_model(root / "seed1", seed=1),
    }


def test_same_seed_gives_identical_bytes(built):
    for name in MODEL_FILES + [tm.MARKER_NAME]:
        a, b = built["a"] / name, built["b"] / name
        assert a.is_file(), name
        assert a.read_bytes() == b.read_bytes(), f"{name} differs between two seed-0 builds"


def test_different_seed_gives_different_weights(built):
    from safetensors.torch import load_file

    w0 = load_file(str(built["a"] / "model.safetensors"))
    w1 = load_file(str(built["c"] / "model.safetensors"))
    assert w0.keys() == w1.keys()
    randomly_initialised = [k for k in w0 if w0[k].float().std() > 0]
    assert randomly_initialised
    assert any(not (w0[k] == w1[k]).all() for k in randomly_initialised)
    # The tokenizer and config do not depend on the seed.
    for name in ("config.json", "tokenizer.json"):
        assert (built["a"] / name).read_bytes() == (built["c"] / name).read_bytes()


def test_weights_are_bf16_and_small(built):
    from safetensors.torch import load_file

    weights = load_file(str(built["a"] / "model.safetensors"))
    import torch

    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    n_params = sum(t.numel() for t in weights.values())
    assert 2_000_000 < n_params < 6_000_000


def test_config_has_intended_layer_types(built):
    config = json.loads((built["a"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["model_type"] == "qwen3_next"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    expected = {
        "vocab_size": 1024,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
    }
    assert {k: config.get(k) for k in expected} == expected


def test_reuses_complete_directory_and_rebuilds_other_seed(built, tmp_path):
    target = tmp_path / "m"
    tm.make_tiny_model(target, seed=0)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert tm.make_tiny_model(target, seed=0) == target.resolve()
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # skipped
    assert tm.is_complete(target, seed=0) and tm.verify(target)

    tm.make_tiny_model(target, seed=1)  # another seed rebuilds in place
    assert tm.read_marker(target)["seed"] == 1
    assert not tm.is_complete(target, seed=0)
    assert (target / "model.safetensors").read_bytes() == (built["c"] / "model.safetensors").read_bytes()


def test_truncated_file_is_not_complete(built, tmp_path):
    target = tm.make_tiny_model(tmp_path / "m", seed=0)
    (target / "model.safetensors").write_bytes(b"broken")
    assert not tm.is_complete(target, seed=0)
    tm.make_tiny_model(target, seed=0)
    assert tm.verify(target)


def test_unknown_family_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny-model family"):
        tm.make_tiny_model(tmp_path / "x", family="no_such_family")


def test_tokenizer_loads_and_round_trips_ids(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built["a"]))
    assert len(tok) == tm.VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 3, 0)

    rng = random.Random(7)
    ids = [rng.randrange(0, tm.VOCAB_SIZE) for _ in range(500)]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids

    words = tok.encode("w8 w9 system w1023", add_special_tokens=False)
    assert words == [8, 9, 4, 1023]


def test_chat_template_renders_roles(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built["a"]))
    messages = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w12"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert ids == [1, 4, 10, 11, 2, 1, 5, 12, 2, 1, 6]


def test_cli_writes_model(tmp_path, capsys):
    assert tm.main([str(tmp_path / "cli"), "--seed", "0"]) == 0
    assert "written" in capsys.readouterr().out
    assert tm.main([str(tmp_path / "cli"), "--seed", "0"]) == 0
    assert "already complete" in capsys.readouterr().out


def test_mtp_family_adds_one_mtp_layer_to_the_same_base_weights(built, tmp_path):
    """``qwen3_next_mtp``: the seed-0 base weights unchanged, plus the tensors vLLM's
    ``Qwen3NextMTP`` loads (``mtp.fc``, its norms, one decoder layer shaped like layer 3)."""
    from safetensors.torch import load_file

    target = tm.make_tiny_model(tmp_path / "mtp", family="qwen3_next_mtp", seed=0)
    weights = load_file(str(target / "model.safetensors"))
    base = load_file(str(built["a"] / "model.safetensors"))
    assert all((weights[name] == tensor).all() for name, tensor in base.items())
    extra = {name: tensor.shape for name, tensor in weights.items() if name not in base}
    assert all(name.startswith("mtp.") for name in extra)
    assert extra["mtp.fc.weight"] == (256, 512)
    layer = {name[len("model.layers.3.") :]: t.shape for name, t in base.items() if name.startswith("model.layers.3.")}
    assert {name[len("mtp.layers.0.") :]: s for name, s in extra.items() if name.startswith("mtp.layers.0.")} == layer
    assert {"mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"} <= set(extra)
    config = json.loads((target / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert tm.read_marker(target)["family"] == "qwen3_next_mtp" and tm.verify(target)
