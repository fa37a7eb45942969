"""``bc-bench``: the multi-turn serving benchmark, request-boundary checkpoints vs stock prefix
caching, with the exact-prefix floor, interleaved repetitions and an in-flight sweep.

Contract: parses the command line (``cli_args``), resolves it into ``run_settings.Settings`` and a
``server_sets.ServerSet`` (``--launch MODEL_DIR``: vLLM servers it starts and stops itself; ``--url``
(repeatable, with ``--label``): servers that already run), runs ``runner.run_benchmark``, prints
``report.level_text`` for every in-flight level, and writes ``--out-json`` (the result plus
``meta``: argv, UTC start and end, salt, machine; rewritten after every round, so a run killed from
outside leaves the rounds it finished, with ``complete`` false) and ``--plot``. With ``--time-budget`` only the
rounds expected to end within it run, and a server still starting when it ends is stopped
(``run_settings``' contract). ``--sleep-others`` keeps only the slot's server awake (``server_sets``'
contract) and prints the median seconds to wake and to put to sleep. Exit code 0; 1 if a
conversation request failed, no round fitted the time budget or a server could not be put to sleep
or woken (the reason on stderr); 2 on a usage error; 130 when interrupted (servers are stopped in
every case).
``--write-model DIR --arch ARCH`` first writes a model directory with
``fixtures.tiny_models`` (the tiny Qwen3-Next, or a real-size config-only one for
``--load-format dummy``); ``--write-dflash-drafter DIR`` a random-weight DFlash (or DFlash2)
drafter sized to that model (``fixtures.dflash``). ``--mode chat`` sends every conversation through
``/v1/chat/completions`` as messages (a system message of about ``-S`` tokens shared by every
conversation of a slot, ``-U`` tokens of user text per turn, each answer's text sent back), with
words drawn from the model's tokenizer vocabulary (``chat_words``).
See ``benchmarks/README.md`` for the workload and metric definitions.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import sys
import time
import uuid
from pathlib import Path

from bc_tools.bench import chat_words, logs, report, stats
from bc_tools.bench.cli_args import parse_args, split_server_args
from bc_tools.bench.run_settings import Settings
from bc_tools.bench.runner import run_benchmark
from bc_tools.bench.server import interrupt_on_termination
from bc_tools.bench.server_sets import LaunchedServers, LaunchSpec, ServerSet, UrlServers, write_logging_config
from bc_tools.bench.sleep_mode import SleepModeError
from bc_tools.bench.stats import STOCK_POLICY
from bc_tools.bench.traffic import Target
from bc_tools.bench.workload import Workload
from bc_tools.fixtures import tiny_models


def model_vocab_size(model_dir: str) -> int | None:
    """``vocab_size`` of a model directory's config.json (text_config first), or None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (config.get("text_config") or {}).get("vocab_size") or config.get("vocab_size")


def machine_info() -> dict:
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "nproc": os.cpu_count(), "mem_bytes": mem,
            "platform": platform.platform(), "python": platform.python_version()}  # fmt: skip


def switch_line(servers: dict[str, dict]) -> str:
    """``--sleep-others``' cost: median seconds to wake a server and to put one to sleep, per slot."""
    entries = [entry for info in servers.values() for entry in info.get("sleep_others", [])]
    wakes = [e["wake_s"] for e in entries if e["wake_s"] is not None]
    sleeps = [s["s"] for e in entries for s in e["sleep_s"].values()]
    warmups = [e["warmup_s"] for e in entries if e["warmup_s"] is not None]
    fmt = lambda xs: "-" if not xs else f"{stats.percentile(xs, 50):.2f} s (n={len(xs)})"  # noqa: E731
    return f"sleep-others: wake {fmt(wakes)}, sleep {fmt(sleeps)}, warm-up after a wake {fmt(warmups)}"


def _servers(args: argparse.Namespace, settings: Settings) -> ServerSet:
    """The server set of ``args``; also resolves the floor label and, for --url, the block size."""
    labels = settings.labels
    if args.launch:
        if args.floor is not False and STOCK_POLICY in labels:
            settings.floor_label = STOCK_POLICY
        env = dict(item.split("=", 1) for item in args.server_env)
        if args.plugin_log_config:
            write_logging_config(env)
        log_dir = Path(args.log_dir) if args.log_dir else None
        spec = LaunchSpec(
            model_dir=args.launch, model_name=args.model or Path(args.launch).name, sections=args.sections,
            host=args.host, port=args.port, server_args=split_server_args(args.server_arg), label_args=args.label_args,
            additional_config=json.loads(args.additional_config) if args.additional_config else {},
            env=env, startup_timeout=args.startup_timeout, relaunch=args.relaunch,
            one_by_one=args.start_one_by_one, keep_file=Path(args.keep_servers) if args.keep_servers else None,
            **({"log_dir": log_dir} if log_dir else {}),
        )  # fmt: skip
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        print(f"server logs: {spec.log_dir}", flush=True)
        return LaunchedServers(settings, spec)
    log_paths = args.server_log + [None] * (len(args.url) - len(args.server_log))
    targets = [Target(label, url.rstrip("/"), args.model, log)
               for label, url, log in zip(args.label, args.url, log_paths)]  # fmt: skip
    if args.floor:
        settings.floor_label = STOCK_POLICY if STOCK_POLICY in labels else labels[0]
        floor_log = next(t.log_path for t in targets if t.label == settings.floor_label)
        settings.block_size, settings.block_size_source = logs.resolve_block_size(
            args.block_size, logs.read_text(floor_log), []
        )
    return UrlServers(settings, targets)


