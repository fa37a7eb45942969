"""The GPU-only tiny families (GLM-5.3-Flash, Kimi-Linear, Nemotron-H), checked on CPU as far as
vLLM 0.32 goes without an engine: vLLM parses each config.json into the layer layout intended, the
architecture is registered, and vLLM's own loader places every checkpoint tensor and sets every
element of every parameter. Nemotron-H's model class builds on CPU as it is; GLM's and Kimi's
build on CPU behind ``family_weights.cpu_shims`` (a stand-in for Kimi's aux CUDA stream, a
torchvision import stub for GLM's module, the dense CPU MLA backend for GLM's sparse MLA layer:
none touches a parameter), and the same check runs unshimmed on the GPU host (``gpu``-marked).
``glm5_next_mtp`` (GLM plus one MTP layer) is checked the same way for both of vLLM's classes that
read its checkpoint: the target ``Glm5NextForCausalLM`` and the drafter ``Glm5NextMTP``
(``family_weights.py --mtp``: built as vLLM's proposer builds it, under ``method="mtp"``).
Building the four fixtures takes a few seconds, each loader check ~10 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bc_tools.fixtures import tiny_models as tm
from bc_tools.fixtures.families import FAMILIES

NEW_FAMILIES = ("glm5_next", "kimi_linear", "nemotron_h")
BUILT = (*NEW_FAMILIES, "glm5_next_mtp", "nemotron_h_mtp")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: tm.make_tiny_model(root / family, family=family) for family in BUILT}


def vllm_hf_config(model_dir: Path):
    from vllm.transformers_utils.config import get_config

    return get_config(str(model_dir), trust_remote_code=False)


def test_files_tokenizer_and_determinism(family_dirs, tmp_path):
    for family, path in family_dirs.items():
        marker = tm.read_marker(path)
        assert marker["architecture"] == FAMILIES[family].architecture
        assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(marker["files"])
        assert json.loads((path / "config.json").read_text())["architectures"] == [FAMILIES[family].architecture]
    again = tm.make_tiny_model(tmp_path / "again", family="nemotron_h")
    assert (again / "model.safetensors").read_bytes() == (family_dirs["nemotron_h"] / "model.safetensors").read_bytes()


def test_glm5_next_config_parses_to_kda_and_sparse_mla(family_dirs):
    config = vllm_hf_config(family_dirs["glm5_next"])
    assert config.model_type == "glm5_next_text"
    assert config.layer_types == ["linear_attention"] * 3 + ["indexed_attention"]
    assert (config.index_kpool, config.index_topk, config.index_head_dim, config.index_n_heads) == (4, 2048, 128, 32)
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.mhc, config.mla_use_nope) == (512, 0, False, True)
    assert config.index_topk % config.index_kpool == 0 and config.index_kpool_always_select_tail


def test_glm5_next_mtp_is_glm5_next_plus_one_mtp_layer(family_dirs):
    """Same base tensors, byte for byte; the rest is one MTP layer at ``model.layers.4.``; the
    config vLLM parses is the same text model with ``num_nextn_predict_layers`` 1 (nested under
    ``glm5_next``, which vLLM's MTP path needs: ``glm5_next_family.glm5_next_mtp_config``)."""
    import torch
    from safetensors.torch import load_file

    base = load_file(str(family_dirs["glm5_next"] / "model.safetensors"))
    mtp = load_file(str(family_dirs["glm5_next_mtp"] / "model.safetensors"))
    assert set(base) < set(mtp) and all(torch.equal(base[name], mtp[name]) for name in base)
    extra = set(mtp) - set(base)
    assert all(name.startswith("model.layers.4.") for name in extra), sorted(extra)
    layer3 = {name[len("model.layers.3.") :] for name in base if name.startswith("model.layers.3.")}
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight"}
    assert {name[len("model.layers.4.") :] for name in extra} == layer3 | own
    assert mtp["model.layers.4.eh_proj.weight"].shape == (256, 512)
    config = vllm_hf_config(family_dirs["glm5_next_mtp"])
    assert config.model_type == "glm5_next"
    text, base_text = config.get_text_config(), vllm_hf_config(family_dirs["glm5_next"])
    assert text.num_nextn_predict_layers == 1 and base_text.num_nextn_predict_layers == 0
    for field in ("layer_types", "mlp_layer_types", "index_topk", "index_kpool", "kv_lora_rank", "mhc", "mla_use_nope"):
        assert getattr(text, field) == getattr(base_text, field), field


def test_kimi_linear_config_parses_with_vllms_own_class(family_dirs):
    config = vllm_hf_config(family_dirs["kimi_linear"])
    assert type(config).__module__.startswith("vllm.")  # vLLM's KimiLinearConfig, not transformers'
    assert [config.is_kda_layer(i) for i in range(4)] == [True, True, True, False]
    assert config.kv_lora_rank + config.qk_rope_head_dim == 576 and config.mla_use_nope
    # The fused Kimi-K3 MLA prefill/decode kernel's fixed dims (q_nope, q_rope, v, latent); qk_nope
    # 64 fails it on CUDA. The kernel cannot be imported on CPU, hence the literal.
    dims = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank)
    assert dims == (128, 64, 128, 512)
    assert not config.is_moe


def test_nemotron_h_config_parses_to_mamba2_and_attention(family_dirs):
    config = vllm_hf_config(family_dirs["nemotron_h"])
    assert config.hybrid_override_pattern == "M*M-"
    assert (config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size) == (8, 64, 1, 64)


