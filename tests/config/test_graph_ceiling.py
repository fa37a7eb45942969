"""The CUDA graph ceiling under boundary checkpoints (``graph_ceiling.py``): raised to 1,024 tokens
where the user set no capture size, with vLLM's own sizing (``VllmConfig._set_cudagraph_sizes``,
run on a stand-in config that borrows it) recomputing the capture list; left as vLLM made it
where the user set one, under speculative decoding, without graphs, or at ``graph_ceiling_tokens``
0. A CPU engine replays no graphs, so these are the checks the CPU can run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gate_fakes import RecordingLogger, supported_fake
from vllm.config import VllmConfig
from vllm.config.compilation import CompilationConfig, CUDAGraphMode

from boundary_checkpoints.compat import mixed_batch_graph_ceiling
from boundary_checkpoints.graph_ceiling import raise_graph_ceiling, user_set_capture_sizes
from boundary_checkpoints.settings import CONFIG_KEY


class StandInConfig:
    """The fields vLLM's capture sizing reads, and that sizing itself (vLLM's method)."""

    _set_cudagraph_sizes = VllmConfig._set_cudagraph_sizes

    def __init__(self, *, max_num_seqs=256, max_num_batched_tokens=8192, decode_query_len=1, **compilation):
        self.compilation_config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, **compilation)
        self.user_set = user_set_capture_sizes(self)  # read before vLLM fills its defaults in
        self.model_config = SimpleNamespace(enforce_eager=False)
        self.scheduler_config = SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        self.speculative_config = None
        self.performance_mode = "throughput"
        self.uniform_decode_query_len = decode_query_len
        self._set_cudagraph_sizes()  # vLLM's default, as its __post_init__ runs it


def test_the_ceiling_rises_to_1024_where_the_user_set_none():
    config = StandInConfig()
    assert mixed_batch_graph_ceiling(config) == 512  # vLLM's default on Hopper at 256 sequences
    logger = RecordingLogger()
    raise_graph_ceiling(config, "auto", config.user_set, logger)
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert mixed_batch_graph_ceiling(config) == 1024
    assert sizes[-1] == 1024 and 512 in sizes and 808 not in sizes and 816 in sizes
    [(level, line)] = logger.calls
    assert level == "info" and "up to 1024 tokens (vLLM's default here: 512)" in line


def test_the_ceiling_follows_the_setting_and_vllms_batch_limit():
    config = StandInConfig()
    raise_graph_ceiling(config, 768, config.user_set, RecordingLogger())
    assert mixed_batch_graph_ceiling(config) == 768
    small_batches = StandInConfig(max_num_batched_tokens=600)
    raise_graph_ceiling(small_batches, "auto", small_batches.user_set, RecordingLogger())
    assert mixed_batch_graph_ceiling(small_batches) == 600  # vLLM caps graphs at a step's tokens


@pytest.mark.parametrize(
    ("config", "setting"),
    [
        (StandInConfig(max_cudagraph_capture_size=512), "auto"),  # the user's ceiling
        (StandInConfig(cudagraph_capture_sizes=[1, 2, 4, 8]), "auto"),  # the user's sizes
        (StandInConfig(), 0),  # vLLM's ceiling asked for
        (StandInConfig(max_num_seqs=1024, max_num_batched_tokens=2048, max_cudagraph_capture_size=1024), "auto"),
        (StandInConfig(decode_query_len=4), "auto"),  # speculative decoding: vLLM's decode sizes stay
        (StandInConfig(max_num_batched_tokens=512), "auto"),  # no step past vLLM's graphs
    ],
    ids=["user_ceiling", "user_sizes", "setting_0", "already_1024", "speculative", "small_steps"],
)
def test_the_config_stays_as_vllm_made_it(config, setting):
    before = list(config.compilation_config.cudagraph_capture_sizes)
    logger = RecordingLogger()
    raise_graph_ceiling(config, setting, config.user_set, logger)
    assert config.compilation_config.cudagraph_capture_sizes == before and logger.calls == []


def test_no_graphs_for_mixed_batches_no_ceiling_to_raise():
    eager = StandInConfig()
    eager.model_config.enforce_eager = True
    decode_only = StandInConfig()
    decode_only.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    for config in (eager, decode_only):
        logger = RecordingLogger()
        raise_graph_ceiling(config, "auto", False, logger)
        assert config.compilation_config.max_cudagraph_capture_size == 512 and logger.calls == []


def _engine_config(policy: str) -> StandInConfig:
    """A stand-in the plugin's policy gate accepts (``gate_fakes``), with vLLM's capture sizing."""
    config = StandInConfig()
    gate_view = supported_fake()
    for section in ("cache_config", "parallel_config", "kv_transfer_config", "lora_config"):
        setattr(config, section, getattr(gate_view, section))
    config.model_config = SimpleNamespace(**vars(gate_view.model_config), enforce_eager=False)
    config.scheduler_config.scheduler_cls, config.scheduler_config.async_scheduling = None, False
    config.parallel_config.worker_cls = "vllm.v1.worker.cpu_worker.CPUWorker"
    config.additional_config = {CONFIG_KEY: {"policy": policy}}
    return config


def test_the_plugin_raises_the_ceiling_only_where_it_turns_boundaries_on_and_no_size_was_set():
    from boundary_checkpoints import plugin

    enabled, user_sized, stock = _engine_config("auto"), _engine_config("auto"), _engine_config("aligned")
    plugin.apply_policy(enabled, False)
    plugin.apply_policy(user_sized, True)
    plugin.apply_policy(stock, False)
    assert enabled.scheduler_config.scheduler_cls is not None  # boundary retention is on
    assert [mixed_batch_graph_ceiling(c) for c in (enabled, user_sized, stock)] == [1024, 512, 512]


def test_where_vllms_sizing_refuses_the_ceiling_its_own_sizes_stand(monkeypatch):
    config = StandInConfig()
    before = list(config.compilation_config.cudagraph_capture_sizes)

    def refuse(self):
        self.compilation_config.cudagraph_capture_sizes = [1]  # a half-done sizing, then the error
        raise ValueError("no such size")

    monkeypatch.setattr(StandInConfig, "_set_cudagraph_sizes", refuse)
    logger = RecordingLogger()
    raise_graph_ceiling(config, "auto", False, logger)
    [(level, line)] = logger.calls
    assert level == "warning" and "left at vLLM's 512 tokens" in line and "no such size" in line
    assert config.compilation_config.cudagraph_capture_sizes == before
    assert mixed_batch_graph_ceiling(config) == 512