def write_json(path: Path, result: dict) -> None:
    """Write ``result`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_model:
        start = time.monotonic()
        if args.arch == "tiny":
            out = tiny_models.make_tiny_model(args.write_model, family="qwen3_next", seed=0)
        else:
            out = tiny_models.write_real_size_model(args.write_model, args.arch)
        print(f"model directory ({args.arch}): {out} ({time.monotonic() - start:.1f} s)")
    if args.write_dflash_drafter:
        from bc_tools.fixtures.dflash import write_dflash_drafter

        target = args.write_model or args.launch
        drafter = write_dflash_drafter(args.write_dflash_drafter, target, variant=args.dflash_variant)
        print(f"{args.dflash_variant} drafter for {target}: {drafter}")
    if args.write_model and not (args.url or args.launch):
        return 0
    vocab = args.vocab_size or (model_vocab_size(args.launch) if args.launch else None)
    if vocab is None:
        print("error: --vocab-size is needed (no model directory to read it from)", file=sys.stderr)
        return 2
    workload = Workload(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                        user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                        concurrency=args.in_flight[0], vocab_size=vocab, seed=args.seed,
                        shared_system=not args.turn1_only or args.mode == "chat", mode=args.mode,
                        turn_order=args.turn_order, think_time_s=args.think_time)  # fmt: skip
    words = chat_words.TINY_WORDS
    if args.mode == "chat":
        source = args.tokenizer or args.launch
        words = chat_words.tokenizer_words(source) or chat_words.TINY_WORDS
        origin = f"{source}/tokenizer.json" if words is not chat_words.TINY_WORDS else "the tiny model's w8..w1023"
        print(f"chat mode: {len(words)} single-token words from {origin}", flush=True)
    labels = args.policies if args.launch else args.label
    settings = Settings(
        workload=workload, labels=labels, in_flight=args.in_flight, repeat=args.repeat,
        run_salt=f"bench-{uuid.uuid4().hex[:12]}", block_size=args.block_size,
        block_size_source="--block-size" if args.block_size else "unknown", warmup=args.warmup,
        stats_log_interval=args.stats_log_interval, request_timeout=args.request_timeout,
        time_budget_s=args.time_budget, chat_words=words, sleep_others=args.sleep_others,
    )  # fmt: skip
    if args.launch:
        max_len = logs.server_arg_value(["--max-model-len", "4096", *split_server_args(args.server_arg)],
                                        "--max-model-len")  # fmt: skip
        if max_len and max_len.isdigit() and workload.max_sequence_tokens() > int(max_len):
            print(f"error: the last turn needs {workload.max_sequence_tokens()} tokens but --max-model-len is "
                  f"{max_len}: pass --server-arg='--max-model-len N'", file=sys.stderr)  # fmt: skip
            return 2
    servers = _servers(args, settings)
    meta = {
        "argv": ["bc-bench", *(sys.argv[1:] if argv is None else argv)],
        "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run_salt": settings.run_salt,
        "machine": machine_info(),
    }

    def finish(result: dict) -> dict:
        result["workload"]["turn1_only"] = args.turn1_only
        result["meta"] = dict(meta, finished_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        return result

    rounds_written: list[int] = []

    def write_rounds_so_far(result: dict) -> None:
        write_json(Path(args.out_json), finish(result))
        rounds_written.append(sum(len(level["rounds"]) for level in result["levels"]))

    try:
        with interrupt_on_termination():
            result = run_benchmark(settings, servers, on_round=write_rounds_so_far if args.out_json else None)
    except KeyboardInterrupt:
        kept = f"; {rounds_written[-1]} rounds done are in {args.out_json}" if rounds_written else ""
        print(f"\ninterrupted; servers stopped{kept}", file=sys.stderr)
        return 130
    except SleepModeError as err:
        print(f"error: --sleep-others: {err}", file=sys.stderr)
        return 1
    finish(result)
    for level in result["levels"]:
        print()
        print(report.level_text(result, level, markdown=args.markdown))
    print(f"\nblock size B = {result['block_size']} ({result['block_size_source']})")
    if args.sleep_others:
        print(switch_line(result["servers"]))
    if result["stopped_early"]:
        done = ", ".join(f"{len(lv['rounds'])} at {lv['in_flight']} in flight" for lv in result["levels"]) or "none"
        print(f"stopped by --time-budget {args.time_budget:g} s; rounds done: {done} (of {args.repeat} per level)")
    if args.out_json:
        write_json(Path(args.out_json), result)
        print(f"result: {args.out_json}")
    if args.plot and result["levels"] and report.plot_result(result, Path(args.plot)):
        print(f"plot: {args.plot}")
    errors = sum(rd["policies"][p]["errors"] for lv in result["levels"] for rd in lv["rounds"] for p in labels)
    return 1 if errors or not result["levels"] else 0


if __name__ == "__main__":
    sys.exit(main())
