import os, sys, time, json, statistics, random
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
import torch
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

MODEL = os.path.expanduser("~/.cache/boundary_checkpoints/tiny_qwen3_next")
STEPS = []  # (tag, num_tokens, seconds)
CUR = {"tag": None}
_orig_exec = GPUModelRunner.execute_model
_orig_sample = GPUModelRunner.sample_tokens
def exec_wrap(self, so, *a, **k):
    t = time.perf_counter(); r = _orig_exec(self, so, *a, **k)
    STEPS.append([CUR["tag"], so.total_num_scheduled_tokens, time.perf_counter() - t, len(getattr(so, "boundary_in_step_captures", None) or ()), sorted(so.num_scheduled_tokens.values())])
    return r
def sample_wrap(self, *a, **k):
    t = time.perf_counter(); r = _orig_sample(self, *a, **k)
    if STEPS: STEPS[-1][2] += time.perf_counter() - t
    return r
GPUModelRunner.execute_model = exec_wrap
GPUModelRunner.sample_tokens = sample_wrap

CONFIGS = {"stock": {"policy": "aligned"},
           "in_step": {"policy": "request_boundaries", "prompt_capture": "in_step"},
           "stop": {"policy": "request_boundaries", "prompt_capture": "stop"}}
which = sys.argv[1].split(",")
reps = int(sys.argv[2])
llms = {}
for name in which:
    llms[name] = LLM(model=MODEL, dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=4096,
                     enforce_eager=True, enable_prefix_caching=True, seed=0,
                     additional_config={"boundary_checkpoints": CONFIGS[name]})
rng = random.Random(1234)
def prompts(n):
    return [TokensPrompt(prompt_token_ids=[rng.randrange(4, 1000) for _ in range(360)]) for _ in range(n)]
sp = SamplingParams(max_tokens=1, temperature=0.0)
# warm-up
for name, llm in llms.items():
    for bs in (1, 8, 1, 8):
        llm.generate(prompts(bs), sp, use_tqdm=False)
times = {(n, bs): [] for n in llms for bs in (1, 8)}
steps = {(n, bs): [] for n in llms for bs in (1, 8)}
order = list(llms)
for r in range(reps):
    for bs in (8, 1):
        for name in (order if r % 2 == 0 else order[::-1]):
            p = prompts(bs)
            CUR["tag"] = (name, bs); s0 = len(STEPS)
            t = time.perf_counter(); llms[name].generate(p, sp, use_tqdm=False); dt = time.perf_counter() - t
            times[(name, bs)].append(dt); steps[(name, bs)].append(STEPS[s0:])
            CUR["tag"] = None
def q(xs, p): xs = sorted(xs); return statistics.quantiles(xs, n=4)[{25:0,50:1,75:2}[p]]
out = {}
for (name, bs), ts in times.items():
    st = steps[(name, bs)]
    out[f"{name}/{bs}"] = {"med_ms": 1e3*statistics.median(ts), "p25": 1e3*q(ts,25), "p75": 1e3*q(ts,75),
        "steps_per_call": statistics.median(len(s) for s in st),
        "step_layout": [(s[1], round(s[2]*1e3,2), s[3], s[4]) for s in st[len(st)//2]], "step_ms_med": [round(1e3*statistics.median(s[i][2] for s in st if len(s)>i),2) for i in range(max(len(s) for s in st))],
        "runner_ms_med": 1e3*statistics.median(sum(x[2] for x in s) for s in st)}
names = list(llms)
for bs in (1, 8):
    for a, b in (("in_step", "stock"), ("stop", "stock"), ("in_step", "stop")):
        if a in llms and b in llms:
            r = [x / y for x, y in zip(times[(a, bs)], times[(b, bs)])]
            qs = statistics.quantiles(r, n=4)
            print(f"PAIRED bs={bs} {a}/{b}: med={statistics.median(r):.3f} [{qs[0]:.3f}..{qs[2]:.3f}] wins={sum(x<1 for x in r)}/{len(r)}")
print("RESULT " + json.dumps(out))
for k, v in out.items(): print(k, json.dumps(v))
