"""Fakes the policy gate's tests share (``tests/config/test_gate_policy.py``,
``test_gate_speculative.py``, ``test_gate_startup.py``): a ``SimpleNamespace`` look-alike of
``VllmConfig`` on which boundary retention is supported, a logger that records its calls, and the
plugin's CPU worker class."""

from __future__ import annotations

from types import SimpleNamespace

PLUGIN_WORKER = "boundary_checkpoints.worker.cpu.BoundaryCPUWorker"


def supported_fake(**overrides) -> SimpleNamespace:
    """A VllmConfig look-alike on which boundary retention is supported; ``section__attr=value``
    keyword arguments override one attribute of one section."""
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(
            is_hybrid=True,
            enable_prompt_embeds=False,
            is_multimodal_model=False,
            multimodal_config=None,
            is_encoder_decoder=False,
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
        ),
        kv_transfer_config=None,
        speculative_config=None,
        lora_config=None,
    )
    for name, value in overrides.items():
        section, _, attr = name.partition("__")
        if attr:
            setattr(getattr(cfg, section), attr, value)
        else:
            setattr(cfg, section, value)
    return cfg


class RecordingLogger:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def info(self, msg, *args):
        self.calls.append(("info", msg % args))

    def warning(self, msg, *args):
        self.calls.append(("warning", msg % args))