def test_nemotron_h_mtp_is_nemotron_h_plus_one_attention_mtp_layer(family_dirs):
    """The same base tensors byte for byte, and one MTP layer of pattern ``*`` that vLLM's
    speculative config turns into its ``NemotronHMTPModel`` drafter."""
    from safetensors.torch import load_file
    from vllm.config.speculative import SpeculativeConfig

    base = load_file(str(family_dirs["nemotron_h"] / "model.safetensors"))
    mtp = load_file(str(family_dirs["nemotron_h_mtp"] / "model.safetensors"))
    assert {name for name in mtp if not name.startswith("mtp.")} == set(base)
    assert all(bool((mtp[name] == tensor).all()) for name, tensor in base.items())
    assert {name for name in mtp if name.startswith("mtp.layers.0.mixer.")} == {
        f"mtp.layers.0.mixer.{p}_proj.weight" for p in "qkvo"
    }
    config = vllm_hf_config(family_dirs["nemotron_h_mtp"])
    assert (config.num_nextn_predict_layers, config.mtp_hybrid_override_pattern) == (1, "*")
    assert SpeculativeConfig.hf_config_override(config).architectures == ["NemotronHMTPModel"]


def test_architectures_are_registered():
    from vllm.model_executor.models.registry import ModelRegistry

    assert {FAMILIES[f].architecture for f in NEW_FAMILIES} <= set(ModelRegistry.get_supported_archs())


def loader_report(model_dir: Path, cpu_shims: bool = False, mtp: bool = False) -> dict:
    script = Path(__file__).resolve().parents[1] / "helpers" / "family_weights.py"
    command = [sys.executable, str(script), str(model_dir)] + (["--cpu-shims"] if cpu_shims else [])
    command += ["--mtp"] if mtp else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_loader(model_dir: Path, architecture: str, cpu_shims: bool = False, mtp: bool = False) -> None:
    """``mtp``: the drafter's class instead, and every element of its checkpoint tensors landed in
    a parameter (a tensor its loader skips, e.g. a ``.bias`` the model lacks, makes the counts differ)."""
    report = loader_report(model_dir, cpu_shims, mtp)
    assert report["architecture"] == architecture
    assert report["parameters"] > 0, report
    assert (report["not_loaded"], report["unknown"], report["unset"]) == ([], [], []), report
    if mtp:
        assert report["mtp_tensor_elements"] == report["parameter_elements"] > 0, report


def test_vllm_loader_takes_nemotron_h_weights(family_dirs):
    check_loader(family_dirs["nemotron_h"], "NemotronHForCausalLM")


@pytest.mark.parametrize("mtp", [False, True], ids=["target", "drafter"])
def test_vllm_loader_takes_nemotron_h_mtp_weights(family_dirs, mtp):
    """The target skips the ``mtp.`` tensors; vLLM's ``NemotronHMTP`` takes them all (with the
    embedding and the head): a misspelt name is skipped and changes the element count, a missing
    one leaves a parameter NaN."""
    architecture = "NemotronHMTPModel" if mtp else "NemotronHForCausalLM"
    check_loader(family_dirs["nemotron_h_mtp"], architecture, mtp=mtp)


@pytest.mark.parametrize("family", ["glm5_next", "kimi_linear"])
def test_vllm_loader_takes_mla_family_weights_on_cpu(family_dirs, family):
    """vLLM's own model class and ``load_weights``, built on CPU behind the shims: a tensor name the
    model does not declare raises (``KeyError``, as on CUDA for GLM's mHC tensors and
    Kimi's dense MLPs under ``block_sparse_moe.``), a shape that differs raises, a parameter or
    shard left unwritten is reported."""
    check_loader(family_dirs[family], FAMILIES[family].architecture, cpu_shims=True)


@pytest.mark.parametrize("mtp", [False, True], ids=["target", "drafter"])
def test_vllm_loader_takes_glm5_next_mtp_weights_on_cpu(family_dirs, mtp):
    """The MTP fixture through both classes, on CPU behind the shims: the target skips the MTP
    layer's tensors; ``Glm5NextMTP`` (``Glm5NextMTPModel``, vLLM's rewrite of a ``glm5_next``
    config under ``method="mtp"``) takes them all, under its names (``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` on the layer, the decoder under ``mtp_block.``, the embedding
    as ``model.embed_tokens``): a misspelt name raises ``KeyError``, a skipped one changes the
    element count, a missing one leaves a parameter NaN."""
    architecture = "Glm5NextMTPModel" if mtp else FAMILIES["glm5_next_mtp"].architecture
    check_loader(family_dirs["glm5_next_mtp"], architecture, cpu_shims=True, mtp=mtp)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["glm5_next", "kimi_linear"])
def test_vllm_loader_takes_mla_family_weights(family_dirs, family):
    check_loader(family_dirs[family], FAMILIES[family].architecture)


@pytest.mark.gpu
@pytest.mark.parametrize("mtp", [False, True], ids=["target", "drafter"])
def test_vllm_loader_takes_glm5_next_mtp_weights(family_dirs, mtp):
    architecture = "Glm5NextMTPModel" if mtp else FAMILIES["glm5_next_mtp"].architecture
    check_loader(family_dirs["glm5_next_mtp"], architecture, mtp=mtp)
