"""The plugin's one wrapper around a vLLM function: ``VllmConfig.__post_init__``.

Contract: vLLM has no hook that lets a general plugin see the final engine config, so
:func:`install_vllm_config_hook` wraps ``__post_init__`` once per process and runs a callback after
it, with what an optional ``remember`` read of the config as the user gave it, before vLLM filled
in its defaults. It imports only vLLM's public ``vllm.config``, so it serves on a vLLM version the plugin does
not support too, where ``compat`` (vLLM's internals) may not import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig

_HOOK_MARK = "_boundary_checkpoints_hook"


def install_vllm_config_hook(
    apply: Callable[[VllmConfig, Any], None], remember: Callable[[VllmConfig], Any] = lambda config: None
) -> None:
    """Run ``apply(config, remember(config))`` around every ``VllmConfig.__post_init__``:
    ``remember`` before it, ``apply`` after it (idempotent per process)."""
    original = VllmConfig.__post_init__
    if getattr(original, _HOOK_MARK, False):
        return

    @functools.wraps(original)
    def post_init(self: VllmConfig) -> None:
        remembered = remember(self)
        original(self)
        apply(self, remembered)

    setattr(post_init, _HOOK_MARK, True)
    VllmConfig.__post_init__ = post_init  # type: ignore[method-assign]
