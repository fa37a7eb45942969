import os, sys, time, json, statistics, random
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.pop("VLLM_BOUNDARY_CHECKPOINTS_POLICY", None)
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
MODEL = os.path.expanduser("~/.cache/boundary_checkpoints/tiny_qwen3_next")
STEPS = []
BYN = {}
_o = GPUModelRunner.execute_model
def ex(self, so, *a, **k):
    t = time.perf_counter(); r = _o(self, so, *a, **k)
    STEPS.append((time.perf_counter() - t, so.total_num_scheduled_tokens, len(getattr(so, "boundary_in_step_captures", None) or ())))
    return r
GPUModelRunner.execute_model = ex
CONFIGS = {"stock": {"policy": "aligned"},
           "in_step": {"policy": "request_boundaries", "prompt_capture": "in_step"},
           "stop": {"policy": "request_boundaries", "prompt_capture": "stop"}}
llms = {n: LLM(model=MODEL, dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=4096,
               enforce_eager=True, enable_prefix_caching=True, seed=0,
               additional_config={"boundary_checkpoints": c}) for n, c in CONFIGS.items()}
rng = random.Random(7)
sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
STAGGER = int(sys.argv[2])
def run(llm, inflight, total):
    eng = llm.llm_engine; started = {}; ttft = []; nxt = 0; done = 0; s0 = len(STEPS); queue = []
    def add():
        queue.append(1)
    def release():
        nonlocal nxt
        rid = f"r{time.monotonic_ns()}_{nxt}"; nxt += 1
        eng.add_request(rid, TokensPrompt(prompt_token_ids=[rng.randrange(4, 1000) for _ in range(360)]), sp)
        started[rid] = time.perf_counter()
    for _ in range(inflight): add()
    t0 = time.perf_counter()
    while done < total:
        for _ in range(min(len(queue), STAGGER)):
            queue.pop(); release()
        for o in eng.step():
            if o.request_id in started and o.outputs and len(o.outputs[0].token_ids) >= 1:
                ttft.append(time.perf_counter() - started.pop(o.request_id))
            if o.finished:
                done += 1
                if nxt < total: add()
    st = STEPS[s0:]
    for d, n, c in st: BYN.setdefault((id(llm), n, bool(c)), []).append(d)
    return ttft, time.perf_counter() - t0, len(st), sum(1 for s in st if s[2])
for n, llm in llms.items(): run(llm, 8, 8)
R = {(n, k): [] for n in llms for k in (1, 8)}
SC = {(n, k): [] for n in llms for k in (1, 8)}
reps = int(sys.argv[1])
for r in range(reps):
    for k, total in ((8, 24), (1, 4)):
        for n in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            tt, wall, nsteps, ncap = run(llms[n], k, total)
            R[(n, k)].append(statistics.median(tt)); SC[(n, k)].append((nsteps, ncap, wall))
for (n, k), v in R.items():
    qs = statistics.quantiles(v, n=4)
    print(f"{n:8s} inflight={k}  TTFT p50 per round: med={1e3*statistics.median(v):7.2f}ms  [p25 {1e3*qs[0]:7.2f} .. p75 {1e3*qs[2]:7.2f}]  steps/round={statistics.median(s[0] for s in SC[(n,k)])} capture-steps={statistics.median(s[1] for s in SC[(n,k)])} wall={statistics.median(s[2] for s in SC[(n,k)]):.3f}s")

for n, llm in llms.items():
    for (i, tok, c), v in sorted(BYN.items(), key=lambda x: x[0][1:]):
        if i == id(llm) and len(v) >= 10:
            print(f"  step {n:8s} tokens={tok:5d} capture={c!s:5s} count={len(v):5d} med={1e3*statistics.median(v):7.2f}ms")
