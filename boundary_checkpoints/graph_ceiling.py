"""The CUDA graph ceiling under boundary checkpoints (``graph_ceiling_tokens``).

Contract: restored requests compute few tokens (a next turn: its new message and the previous
answer), so several arriving together make a step of a few hundred to a thousand tokens, which
runs eagerly past vLLM's largest CUDA graph (512 tokens by default on Hopper). Where the user set
no capture size, :func:`raise_graph_ceiling` raises that ceiling to ``graph_ceiling_tokens``
(``auto``: 1,024, vLLM's own default on Blackwell) and has vLLM recompute its capture sizes, as
vLLM does itself for GPT-OSS. It leaves the config as vLLM made it under speculative decoding
(vLLM's default then adds decode sizes that an explicit ceiling would drop), without graphs for
mixed batches, where the ceiling already reaches the target, and where no step has more tokens
than it (``max_num_batched_tokens``). Where vLLM's sizing raises, vLLM's own sizes are put back.
The log says what it did.
"""

from __future__ import annotations

from typing import Any

AUTO_CEILING_TOKENS = 1024
CAPTURE_SIZE_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def user_set_capture_sizes(vllm_config: Any) -> bool:
    """True when the config, before vLLM finalizes it, names a CUDA graph capture size or ceiling."""
    compilation = getattr(vllm_config, "compilation_config", None)
    return any(getattr(compilation, name, None) is not None for name in CAPTURE_SIZE_FIELDS)


def target_ceiling(setting: int | str) -> int:
    """The ceiling ``graph_ceiling_tokens`` asks for (0: vLLM's own)."""
    return AUTO_CEILING_TOKENS if setting == "auto" else int(setting)


def raise_graph_ceiling(vllm_config: Any, setting: int | str, user_set: bool, logger: Any) -> None:
    """Raise ``vllm_config``'s CUDA graph ceiling to ``setting``'s target where the rules above
    allow, and say so on ``logger`` (INFO; WARNING where vLLM refused it)."""
    from boundary_checkpoints.compat import mixed_batch_graph_ceiling, recompute_cuda_graph_sizes

    target = target_ceiling(setting)
    ceiling = mixed_batch_graph_ceiling(vllm_config)
    if user_set or target == 0 or ceiling == 0 or ceiling >= target:
        return
    if int(getattr(vllm_config, "uniform_decode_query_len", 1)) > 1:
        return
    step_limit = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
    if step_limit is not None and step_limit <= ceiling:
        return  # no step is larger than vLLM's graphs already
    compilation = vllm_config.compilation_config
    vllms = (compilation.max_cudagraph_capture_size, list(compilation.cudagraph_capture_sizes))
    compilation.max_cudagraph_capture_size, compilation.cudagraph_capture_sizes = target, None
    try:
        recompute_cuda_graph_sizes(vllm_config)
    except Exception as error:  # vLLM refused the ceiling: its own sizes stand
        compilation.max_cudagraph_capture_size, compilation.cudagraph_capture_sizes = vllms
        logger.warning(
            "boundary_checkpoints: CUDA graphs left at vLLM's %d tokens: raising them failed (%r)", ceiling, error
        )
        return
    logger.info(
        "boundary_checkpoints: CUDA graphs up to %d tokens (vLLM's default here: %d), so a step of restored next "
        "turns arriving together replays a graph (graph_ceiling_tokens; 0 keeps vLLM's)",
        mixed_batch_graph_ceiling(vllm_config),
        ceiling,
    )
