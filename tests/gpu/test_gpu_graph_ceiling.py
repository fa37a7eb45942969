"""GPU host: the CUDA graph ceiling the plugin sets (``graph_ceiling_tokens``, ``graph_ceiling.py``).

vLLM's real config on a CUDA platform at ``max_num_seqs`` 256 (vLLM's default ceiling there: 512):
the plugin at its defaults raises it to 1,024 and vLLM's capture list ends there; 0, stock
(``aligned``) and a ceiling the user set leave it. Then one engine at the plugin's defaults starts
with that list and serves 8 next turns of 101 new tokens each at once (808 tokens: past 512, inside
1,024), every one restored at its response boundary (prompt + answer - 1 cached tokens).
"""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.gpu

PROMPT, ANSWER, NEW, ROWS = 300, 8, 100, 8
GDN = {"gdn_prefill_backend": "triton"}


def engine_config(model_dir, settings: dict, **kwargs):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    args = EngineArgs(
        model=str(model_dir),
        max_num_seqs=256,
        enable_prefix_caching=True,
        additional_config={**GDN, "boundary_checkpoints": settings},
        **kwargs,
    )
    return args.create_engine_config().compilation_config


@pytest.mark.parametrize(
    ("settings", "kwargs", "ceiling"),
    [
        ({"policy": "request_boundaries"}, {}, 1024),
        ({"policy": "request_boundaries", "graph_ceiling_tokens": 0}, {}, 512),
        ({"policy": "aligned"}, {}, 512),
        ({"policy": "request_boundaries"}, {"compilation_config": {"max_cudagraph_capture_size": 256}}, 256),
    ],
    ids=["plugin", "setting_0", "stock", "user_ceiling"],
)
def test_the_ceiling_on_vllms_real_config(tiny_model_dir, settings, kwargs, ceiling):
    compilation = engine_config(tiny_model_dir, settings, **kwargs)
    assert compilation.max_cudagraph_capture_size == ceiling
    assert compilation.cudagraph_capture_sizes[-1] == ceiling


def test_an_engine_at_the_raised_ceiling_restores_eight_next_turns_at_once(tiny_model_dir):
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(tiny_model_dir),
        dtype="bfloat16",
        mamba_ssm_cache_dtype="float32",
        max_model_len=4096,
        max_num_seqs=256,
        gpu_memory_utilization=0.35,
        enable_prefix_caching=True,
        seed=0,
        additional_config={**GDN, "boundary_checkpoints": {"policy": "request_boundaries"}},
    )
    try:
        assert llm.llm_engine.vllm_config.compilation_config.max_cudagraph_capture_size == 1024
        prompts = [[(7 * row + 13 * i) % 900 + 20 for i in range(PROMPT)] for row in range(ROWS)]
        first = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(max_tokens=ANSWER, min_tokens=ANSWER, temperature=0.0, ignore_eos=True),
        )
        next_turns = [
            p + list(out.outputs[0].token_ids) + [(5 * row + i) % 900 + 20 for i in range(NEW)]
            for row, (p, out) in enumerate(zip(prompts, first, strict=True))
        ]
        second = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in next_turns], SamplingParams(max_tokens=1, temperature=0.0)
        )
        assert [out.num_cached_tokens for out in second] == [PROMPT + ANSWER - 1] * ROWS
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
