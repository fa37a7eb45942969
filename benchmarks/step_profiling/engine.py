"""Engines and timed calls of ``benchmarks/step_profile.py``: the step recorder wrapped around one
engine core, the engine settings, the prompts and the rounds (its docstring has the contract)."""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

from bc_tools.bench.stats import PLUGIN_POLICY, STOCK_POLICY
from bc_tools.bench.workload import draw_ids, round_order
from boundary_checkpoints.core.step_copies import CAPTURE_COPIES_ATTR, IN_STEP_CAPTURES_ATTR, POST_FORWARD_COPIES_ATTR
from boundary_checkpoints.prompt_capture import IN_STEP, STOP

CONFIGS = {
    "aligned": {"policy": STOCK_POLICY},
    "in_step": {"policy": PLUGIN_POLICY, "prompt_capture": IN_STEP},
    "stop": {"policy": PLUGIN_POLICY, "prompt_capture": STOP},
}
MODES = ("async", "synced")
STEP_RECORD_ATTR = "step_profile_record"  # set on each SchedulerOutput by the wrapped schedule()
STEP_RANGE = "bc_execute_model[{}]"  # one range per execute_model call, named by step kind
STEP_KINDS = ("capture", "plain")
STARTED = time.perf_counter()


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


def default_max_model_len(call_len: int) -> int:
    return max(4096, call_len + 1)


def call_len(args: argparse.Namespace) -> int:
    """Tokens of a timed call's prompt: ``--prompt-len``, plus the answer and follow-up of a next turn."""
    return args.prompt_len + (args.answer + args.next_turn if args.next_turn else 0)


# ---------------------------------------------------------------------------------------------
# engines


def engine_kwargs(args: argparse.Namespace, section: dict, on_cpu: bool) -> dict:
    """``vllm.LLM`` arguments: the package's usual engine settings, then ``--llm-kwargs``."""
    kwargs = dict(model=args.model, dtype="bfloat16", mamba_ssm_cache_dtype="float32",
                  max_model_len=default_max_model_len(call_len(args)), enable_prefix_caching=True, seed=0,
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
    return [TokensPrompt(prompt_token_ids=draw_ids(rng, length, vocab_size)) for _ in range(batch)]


def call_prompts(llm, args: argparse.Namespace, vocab_size: int, batch: int, tag: str) -> list:
    """The prompts of one timed call: ``batch`` fresh ones, or with ``--next-turn N`` their next
    turns: each fresh prompt first runs untimed with ``--answer`` tokens (greedy, ``ignore_eos``),
    then the timed prompt is that prompt, its answer and N fresh tokens, so every row of the timed
    call resumes a conversation whose previous turn just ended (the plugin restores its response
    boundary; stock its block grid)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = make_prompts(vocab_size, args.prompt_len, batch, tag)
    if not args.next_turn:
        return prompts
    answering = SamplingParams(max_tokens=args.answer, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(prompts, answering, use_tqdm=False)
    rng = random.Random(f"{tag}/next")
    return [TokensPrompt(prompt_token_ids=[*prompt["prompt_token_ids"], *out.outputs[0].token_ids,
                                           *draw_ids(rng, args.next_turn, vocab_size)])
            for prompt, out in zip(prompts, outputs, strict=True)]  # fmt: skip


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
            timed_call(llm, recorder, call_prompts(llm, args, vocab_size, batch, f"warmup/{index}/{batch}"), "async")
    for rep in range(args.repeat):
        for batch in round_order(args.batch, rep):
            for mode in round_order(MODES, rep):
                prompts = call_prompts(llm, args, vocab_size, batch, f"{args.seed}/{rep}/{batch}/{mode}")
                calls.append({"rep": rep, "batch": batch, **timed_call(llm, recorder, prompts, mode)})
        after_round(rep)


def model_steps(call: dict) -> list[dict]:
    return [s for s in call["steps"] if s["tokens"] > 0]
