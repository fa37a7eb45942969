"""Is the P - 1 stop's logprob deviation the plugin's, or what vLLM computes for that split anyway?

For a few prompt lengths P this prints the first answer token's top-5 logprobs of one greedy token
under four engines on the CPU (tiny Qwen3-Next, in-process, one engine at a time):

* ``stock``: vLLM with prefix caching, ``policy: aligned`` (one prefill chunk below the block);
* ``plugin``: ``policy: request_boundaries`` (the prefill stops at P - 1, the last token runs
  as a one-token step);
* ``split_at_P-1``: stock vLLM without prefix caching and ``max_num_batched_tokens = P - 1``, so
  vLLM itself splits the prefill at P - 1;
* ``unsplit``: stock vLLM without prefix caching, one chunk.

Usage: ``python benchmarks/split_deviation.py MODEL_DIR [--lengths 255 300] [--out FILE]``; each
engine runs in a fresh process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

ENGINE = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
config = json.loads(sys.argv[1])
prompt = json.loads(sys.argv[2])
llm = LLM(model=config.pop("model"), dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
          enforce_eager=True, distributed_executor_backend="uni", seed=0, **config)
out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
                   use_tqdm=False)[0]
print("RESULT " + json.dumps({str(t): l.logprob for t, l in out.outputs[0].logprobs[0].items()}))
"""


def engines(model: str, length: int) -> dict[str, dict]:
    policy = lambda p: {"boundary_checkpoints": {"policy": p}}  # noqa: E731
    return {
        "stock": dict(model=model, enable_prefix_caching=True, additional_config=policy("aligned")),
        "plugin": dict(model=model, enable_prefix_caching=True, additional_config=policy("request_boundaries")),
        "split_at_P-1": dict(
            model=model,
            enable_prefix_caching=False,
            max_num_batched_tokens=length - 1,
            additional_config=policy("aligned"),
        ),  # fmt: skip
        "unsplit": dict(model=model, enable_prefix_caching=False, additional_config=policy("aligned")),
    }


def first_token_logprobs(config: dict, prompt: list[int]) -> dict[int, float]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    done = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(config), json.dumps(prompt)], env=env,
                          capture_output=True, text=True, timeout=900, check=True)  # fmt: skip
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {int(t): v for t, v in json.loads(line[len("RESULT ") :]).items()}


def deviation(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[t] - b[t]) for t in a.keys() & b.keys())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--lengths", type=int, nargs="+", default=[255, 300])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rng = random.Random(5)
    report = {}
    for length in args.lengths:
        prompt = [rng.randrange(8, 1024) for _ in range(length)]
        runs = {name: first_token_logprobs(cfg, prompt) for name, cfg in engines(args.model, length).items()}
        report[length] = {
            "logprobs": runs,
            "plugin_vs_split_at_P-1": deviation(runs["plugin"], runs["split_at_P-1"]),
            "plugin_vs_stock": deviation(runs["plugin"], runs["stock"]),
            "split_at_P-1_vs_unsplit": deviation(runs["split_at_P-1"], runs["unsplit"]),
            "stock_vs_unsplit": deviation(runs["stock"], runs["unsplit"]),
        }
        print(length, {k: round(v, 4) for k, v in report[length].items() if k != "logprobs"}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
