"""vllm-boundary-checkpoints: exact request-boundary prefix caching for hybrid models.

Importing the package imports nothing of vLLM; the supported vLLM versions and the startup check
live in :mod:`boundary_checkpoints.versions`.
"""

__version__ = "0.1.0"
