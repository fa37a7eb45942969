"""GLM-5.3-Flash fixture under MTP k = 3: the GPU exactness test's probe workload (prompts of 1 to
32,768 tokens, 32 conversations, 16-token answers, sent together) on one fresh engine of the policy
named by argv[2], to tell whether the device-side index assert of the test's first batch is stock
vLLM's. argv[3] ``short_rows`` adds prompts that end 2 and 3 tokens past a block boundary: vLLM
stops their prefill on the boundary, so stock too runs prefill rows of 2 and 3 tokens (shorter than
a verify row of 4) beside verify rows, as the plugin's stops on the pool grid do. Prints ``RESULT
ok`` or dies with the assert."""

import sys

from vllm import LLM

from bc_tools.bench.probe_scenario import run_probes

model, policy = sys.argv[1], sys.argv[2]
plugin = {"policy": policy, "prompt_capture": "in_step"}  # as the GPU test's plugin engine
llm = LLM(
    model=model,
    dtype="bfloat16",
    mamba_ssm_cache_dtype="float32",
    max_model_len=33_280,
    max_num_seqs=32,
    gpu_memory_utilization=0.3,
    enable_prefix_caching=True,
    seed=0,
    speculative_config={"method": "mtp", "num_speculative_tokens": 3},
    additional_config={"gdn_prefill_backend": "triton", "boundary_checkpoints": plugin},
)
block = llm.llm_engine.vllm_config.cache_config.block_size
lengths = {1, block - 8, block - 1, block, block + 1, 97, 200, 2103, 8193, 32768}
if sys.argv[3:] == ["short_rows"]:
    lengths |= {block + 2, block + 3, 32 * block + 2, 32 * block + 3}
lengths = sorted(lengths)
rows = run_probes(llm, lengths, 32, 16, seed=0)
print(f"RESULT ok {policy}: {len(rows)} probe rows, block {block}, lengths {lengths}")
