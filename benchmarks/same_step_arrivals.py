"""Whose is a cold prompt among prompts that share a prefix and arrive together? Stock and plugin,
step by step, on the real CPU engine.

Contract
--------
Eight prompts share a ``--shared``-token prefix (each adds 20 tokens of its own). They reach the
engine in a fixed arrival pattern: ``[2, 6]`` adds two before the first engine step and six before
the second; ``[8]`` adds all before the first. Each pattern runs once per engine, on the tiny
Qwen3-Next (``--mtp K``: the planted MTP fixture under MTP k = K, through the Triton stand-in the
CPU engine needs). It prints, for each pattern, every request's cached tokens: stock (``aligned``),
then the plugin (``request_boundaries``, ``prompt_capture`` ``auto``), and whether the plugin's are
the same, more for some request, or below stock's for some request; and the engine steps until
every request had its first token. ``--primed``: one prompt with the shared prefix runs to its end
before each pattern, so the prefix is cached when the others arrive (vLLM starts prompts hitting
one cached recurrent state a step apart; the plugin with ``--together``, its
``shared_hits_together``, in one step: ``core/shared_hits.py``).

    .venv/bin/python benchmarks/same_step_arrivals.py --mtp 3
    .venv/bin/python benchmarks/same_step_arrivals.py --mtp 0 --primed --together
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = [[1, 1, 6], [2, 6], [1, 7], [1, 0, 7], [8]]

ENGINE_SCRIPT = r"""
import json, random, sys
sys.path.insert(0, sys.argv[5])
model, policy, k, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
patterns, primed, settings = json.loads(sys.argv[6]), sys.argv[7] == "1", json.loads(sys.argv[8])
own = int(sys.argv[9])  # tokens each prompt adds to the prefix; 0: one, after the prefix cut to whole blocks
if len(sys.argv) > 10:  # a test's corrupted variant: "module:attribute" replacing the plugin's class
    import importlib
    module, name = sys.argv[10].split(":")
    target = importlib.import_module("boundary_checkpoints.core.shared_hits")
    target.SharedHits = getattr(importlib.import_module(module), name)
if k:
    import fake_triton_cpu
    fake_triton_cpu.install()
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
extra = {"gdn_prefill_backend": "triton"} if torch.cuda.is_available() else {}  # the GPU host's GDN kernel
llm = LLM(model=model, dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=2048, enforce_eager=True,
          distributed_executor_backend="uni", enable_prefix_caching=True, seed=0, max_num_batched_tokens=1024,
          additional_config={"boundary_checkpoints": {"policy": policy, "prompt_capture": "auto", **settings}, **extra},
          **spec)
engine = llm.llm_engine
scheduler = engine.engine_core.engine_core.scheduler  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
engine_facts = {"block_size": scheduler.block_size, "hash_block_size": scheduler.hash_block_size,
                "async_scheduling": bool(engine.vllm_config.scheduler_config.async_scheduling)}
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
rng = random.Random(0)
rows = {}
for p, pattern in enumerate(patterns):
    prefix = [rng.randrange(4, 1024) for _ in range(shared)]
    head = prefix if own else prefix[: shared // scheduler.block_size * scheduler.block_size]
    prompts = [head + [rng.randrange(4, 1024) for _ in range(own or 1)] for _ in range(sum(pattern))]
    primer = prefix + [rng.randrange(4, 1024) for _ in range(20)]
    if primed:
        llm.generate([TokensPrompt(prompt_token_ids=primer)], params, use_tqdm=False)
    cached, first, logprob, sent, steps = {}, {}, {}, 0, [0]
    def step():
        steps[0] += 1
        for out in engine.step():
            cached.setdefault(out.request_id, out.num_cached_tokens)
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, steps[0])
                token, entries = out.outputs[0].token_ids[0], out.outputs[0].logprobs[0]
                logprob.setdefault(out.request_id, entries[token].logprob)
    for group in pattern:
        for _ in range(group):
            engine.add_request(f"{p}-{sent}", TokensPrompt(prompt_token_ids=prompts[sent]), params)
            sent += 1
        step()
    while engine.has_unfinished_requests():
        step()
    ids = [f"{p}-{i}" for i in range(sent)]
    rows[str(pattern)] = ([cached[i] for i in ids], max(first.values()), [logprob[i] for i in ids])
    engine_facts[f"first-token steps {pattern}"] = [first[i] for i in ids]
print("RESULT " + json.dumps({"rows": rows, "engine": engine_facts}))
"""


def run_engine(model: Path, policy: str, k: int, shared: int, patterns=PATTERNS, primed: bool = False,
               settings: dict | None = None, shared_hits_class: str | None = None, own: int = 20) -> dict:  # fmt: skip
    """One engine's run (a fresh process): under ``"rows"``, per arrival pattern, each request's
    cached tokens, the engine steps until every request had its first token, and each first
    token's logprob; under ``"engine"`` the scheduler's block and hash block sizes, whether it
    schedules asynchronously, and per pattern the step of each request's first token.
    ``settings``: more keys of the plugin's section; ``shared_hits_class`` ("module:Class"): a
    replacement for the plugin's ``SharedHits`` (tests). ``own``: tokens each prompt adds to the
    shared prefix; 0: the prefix is cut to the scheduler's whole blocks and each prompt adds one
    token, so a hit on the prefix ends at the prompt's last hash-block boundary whatever the
    platform's block and hash block sizes (where vLLM starts such prompts a step apart)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
    argv = [str(model), policy, str(k), str(shared), str(ROOT / "tests" / "helpers"), json.dumps(patterns),
            "1" if primed else "0", json.dumps(settings or {}), str(own),
            *([shared_hits_class] if shared_hits_class else [])]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, *argv], env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{policy} engine failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mtp", type=int, default=3, help="MTP draft tokens k (0: no speculative decoding)")
    parser.add_argument("--shared", type=int, default=700, help="tokens of the shared prefix")
    parser.add_argument("--primed", action="store_true", help="the shared prefix is cached before each pattern")
    parser.add_argument("--together", action="store_true", help="the plugin with shared_hits_together: true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bc_tools.fixtures.tiny_models import make_tiny_model

    family = "qwen3_next_mtp_planted" if args.mtp else "qwen3_next"
    model = make_tiny_model(Path(tempfile.gettempdir()) / f"bc_tiny_{family}", family=family)
    stock = run_engine(model, "aligned", args.mtp, args.shared, primed=args.primed)
    settings = {"shared_hits_together": True} if args.together else {}
    plugin = run_engine(model, "request_boundaries", args.mtp, args.shared, primed=args.primed, settings=settings)
    print(f"MTP k = {args.mtp}, {args.shared}-token shared prefix{', cached first' if args.primed else ''}; "
          "cached tokens per request, in arrival order")  # fmt: skip
    print(f"stock's engine: {stock['engine']}")
    for pattern in stock["rows"]:
        (ours, our_steps, _), (theirs, their_steps, _) = plugin["rows"][pattern], stock["rows"][pattern]
        pairs = list(zip(ours, theirs, strict=True))
        verdict = "BELOW STOCK" if any(p < s for p, s in pairs) else "more" if any(p > s for p, s in pairs) else "same"
        print(f"arrivals {pattern:>12}  stock {theirs}  plugin {ours}  {verdict}; "
              f"engine steps to the last first token: stock {their_steps}, plugin {our_steps}")  # fmt: skip


if __name__ == "__main__":
    main()
