import os, sys, time, statistics, random, collections
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"; os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
from vllm import LLM, SamplingParams, TokensPrompt
MODEL = os.path.expanduser("~/.cache/boundary_checkpoints/tiny_qwen3_next")
CONFIGS = {"stock": {"policy": "aligned"}, "in_step": {"policy": "request_boundaries", "prompt_capture": "in_step"},
           "stop": {"policy": "request_boundaries", "prompt_capture": "stop"}}
T = collections.defaultdict(list); ON = {"v": False}
def wrap(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k)
        if ON["v"]: T[key].append(time.perf_counter() - t)
        return r
    setattr(obj, name, w)
llms = {}
for n, c in CONFIGS.items():
    llm = LLM(model=MODEL, dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=True, seed=0, additional_config={"boundary_checkpoints": c})
    core = llm.llm_engine.engine_core.engine_core
    wrap(core.scheduler, "schedule", (n, "scheduler.schedule"))
    wrap(core.scheduler, "update_from_output", (n, "scheduler.update_from_output"))
    wrap(core.model_executor, "execute_model", (n, "executor.execute_model"))
    wrap(core.model_executor, "sample_tokens", (n, "executor.sample_tokens"))
    wrap(core, "step", (n, "EngineCore.step"))
    wrap(llm.llm_engine, "step", (n, "LLMEngine.step"))
    llms[n] = llm
rng = random.Random(5); sp = SamplingParams(max_tokens=1, temperature=0.0)
def prompts(k): return [TokensPrompt(prompt_token_ids=[rng.randrange(4, 1000) for _ in range(360)]) for _ in range(k)]
for l in llms.values(): l.generate(prompts(8), sp, use_tqdm=False)
reps = int(sys.argv[1]); W = collections.defaultdict(list)
for r in range(reps):
    for n in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
        ON["v"] = True; s = {k: len(v) for k, v in T.items()}
        t = time.perf_counter(); llms[n].generate(prompts(8), sp, use_tqdm=False); W[n].append(time.perf_counter() - t)
        ON["v"] = False
        for k, v in T.items():
            if k[0] == n: W[k].append(sum(v[s.get(k, 0):]))
for k in sorted(W, key=str):
    print(f"{str(k):50s} per-generate sum med={1e3*statistics.median(W[k]):8.2f}ms")
