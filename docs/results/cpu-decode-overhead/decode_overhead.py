"""Scratch: host time per decode step of schedule() + update_from_output(), stock vs plugin (CPU, tiny model)."""
import gc, os, sys, statistics as st, time, json
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, "/work/main/benchmarks")
import step_profile as sp
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model
model = str(make_tiny_model(default_model_dir("qwen3_next", 0), family="qwen3_next", seed=0))
res = {}
configs = {"aligned": {"policy": "aligned"}, "in_step": {"policy": "request_boundaries", "prompt_capture": "in_step"}}
import random
for label, section in configs.items():
    llm = LLM(model=model, dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=4096, enable_prefix_caching=True,
              seed=0, enforce_eager=True, distributed_executor_backend="uni",
              additional_config={"boundary_checkpoints": section})
    core = llm.llm_engine.engine_core.engine_core
    rec = sp.StepRecorder(core, cuda=False)
    sched, upd = [], []
    for r in range(6):
        rng = random.Random(f"{label}{r}")
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(4, 1000) for _ in range(300)])]
        rec.begin(False)
        llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0), use_tqdm=False)
        steps = rec.end()
        if r == 0: continue
        dec = [s for s in steps if s.tokens == 1]
        sched += [s.schedule_s * 1e6 for s in dec]; upd += [s.update_s * 1e6 for s in dec]
    res[label] = dict(decode_steps=len(sched), schedule_us_p50=st.median(sched), update_us_p50=st.median(upd),
                      schedule_us_p90=sorted(sched)[int(.9*len(sched))], update_us_p90=sorted(upd)[int(.9*len(upd))])
    print(label, res[label], flush=True)
    del llm, core, rec; gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()
print(json.dumps(res))
