"""Where does the in-step prompt capture's time go? Per-step timings and a torch profile, in-process.

Contract
--------
For each configuration named by ``--configs`` (``aligned``: stock, ``policy: aligned``; ``in_step``:
``request_boundaries`` with ``prompt_capture: in_step``, the split of ``worker/gdn_split.py``;
``stop``: ``request_boundaries`` stopping every prefill at ``P - 1``; ``--variant LABEL=JSON`` adds
one with JSON as its ``boundary_checkpoints`` section) this builds one in-process ``vllm.LLM``
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and the worker run in this process), one
engine at a time (deleted, ``gc.collect()``, ``cleanup_dist_env_and_memory()`` before the next),
with ``additional_config`` = ``--additional-config`` plus the configuration's section, and
``--llm-kwargs`` over the package's usual engine settings. It sends ``llm.generate`` calls of B
fresh random token-id prompts of ``--prompt-len`` tokens (``max_tokens=1``, ``ignore_eos``,
greedy) for every B of ``--batch``:

* ``--warmup`` untimed calls per batch size, then ``--repeat`` rounds; round r runs the batch
  sizes in ``--batch`` order rotated by r, each twice, ``async`` then ``synced`` (swapped on odd
  rounds). Prompt ids are drawn from ``[4, vocab)`` with a generator seeded by (``--seed``, round,
  batch, mode): every configuration gets the same prompts and no call reuses another's, so nothing
  is cached (each call's ``cached_tokens`` is recorded: expect 0).
* Each engine step is recorded by wrapping the engine core's ``scheduler.schedule`` /
  ``update_from_output`` (host times) and its executor's ``execute_model`` / ``sample_tokens``:
  scheduled tokens and rows, the plugin's in-step capture pairs (``boundary_in_step_captures``,
  one per capture row and recurrent KV group: the step carries capture rows), capture and
  post-forward copies, and the times. In ``synced`` calls ``torch.cuda.synchronize()`` runs before
  ``execute_model``, after it and after ``sample_tokens``, so their step times are device-complete;
  this removes async scheduling's overlap of host and device, so ``synced`` call times are not
  TTFTs. ``async`` calls add no synchronization (their step times are host times only): their call
  time is the one to compare with the serving benchmark's TTFT. On the CPU both modes are alike.
* ``--torch-profile DIR``: after the rounds, one more ``async`` call at ``--profile-batch`` (default:
  the largest batch) under ``torch.profiler`` (CPU and, on CUDA, CUDA activity) writes
  ``DIR/trace-<config>.json.gz`` (chrome trace) and appends to ``DIR/profile-tables.txt`` the top
  30 ops by self CUDA time (CUDA only) and by self CPU time. The JSON gets the same rows, the
  counts of host-device synchronizations among the profiled ops (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``, ``Memcpy DtoH`` copies,
  ``aten::item``, ``aten::_local_scalar_dense``) and, on CUDA, the Python lines (``file:line``) of
  the synchronizing operations that torch's sync debug mode ``warn`` reports during that call.
  The wrapped calls appear as ``bc_schedule``, ``bc_execute_model[capture|plain]``,
  ``bc_sample_tokens`` and ``bc_update_from_output`` ranges. The JSON's ``profile.attribution``
  is :func:`step_attribution` of the trace: per step kind (``capture``: the step carries capture
  rows, ``plain``), over the ``bc_execute_model`` steps with a recurrent core inside (an op of
  ``CORE_OPS``: on CUDA ``vllm::qwen_gdn_attention_core``; on CPU stock runs
  ``vllm::cpu_gdn_attention_core``, the plugin's in-step subclass the CUDA op), the mean per step
  of the step's host time, the cores' time, the cores' direct children by name (ms and calls) and
  the cores' time outside them (``gaps_ms``: Python), the first step's cores one per layer in order
  and, on CUDA, the device windows of those steps: span vs busy (the sum of the kernels, copies and
  sets starting in them) and the top kernels. A failing profile is recorded in the JSON
  (``profile.error``; a failing attribution in ``profile.attribution.error``) and the run goes on.

Configurations are not interleaved (one engine at a time: on one GPU two engines cost a second
start and half the memory each); batch sizes and modes are, within each engine. ``--out`` gets
one JSON with every call and step, the engines' settings (block size, async scheduling, CUDA
graph mode, model runner, the plugin's prompt-capture decision), the machine (GPU name from
nvidia-smi, torch and vLLM versions, git commit), the dates and the command line; it is rewritten
after every round, so a run cut short keeps what it measured. Printed: per batch size a table (call
times median [p25..p75] over rounds, the ratio to the first configuration round by round, steps
and capture steps per call, step times of capture and other steps, host time per step) and per
configuration a line on the largest batch's steps with the profiled call's synchronizations and,
per step kind, its attribution (host and core ms per step, gaps, the busiest child; GPU span and
busy ms on CUDA).

``python benchmarks/step_profile.py --attribute TRACE [TRACE ...]`` starts no engine: it prints
the attribution of existing traces (gzipped or not), with the top children and kernels and the
per-layer cores.

CPU (the package's tiny Qwen3-Next unless ``--model``; ``enforce_eager``, the ``uni`` executor,
``VLLM_CPU_KVCACHE_SPACE=1``; about 90 s on 2 cores): ``python benchmarks/step_profile.py --batch
1,2 --repeat 2 --prompt-len 300 --out /tmp/sp.json --torch-profile /tmp/sp``
(``tests/tools/test_step_profile.py``).

H200 (Qwen3-Next-80B dims at 24 layers, dummy weights, CUDA graphs, async scheduling), from the
repository root once the bundle parts sit in /tmp/gpu-parts; three engine starts (about 1.5-3
minutes each), then per engine 5 rounds of 1, 8 and 32 prompts in both modes and the profiled call
(not measured yet: the log prints the elapsed time after every round, the JSON the profile's
``postprocess_s``; ``--profile-batch 8`` shortens the profile)::

    source .gpu-bundle/install_on_host.sh && \\
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && \\
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 && \\
    bc-bench --write-model /tmp/q24 --arch qwen3_next_80b_24l && \\
    python3 benchmarks/step_profile.py --model /tmp/q24 --configs aligned,in_step,stop \\
      --llm-kwargs '{"load_format": "dummy", "max_model_len": 8192}' \\
      --additional-config '{"gdn_prefill_backend": "triton"}' --gpu-memory-utilization 0.5 \\
      --out "$OUT/step_profile.json" --torch-profile "$OUT/profile" 2>&1 | tee "$OUT/step_profile.log"

It leaves 6 files under ``$OUT`` (the JSON, the log, three gzipped traces, the tables).
``--max-num-batched-tokens`` defaults to 8192, the serving benchmark's budget (the offline
``LLM``'s default on an H200 is 16384).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from bisect import bisect_left, bisect_right
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from bc_tools.bench.cli import machine_info
from bc_tools.bench.report import format_table
from bc_tools.bench.server_sets import POLICY_ENV
from bc_tools.bench.stats import PLUGIN_POLICY, STOCK_POLICY, percentile, spread
from bc_tools.bench.workload import FIRST_RANDOM_ID, round_order
from boundary_checkpoints.core.step_copies import CAPTURE_COPIES_ATTR, IN_STEP_CAPTURES_ATTR, POST_FORWARD_COPIES_ATTR
from boundary_checkpoints.prompt_capture import IN_STEP, STOP

CONFIGS = {
    "aligned": {"policy": STOCK_POLICY},
    "in_step": {"policy": PLUGIN_POLICY, "prompt_capture": IN_STEP},
    "stop": {"policy": PLUGIN_POLICY, "prompt_capture": STOP},
}
MODES = ("async", "synced")
STEP_RECORD_ATTR = "step_profile_record"  # set on each SchedulerOutput by the wrapped schedule()
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "aten::item", "aten::_local_scalar_dense")  # fmt: skip
DTOH_COPY_PREFIX = "Memcpy DtoH"
TORCH_SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync debug mode "warn"
TOP_SYNC_SITES = 20
TOP_OPS = 30
SORT_KEYS = {"self_cuda": "self_device_time_total", "self_cpu": "self_cpu_time_total"}
STEP_RANGE = "bc_execute_model[{}]"  # one range per execute_model call, named by step kind
STEP_KINDS = ("capture", "plain")
# the custom op wrapping one layer's recurrent (GDN) core: stock CUDA, stock CPU (forward_cpu), and
# the plugin's CPU subclass, which runs forward_cuda and so the CUDA op name
CORE_OPS = ("vllm::qwen_gdn_attention_core", "vllm::qwen_gdn_attention_core_fused_norm_packed",
            "vllm::cpu_gdn_attention_core")  # fmt: skip
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
DEVICE_STEP_CATEGORY = "gpu_user_annotation"
NESTING_SLACK_US = 0.002  # chrome-trace times are rounded to 1 ns: an end may pass its parent's by that
TOP_CHILDREN = 12
TOP_KERNELS = 10
TOP_DETAIL = 8  # children and kernels printed by --attribute
STARTED = time.perf_counter()
SYNC_NOTE = (
    "synced calls: torch.cuda.synchronize() before execute_model, after it and after sample_tokens "
    "(device-complete step times, no async-scheduling overlap); async calls: no added synchronization "
    "(step times are host times)"
)


@dataclass
class StepRecord:
    """One scheduled engine step (times in seconds; ``execute_s``/``sample_s`` device-complete only
    in synced calls)."""

    tokens: int
    rows: int
    schedule_s: float
    in_step_pairs: int = 0
    capture_copies: int = 0
    post_forward_copies: int = 0
    execute_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0

    @property
    def carries_captures(self) -> bool:
        return self.in_step_pairs > 0


class StepRecorder:
    """Wraps one engine core's scheduler and executor; ``begin``/``end`` bracket one call."""

    def __init__(self, core, cuda: bool):
        import torch

        self._torch = torch
        self._cuda = cuda
        self._synced = False
        self._steps: list[StepRecord] = []
        self._executing: StepRecord | None = None
        wrap_method(core.scheduler, "schedule", self._schedule)
        wrap_method(core.scheduler, "update_from_output", self._update_from_output)
        wrap_method(core.model_executor, "execute_model", self._execute_model)
        wrap_method(core.model_executor, "sample_tokens", self._sample_tokens)

    def begin(self, synced: bool) -> None:
        self._synced, self._steps = synced, []

    def end(self) -> list[StepRecord]:
        steps, self._steps = self._steps, []
        return steps

    def _sync(self) -> None:
        if self._synced and self._cuda:
            self._torch.cuda.synchronize()

    def _schedule(self, original, *args, **kwargs):
        start = time.perf_counter()
        with self._torch.profiler.record_function("bc_schedule"):
            output = original(*args, **kwargs)
        record = StepRecord(tokens=output.total_num_scheduled_tokens, rows=len(output.num_scheduled_tokens),
                            schedule_s=time.perf_counter() - start)  # fmt: skip
        setattr(output, STEP_RECORD_ATTR, record)
        self._steps.append(record)
        return output

    def _execute_model(self, original, scheduler_output, *args, **kwargs):
        record = getattr(scheduler_output, STEP_RECORD_ATTR)
        record.in_step_pairs = len(getattr(scheduler_output, IN_STEP_CAPTURES_ATTR, None) or ())
        record.capture_copies = len(getattr(scheduler_output, CAPTURE_COPIES_ATTR, None) or ())
        record.post_forward_copies = len(getattr(scheduler_output, POST_FORWARD_COPIES_ATTR, None) or ())
        kind = "capture" if record.carries_captures else "plain"
        self._sync()
        start = time.perf_counter()
        with self._torch.profiler.record_function(STEP_RANGE.format(kind)):
            output = original(scheduler_output, *args, **kwargs)
            self._sync()
        record.execute_s = time.perf_counter() - start
        self._executing = record
        return output

    def _sample_tokens(self, original, *args, **kwargs):
        start = time.perf_counter()
        with self._torch.profiler.record_function("bc_sample_tokens"):
            output = original(*args, **kwargs)
            self._sync()
        if self._executing is not None:
            self._executing.sample_s = time.perf_counter() - start
        return output

    def _update_from_output(self, original, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        with self._torch.profiler.record_function("bc_update_from_output"):
            output = original(scheduler_output, *args, **kwargs)
        getattr(scheduler_output, STEP_RECORD_ATTR).update_s = time.perf_counter() - start
        return output


def elapsed_s() -> float:
    return time.perf_counter() - STARTED


def wrap_method(obj, name: str, around) -> None:
    """Replace ``obj.name`` (on the instance) by ``around(original, *args, **kwargs)``."""
    original = getattr(obj, name)
    setattr(obj, name, lambda *args, **kwargs: around(original, *args, **kwargs))


# ---------------------------------------------------------------------------------------------
# command line


def parse_json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def parse_batches(text: str) -> list[int]:
    batches = [int(x) for x in text.split(",") if x.strip()]
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers (got {text!r})")
    return batches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: the package's tiny Qwen3-Next, built if missing)")
    p.add_argument("--configs", default="aligned,in_step,stop", help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                   help="one more configuration: LABEL with JSON as its boundary_checkpoints section")  # fmt: skip
    p.add_argument("--batch", type=parse_batches, default=[1, 8, 32], help="prompts per call (default 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=2100)
    p.add_argument("--repeat", type=int, default=5, help="rounds per configuration (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per batch size (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--additional-config", type=parse_json_object, default={},
                   help="merged into every engine's additional_config (boundary_checkpoints too)")  # fmt: skip
    p.add_argument("--llm-kwargs", type=parse_json_object, default={}, help="more vllm.LLM keyword arguments")
    p.add_argument("--torch-profile", type=Path, metavar="DIR", help="profile one call per configuration")
    p.add_argument("--profile-batch", type=int, help="batch size of the profiled call (default: the largest)")
    p.add_argument("--out", type=Path, help="JSON file (required unless --attribute)")
    p.add_argument("--attribute", type=Path, nargs="+", metavar="TRACE",
                   help="only print the step attribution of these chrome traces (no engine)")  # fmt: skip
    args = p.parse_args(argv)
    if args.attribute:
        return args
    if args.out is None:
        p.error("--out is required (unless --attribute)")
    args.sections = {}
    for name in (x.strip() for x in args.configs.split(",") if x.strip()):
        if name not in CONFIGS:
            p.error(f"unknown configuration {name!r}; known: {list(CONFIGS)} (or --variant)")
        args.sections[name] = CONFIGS[name]
    for item in args.variant:
        label, _, text = item.partition("=")
        if not label or label in args.sections:
            p.error(f"--variant needs a new label (got {item!r})")
        args.sections[label] = parse_json_object(text)
    if not args.sections:
        p.error("no configuration")
    if args.repeat < 1 or args.warmup < 0 or args.prompt_len < 2 or (args.profile_batch or 1) < 1:
        p.error("--repeat and --profile-batch must be >= 1, --warmup >= 0, --prompt-len >= 2")
    if args.prompt_len + 1 > args.llm_kwargs.get("max_model_len", default_max_model_len(args.prompt_len)):
        p.error("--prompt-len + 1 exceeds max_model_len")
    return args


def default_max_model_len(prompt_len: int) -> int:
    return max(4096, prompt_len + 1)


# ---------------------------------------------------------------------------------------------
# engines


def engine_kwargs(args: argparse.Namespace, section: dict, on_cpu: bool) -> dict:
    """``vllm.LLM`` arguments: the package's usual engine settings, then ``--llm-kwargs``."""
    kwargs = dict(model=args.model, dtype="bfloat16", mamba_ssm_cache_dtype="float32",
                  max_model_len=default_max_model_len(args.prompt_len), enable_prefix_caching=True, seed=0,
                  max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    if on_cpu:
        kwargs.update(enforce_eager=True, distributed_executor_backend="uni")
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    kwargs.update(args.llm_kwargs)
    extra = args.additional_config
    plugin_section = {**(extra.get("boundary_checkpoints") or {}), **section}
    kwargs["additional_config"] = {**extra, "boundary_checkpoints": plugin_section}
    return kwargs


def engine_setup(llm, section: dict) -> dict:
    """What the engine resolved: the settings that decide how a step runs."""
    from boundary_checkpoints.prompt_capture import decide_for
    from boundary_checkpoints.settings import BoundaryConfig

    config = llm.llm_engine.vllm_config
    core = llm.llm_engine.engine_core.engine_core
    setup = {
        "block_size": config.cache_config.block_size,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "async_scheduling": config.scheduler_config.async_scheduling,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "enforce_eager": config.model_config.enforce_eager,
        "scheduler": type(core.scheduler).__name__,
        "executor": type(core.model_executor).__name__,
        "worker_cls": config.parallel_config.worker_cls,
        "model_runner": type(core.model_executor.driver_worker.worker.model_runner).__qualname__,
        "additional_config": config.additional_config,
    }
    if section.get("policy") != STOCK_POLICY:
        decision = decide_for(BoundaryConfig.for_engine(config), config)
        setup["prompt_capture"] = {"mode": decision.mode, "reason": decision.reason}
    return setup


def release_engine() -> None:
    """After the caller's ``del llm``: the last reference must go before the cleanup."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


# ---------------------------------------------------------------------------------------------
# calls


def make_prompts(vocab_size: int, length: int, batch: int, tag: str) -> list:
    from vllm.inputs import TokensPrompt

    rng = random.Random(tag)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(FIRST_RANDOM_ID, vocab_size) for _ in range(length)])
            for _ in range(batch)]  # fmt: skip


def timed_call(llm, recorder: StepRecorder, prompts: list, mode: str) -> dict:
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    recorder.begin(synced=mode == "synced")
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = recorder.end()
    return {
        "mode": mode,
        "generate_s": elapsed,
        "cached_tokens": sum(out.num_cached_tokens or 0 for out in outputs),
        "output_tokens": sum(len(out.outputs[0].token_ids) for out in outputs),
        "steps": [{**asdict(s), "carries_captures": s.carries_captures} for s in steps],
    }


def run_rounds(
    llm,
    recorder: StepRecorder,
    args: argparse.Namespace,
    vocab_size: int,
    calls: list,
    after_round: Callable[[int], None],
) -> None:
    """Warm-up calls, then ``--repeat`` rounds appended to ``calls``; ``after_round(r)`` after each."""
    for batch in args.batch:
        for index in range(args.warmup):
            timed_call(llm, recorder, make_prompts(vocab_size, args.prompt_len, batch, f"warmup/{index}/{batch}"),
                       "async")  # fmt: skip
    for rep in range(args.repeat):
        for batch in round_order(args.batch, rep):
            for mode in round_order(MODES, rep):
                prompts = make_prompts(vocab_size, args.prompt_len, batch, f"{args.seed}/{rep}/{batch}/{mode}")
                calls.append({"rep": rep, "batch": batch, **timed_call(llm, recorder, prompts, mode)})
        after_round(rep)


# ---------------------------------------------------------------------------------------------
# torch profile


def top_ops(averages, key: str) -> list[dict]:
    ranked = sorted(averages, key=lambda event: getattr(event, key), reverse=True)[:TOP_OPS]
    return [{"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
             "self_cuda_us": e.self_device_time_total, "cpu_total_us": e.cpu_time_total} for e in ranked]  # fmt: skip


def sync_counts(averages) -> dict[str, int]:
    """Calls of the host-device synchronizations of SYNC_EVENTS, and device-to-host copies."""
    counts = dict.fromkeys((*SYNC_EVENTS, DTOH_COPY_PREFIX), 0)
    for event in averages:
        if event.key in counts:
            counts[event.key] += event.count
        elif event.key.startswith(DTOH_COPY_PREFIX):
            counts[DTOH_COPY_PREFIX] += event.count
    return counts


@contextmanager
def recording_sync_sites(sites: Counter):
    """CUDA: torch's sync debug mode ``warn`` for the block; every synchronizing operation it warns
    about is counted in ``sites`` by the Python line that made it (``file:line``)."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sites.update(f"{w.filename}:{w.lineno}" for w in caught if TORCH_SYNC_WARNING in str(w.message))


def profile_call(llm, recorder: StepRecorder, prompts: list, out_dir: Path, label: str, cuda: bool) -> dict:
    """One async call under torch.profiler: chrome trace, tables (appended), top ops, sync counts and,
    on CUDA, the Python lines of the synchronizing operations."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    sites: Counter = Counter()
    with profile(activities=activities) as prof, recording_sync_sites(sites) if cuda else nullcontext():
        call = timed_call(llm, recorder, prompts, "async")
    started = time.perf_counter()
    trace = out_dir / f"trace-{label}.json.gz"
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    keys = {name: key for name, key in SORT_KEYS.items() if cuda or name != "self_cuda"}
    tables = [f"== {label}: top {TOP_OPS} by {name} ==\n{averages.table(sort_by=key, row_limit=TOP_OPS)}\n"
              for name, key in keys.items()]  # fmt: skip
    with open(out_dir / "profile-tables.txt", "a") as f:
        f.write("\n".join(tables) + "\n")
    try:
        attribution = step_attribution(trace)
    except Exception as exc:  # an analysis of the trace: keep the profile without it
        attribution = {"error": repr(exc)}
    return {
        "call": call,
        "steps": len(model_steps(call)),
        "trace": str(trace),
        "trace_bytes": trace.stat().st_size,
        "sync_counts": sync_counts(averages),
        "sync_sites": [{"site": site, "count": n} for site, n in sites.most_common(TOP_SYNC_SITES)],
        "top": {name: top_ops(averages, key) for name, key in keys.items()},
        "attribution": attribution,
        "postprocess_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------------------------
# step attribution (from a chrome trace)


def load_trace_events(path: Path) -> list[dict]:
    """The complete ("X") events of a chrome trace, gzipped or not."""
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return [e for e in data.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e]


def end_us(event: dict) -> float:
    return event["ts"] + event["dur"]


def contains(outer: dict, inner: dict) -> bool:
    """``inner`` lies in ``outer``'s time on the same thread."""
    same_thread = (outer["pid"], outer["tid"]) == (inner["pid"], inner["tid"])
    slack = NESTING_SLACK_US
    return same_thread and outer["ts"] - slack <= inner["ts"] and end_us(inner) <= end_us(outer) + slack


def parent_indices(events: list[dict]) -> list[int | None]:
    """Per event, the index of the innermost other event of its thread that contains it (None: none)."""
    order = sorted(range(len(events)), key=lambda i: (str(events[i]["pid"]), str(events[i]["tid"]),
                                                      events[i]["ts"], -events[i]["dur"]))  # fmt: skip
    parents: list[int | None] = [None] * len(events)
    stack: list[int] = []  # the events containing the current one, innermost last
    for i in order:
        while stack and not contains(events[stack[-1]], events[i]):
            stack.pop()
        parents[i] = stack[-1] if stack else None
        stack.append(i)
    return parents


def per_step_by_name(events, steps: int, top: int) -> list[dict]:
    """The ``top`` names by total time: ms and calls per step."""
    totals: dict[str, list] = {}
    for e in events:
        total = totals.setdefault(e["name"], [0.0, 0])
        total[0] += e["dur"]
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda item: item[1][0], reverse=True)[:top]
    return [{"name": name, "ms": round(us / 1e3 / steps, 3), "calls": round(n / steps, 2)} for name, (us, n) in ranked]


def device_attribution(events: list[dict], kept_ids: dict, kind_of: dict) -> dict[str, dict]:
    """Per step kind, the device windows of the kept steps (``gpu_user_annotation`` ranges of the
    step names, merged per External id: one per stream) and the kernels, copies and sets starting in
    them. Windows are matched to host steps with cores by External id; where no id matches (a trace
    without them), every window with device work counts."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    starts = [e["ts"] for e in device]
    windows: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("cat") == DEVICE_STEP_CATEGORY and e["name"] in kind_of:
            ext = e.get("args", {}).get("External id")
            windows.setdefault((kind_of[e["name"]], id(e) if ext is None else ext), []).append(e)
    by_id = any(ext in kept_ids for _, ext in windows)
    per_kind: dict[str, list] = {}
    for (kind, ext), group in windows.items():
        if by_id and ext not in kept_ids:
            continue
        start, end = min(e["ts"] for e in group), max(end_us(e) for e in group)
        inside = device[bisect_left(starts, start) : bisect_right(starts, end)]
        if inside:
            per_kind.setdefault(kind, []).append((end - start, inside))
    result = {}
    for kind, found in per_kind.items():
        n, work = len(found), [e for _, inside in found for e in inside]
        result[kind] = {"steps": n, "matched_by": "External id" if by_id else "device work",
                        "span_ms": round(sum(span for span, _ in found) / 1e3 / n, 3),
                        "busy_ms": round(sum(e["dur"] for e in work) / 1e3 / n, 3),
                        "top_kernels": per_step_by_name(work, n, TOP_KERNELS)}  # fmt: skip
    return result


def step_attribution(trace_path) -> dict:
    """Where the model steps' time goes, per step kind (``capture`` / ``plain``), from a chrome trace
    of :func:`profile_call` (gzipped or not); times are means per step, in ms.

    Host: the ``user_annotation`` step ranges with at least one recurrent core inside (an op of
    CORE_OPS on the same thread, fully contained, not inside another core; steps without one, the
    empty steps, are counted in ``skipped_steps``): the steps' duration (``host_ms``), the cores'
    (``core_ms``), the cores' direct children (an event inside a core and inside no other event
    there) in total (``children_ms``) and by name (``children``, top TOP_CHILDREN, ms and calls per
    step), the cores' time outside any child (``gaps_ms``: Python), and the first step's cores in
    order (``layer_core_ms``, one per recurrent layer). Device (CUDA traces): see
    :func:`device_attribution` (``span_ms``: window, ``busy_ms``: the sum of its device events)."""
    events = load_trace_events(trace_path)
    host = [e for e in events if e.get("cat") not in (*DEVICE_CATEGORIES, DEVICE_STEP_CATEGORY)]
    parents = parent_indices(host)
    kind_of = {STEP_RANGE.format(kind): kind for kind in STEP_KINDS}
    steps = {i: kind_of[e["name"]] for i, e in enumerate(host)
             if e.get("cat") == "user_annotation" and e["name"] in kind_of}  # fmt: skip
    cores_of: dict[int, list[int]] = {i: [] for i in steps}  # step -> its outermost cores, in time order
    for i in sorted((i for i, e in enumerate(host) if e["name"] in CORE_OPS), key=lambda i: host[i]["ts"]):
        j = parents[i]
        while j is not None and j not in steps and host[j]["name"] not in CORE_OPS:
            j = parents[j]
        if j in steps:
            cores_of[j].append(i)
    core_set = {c for cores in cores_of.values() for c in cores}
    children_of: dict[int, list[dict]] = {c: [] for c in core_set}
    for i, parent in enumerate(parents):
        if parent in core_set:
            children_of[parent].append(host[i])
    kinds, skipped, kept_ids = {}, {}, {}
    for kind in STEP_KINDS:
        of_kind = sorted((i for i, k in steps.items() if k == kind), key=lambda i: host[i]["ts"])
        kept = [i for i in of_kind if cores_of[i]]
        skipped[kind] = len(of_kind) - len(kept)
        if not kept:
            continue
        kept_ids.update((host[i].get("args", {}).get("External id"), kind) for i in kept)
        n, cores = len(kept), [c for i in kept for c in cores_of[i]]
        children = [e for c in cores for e in children_of[c]]
        core_us, children_us = sum(host[c]["dur"] for c in cores), sum(e["dur"] for e in children)
        kinds[kind] = {"steps": n, "host_ms": round(sum(host[i]["dur"] for i in kept) / 1e3 / n, 3),
                       "cores_per_step": round(len(cores) / n, 2), "core_ms": round(core_us / 1e3 / n, 3),
                       "children_ms": round(children_us / 1e3 / n, 3),
                       "gaps_ms": round((core_us - children_us) / 1e3 / n, 3),
                       "children": per_step_by_name(children, n, TOP_CHILDREN),
                       "layer_core_ms": [round(host[c]["dur"] / 1e3, 3) for c in cores_of[kept[0]]]}  # fmt: skip
    kept_ids.pop(None, None)
    for kind, device in device_attribution(events, kept_ids, kind_of).items():
        if kind in kinds:
            kinds[kind]["device"] = device
    return {"trace": str(trace_path), "core_ops": list(CORE_OPS), "kinds": kinds, "skipped_steps": skipped}


def attribution_lines(attribution: dict, top: int = 0) -> list[str]:
    """One line per step kind (host, cores, gaps, the busiest child; GPU span and busy when present)
    and, with ``top``, that many children and kernels and the per-layer cores under each."""
    if "error" in attribution:
        return [f"attribution failed: {attribution['error']}"]
    lines = []
    for kind, a in attribution["kinds"].items():
        line = (f"{kind} x{a['steps']}: host {a['host_ms']:.1f} ms/step, cores {a['core_ms']:.1f} ms "
                f"({a['cores_per_step']:g} per step; gaps {a['gaps_ms']:.1f} ms)")  # fmt: skip
        if a["children"]:
            line += f", top child {a['children'][0]['name']} {a['children'][0]['ms']:.1f} ms"
        if "device" in a:
            line += f"; GPU span {a['device']['span_ms']:.1f} ms, busy {a['device']['busy_ms']:.1f} ms"
        lines.append(line)
        if top:
            lines += [f"    {c['ms']:9.3f} ms {c['calls']:8g} calls  {c['name']}" for c in a["children"][:top]]
            lines.append("    layer cores ms: " + " ".join(f"{x:.2f}" for x in a["layer_core_ms"]))
            kernels = a.get("device", {}).get("top_kernels", [])[:top]
            lines += [f"    {k['ms']:9.3f} ms {k['calls']:8g} calls  GPU {k['name'][:100]}" for k in kernels]
    return lines or [f"no step with a recurrent core ({', '.join(CORE_OPS)})"]


# ---------------------------------------------------------------------------------------------
# one configuration


def run_configuration(
    label: str, section: dict, args: argparse.Namespace, cuda: bool, result: dict, save: Callable[[], None]
) -> None:
    """One engine: startup, rounds (``save()`` after each, so a run cut short keeps them), the
    profiled call; fills ``result``. A failing profile is recorded, not raised: the rounds stand."""
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**engine_kwargs(args, section, on_cpu=not cuda))
    result.update(section=section, startup_s=time.perf_counter() - started, engine=engine_setup(llm, section), calls=[])
    recorder = StepRecorder(llm.llm_engine.engine_core.engine_core, cuda)
    vocab_size = llm.llm_engine.model_config.get_vocab_size()

    def after_round(rep: int) -> None:
        save()
        print(f"[step_profile] {label}: round {rep + 1}/{args.repeat} done, elapsed {elapsed_s():.1f} s", flush=True)

    run_rounds(llm, recorder, args, vocab_size, result["calls"], after_round)
    if args.torch_profile:
        batch = args.profile_batch or max(args.batch)
        prompts = make_prompts(vocab_size, args.prompt_len, batch, f"{args.seed}/profile/{batch}")
        try:
            profiled = profile_call(llm, recorder, prompts, args.torch_profile, label, cuda)
            result["profile"] = {"batch": batch, **profiled}
        except Exception as exc:  # the profile is optional: keep the measured rounds
            result["profile"] = {"batch": batch, "error": repr(exc)}
            print(f"[step_profile] {label}: torch profile failed: {exc!r}", flush=True)
    result["measure_s"] = time.perf_counter() - started - result["startup_s"]
    del llm, recorder
    release_engine()


# ---------------------------------------------------------------------------------------------
# summary


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def calls_of(result: dict, batch: int, mode: str) -> list[dict]:
    return [c for c in result["calls"] if c["batch"] == batch and c["mode"] == mode]


def model_steps(call: dict) -> list[dict]:
    return [s for s in call["steps"] if s["tokens"] > 0]


def step_ms(step: dict) -> float:
    return 1e3 * (step["execute_s"] + step["sample_s"])


def step_spread(steps: list[dict]) -> dict:
    return {"ms": spread(step_ms(s) for s in steps), "tokens": percentile((s["tokens"] for s in steps), 50)}


def summarize_batch(result: dict, batch: int, reference: dict | None) -> dict:
    """Spreads over rounds of one configuration at one batch size; step times from synced calls."""
    by_mode = {mode: calls_of(result, batch, mode) for mode in MODES}
    synced_steps = [s for c in by_mode["synced"] for s in model_steps(c)]
    calls = [*by_mode["async"], *by_mode["synced"]]
    summary = {f"generate_ms_{mode}": spread(ms(c["generate_s"]) for c in by_mode[mode]) for mode in MODES}
    summary.update({
        "steps_per_call": percentile((len(model_steps(c)) for c in calls), 50),
        "capture_steps_per_call": percentile((sum(s["carries_captures"] for s in model_steps(c)) for c in calls), 50),
        "capture_steps": step_spread([s for s in synced_steps if s["carries_captures"]]),
        "other_steps": step_spread([s for s in synced_steps if not s["carries_captures"]]),
        "host_ms_per_step": spread(ms(s["schedule_s"] + s["update_s"]) for s in synced_steps),
        "cached_tokens": sum(c["cached_tokens"] for c in calls),
    })  # fmt: skip
    if reference is not None:
        pairs = zip(sorted(by_mode["async"], key=lambda c: c["rep"]),
                    sorted(calls_of(reference, batch, "async"), key=lambda c: c["rep"]))  # fmt: skip
        summary["vs_reference_async"] = spread(c["generate_s"] / r["generate_s"] for c, r in pairs)
    return summary


def summarize(results: dict, batches: list[int]) -> dict:
    """Per configuration and batch size; ratios against the first configuration, round by round."""
    reference = next(iter(results.values()), None)
    return {label: {str(b): summarize_batch(r, b, None if r is reference else reference) for b in batches}
            for label, r in results.items()}  # fmt: skip


def fmt_spread(s: dict, digits: int = 1) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['p25']:.{digits}f}..{s['p75']:.{digits}f}]"


def fmt_steps(s: dict) -> str:
    return "-" if s["ms"]["median"] is None else f"{s['ms']['median']:.1f} ({s['tokens']:.0f} tok, n={s['ms']['n']})"


def batch_table(summary: dict, batch: int) -> str:
    header = ["config", "call ms async", "/first", "call ms synced", "steps", "capture steps",
              "capture step ms", "other step ms", "host ms/step"]  # fmt: skip
    rows = []
    for label, per_batch in summary.items():
        s = per_batch[str(batch)]
        ratio = s.get("vs_reference_async")
        rows.append([label, fmt_spread(s["generate_ms_async"]), fmt_spread(ratio, 3) if ratio else "-",
                     fmt_spread(s["generate_ms_synced"]), f"{s['steps_per_call']:.0f}",
                     f"{s['capture_steps_per_call']:.0f}", fmt_steps(s["capture_steps"]), fmt_steps(s["other_steps"]),
                     fmt_spread(s["host_ms_per_step"], 2)])  # fmt: skip
    return f"batch {batch} (median [p25..p75] over rounds; step ms from synced calls)\n" + format_table(header, rows)


def configuration_line(label: str, result: dict, batch: int) -> str:
    """Median step time of the largest batch's synced steps that carry capture rows vs the rest, and
    the profiled call's synchronizations (counts, then the busiest Python lines)."""
    steps = [s for c in calls_of(result, batch, "synced") for s in model_steps(c)]
    capture = step_spread([s for s in steps if s["carries_captures"]])
    other = step_spread([s for s in steps if not s["carries_captures"]])
    line = f"{label}: batch {batch}: capture steps {fmt_steps(capture)}; other steps {fmt_steps(other)}"
    profile = result.get("profile")
    if profile and "error" in profile:
        line += f"; profile failed: {profile['error']}"
    elif profile:
        syncs = ", ".join(f"{k} {v}" for k, v in profile["sync_counts"].items() if v)
        line += f"; profiled call (batch {profile['batch']}): {profile['steps']} steps"
        line += f", syncs: {syncs or 'none recorded'}"
        line += "".join(f"\n    {site['count']:6d}  {site['site']}" for site in profile["sync_sites"][:5])
        if "attribution" in profile:
            line += "".join(f"\n    steps: {text}" for text in attribution_lines(profile["attribution"]))
    return line


# ---------------------------------------------------------------------------------------------
# output


def machine(cuda: bool) -> dict:
    import torch
    import vllm

    info = {**machine_info(), "torch": torch.__version__, "torch_cuda": torch.version.cuda, "vllm": vllm.__version__,
            "cuda_available": cuda, "gpu": None, "git_commit": None}  # fmt: skip
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        info["gpu"] = command_output(query)
    info["git_commit"] = command_output(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"])
    return info


def command_output(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.attribute:
        for trace in args.attribute:
            print(f"{trace}:\n  " + "\n  ".join(attribution_lines(step_attribution(trace), top=TOP_DETAIL)))
        return 0
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.pop(POLICY_ENV, None)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.model is None:
        from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

        args.model = str(make_tiny_model(default_model_dir("qwen3_next", 0), family="qwen3_next", seed=0))
    if args.torch_profile:
        args.torch_profile.mkdir(parents=True, exist_ok=True)
        (args.torch_profile / "profile-tables.txt").write_text("")
    out = {
        "meta": {"argv": sys.argv, "command": " ".join(sys.argv), "started_utc": utc_now(), "machine": machine(cuda),
                 "sync_note": SYNC_NOTE},
        "settings": {"prompt_len": args.prompt_len, "batches": args.batch, "repeat": args.repeat,
                     "warmup": args.warmup, "seed": args.seed, "max_tokens": 1, "sections": args.sections,
                     "additional_config": args.additional_config, "llm_kwargs": args.llm_kwargs, "model": args.model},
        "configs": {},
    }  # fmt: skip

    def save() -> None:
        out["meta"].update(elapsed_s=elapsed_s(), updated_utc=utc_now())
        write_json(args.out, out)

    print(f"[step_profile] {SYNC_NOTE}", flush=True)
    for label, section in args.sections.items():
        print(f"[step_profile] {label}: starting engine {json.dumps(section)}, elapsed {elapsed_s():.1f} s", flush=True)
        result = out["configs"][label] = {}
        run_configuration(label, section, args, cuda, result, save)
        out["summary"] = summarize(out["configs"], args.batch)
        save()
        print(f"[step_profile] {label}: startup {result['startup_s']:.1f} s, measurement {result['measure_s']:.1f} s, "
              f"elapsed {elapsed_s():.1f} s; prompt capture {json.dumps(result['engine'].get('prompt_capture'))}",
              flush=True)  # fmt: skip
    print()
    for batch in args.batch:
        print(batch_table(out["summary"], batch) + "\n")
    for label, result in out["configs"].items():
        print(configuration_line(label, result, max(args.batch)))
    print(f"\n[step_profile] wrote {args.out}; elapsed {elapsed_s():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
