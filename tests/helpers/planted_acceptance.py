"""Offline acceptance of a planted MTP drafter: greedy answers of a transformers target, drafted
from the rows vLLM's MTP module sees.

Contract: :func:`offline_acceptance` generates greedy answers (float32, 16 tokens) to 32 random
prompts of 1, 40 and 97 tokens each (seeded), and returns the share of answer tokens after the
first that ``draft_logits(next_tokens, hidden)`` drafts right: vLLM's MTP row ``r`` is
``f(h[r], t[r + 1])`` and drafts ``t[r + 2]`` (acceptance per draft at ``k = 1``).
"""

from __future__ import annotations

from collections.abc import Callable

from bc_tools.fixtures import family_spec


def offline_acceptance(model, draft_logits: Callable) -> float:
    """See the module docstring; ``model`` is a transformers causal LM in eval mode."""
    import torch

    generator = torch.Generator().manual_seed(1)
    accepted = drafted = 0
    for length in (1, 40, 97):
        prompts = torch.randint(4, family_spec.VOCAB_SIZE, (32, length), generator=generator)
        with torch.no_grad():
            ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16,
                                 do_sample=False, pad_token_id=family_spec.PAD_ID)  # fmt: skip
            hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        rows = torch.arange(length - 1, ids.shape[1] - 2)  # rows whose drafted token is an answer token
        drafts = draft_logits(ids[:, rows + 1], hidden[:, rows]).argmax(-1)
        accepted += int((drafts == ids[:, rows + 2]).sum())
        drafted += drafts.numel()
    return accepted / drafted
