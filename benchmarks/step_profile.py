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
* ``--next-turn N``: the timed calls are next turns instead. Each call's fresh prompts first run
  untimed with ``--answer`` tokens (default 64); the timed call sends each prompt with its answer
  and N fresh tokens, so all B rows resume at once a conversation whose turn just ended (what
  conversations running in step send): the plugin restores each response boundary, stock its
  block grid, and ``cached_tokens`` records both.
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
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from bc_tools.bench.server_sets import POLICY_ENV

BENCHMARKS_DIR = str(Path(__file__).resolve().parent)
if BENCHMARKS_DIR not in sys.path:  # loaded by its path (tests): the package beside it must import too
    sys.path.insert(0, BENCHMARKS_DIR)

from step_profiling.engine import (  # noqa: E402
    CONFIGS,
    StepRecorder,
    call_len,
    call_prompts,
    default_max_model_len,
    elapsed_s,
    engine_kwargs,
    engine_setup,
    release_engine,
    run_rounds,
)
from step_profiling.report import (  # noqa: E402
    SYNC_NOTE,
    batch_table,
    configuration_line,
    machine,
    summarize,
    utc_now,
    write_json,
)
from step_profiling.trace import TOP_DETAIL, attribution_lines, profile_call, step_attribution  # noqa: E402

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
    p.add_argument("--next-turn", type=int, default=0, metavar="N",
                   help="time next turns: each prompt answered untimed, then resent with N more tokens")  # fmt: skip
    p.add_argument("--answer", type=int, default=64, help="answer tokens before a next turn (default 64)")
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
    if args.next_turn < 0 or args.answer < 1:
        p.error("--next-turn must be >= 0 and --answer >= 1")
    if call_len(args) + 1 > args.llm_kwargs.get("max_model_len", default_max_model_len(call_len(args))):
        p.error("a timed call's prompt (--prompt-len, with --answer and --next-turn) + 1 exceeds max_model_len")
    return args


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
        prompts = call_prompts(llm, args, vocab_size, batch, f"{args.seed}/profile/{batch}")
        try:
            profiled = profile_call(llm, recorder, prompts, args.torch_profile, label, cuda)
            result["profile"] = {"batch": batch, **profiled}
        except Exception as exc:  # the profile is optional: keep the measured rounds
            result["profile"] = {"batch": batch, "error": repr(exc)}
            print(f"[step_profile] {label}: torch profile failed: {exc!r}", flush=True)
    result["measure_s"] = time.perf_counter() - started - result["startup_s"]
    del llm, recorder
    release_engine()


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
                     "warmup": args.warmup, "seed": args.seed, "max_tokens": 1, "next_turn": args.next_turn,
                     "answer": args.answer if args.next_turn else None, "sections": args.sections,
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
