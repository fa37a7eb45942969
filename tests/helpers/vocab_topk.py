"""DFlash2's candidate top-k on ``torch.topk`` in an engine script's process (why:
``tests/gpu/test_gpu_dflash.py``'s ``TORCH_VOCAB_TOPK``): vLLM 0.32.0 calls FlashInfer's ``top_k``
whenever it imports, and the GPU bundle would JIT-compile it past a test's time budget.

Contract: ``use_torch_topk()`` makes ``LogitsProcessor``'s top-k selector answer None (its own
``torch.topk`` branch) for every engine the process starts afterwards; it raises RuntimeError where
vLLM no longer has that selector, rather than run FlashInfer's silently.
"""

from __future__ import annotations


def use_torch_topk() -> None:
    from vllm.model_executor.layers import logits_processor

    if not callable(getattr(logits_processor, "_flashinfer_topk", None)):
        raise RuntimeError("vLLM moved LogitsProcessor's top-k selector: torch_vocab_topk cannot apply")
    logits_processor._flashinfer_topk = lambda: None  # None: LogitsProcessor's own torch.topk branch
