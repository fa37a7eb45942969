"""``bc-bench``'s command line: its options and the checks that tie them together.

Contract: ``build_parser`` defines every option (help texts name a default only where it says
something, :class:`DefaultsOnceHelpFormatter`); ``parse_args`` parses ``argv`` and exits with
usage status 2 on an inconsistent combination (e.g. ``--sleep-others`` with ``--relaunch``), and
returns the namespace resolved for ``cli.main``: ``in_flight`` as a list of levels, ``turns`` 1
under ``--turn1-only``, ``policies`` and ``sections`` (one ``boundary_checkpoints`` section per
launched label, ``--variant`` included), ``label_args`` (``--variant-arg``'s flags per label) and,
for ``--url``, one ``label`` per URL.
"""

from __future__ import annotations

import argparse
import json
import shlex

from bc_tools.bench.stats import PLUGIN_POLICY, STOCK_POLICY
from bc_tools.bench.workload import MODES, TURN_ORDERS
from bc_tools.fixtures import tiny_models

ARCHES = ("tiny", *tiny_models.REAL_SIZE_ARCHES)


def parse_in_flight(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (each >= 1, in the given order, duplicates dropped)."""
    levels: list[int] = []
    for item in text.split(","):
        level = int(item)
        if level < 1:
            raise ValueError(f"in-flight levels must be >= 1 (got {level})")
        if level not in levels:
            levels.append(level)
    if not levels:
        raise ValueError("no in-flight level")
    return levels


def split_server_args(values: list[str]) -> list[str]:
    return [arg for v in values for arg in shlex.split(v)]


class DefaultsOnceHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help only where that says something: not where the
    help text already names its default (``(default: a new temp dir)`` would otherwise be followed
    by ``(default: None)``), and not for a default of None, a flag's False/True or an empty list."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower():
            return text
        if action.default is None or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action.default, bool) or action.default == []:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bc-bench",
        description="Multi-turn serving benchmark: boundary checkpoints vs stock prefix caching, and a floor.",
        formatter_class=DefaultsOnceHelpFormatter,
    )
    tgt = p.add_argument_group("target")
    tgt.add_argument(
        "--url",
        action="append",
        default=[],
        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (repeatable: one per --label)",
    )
    tgt.add_argument(
        "--label",
        action="append",
        default=[],
        help="--url: the name of each server in the report (e.g. aligned, request_boundaries)",
    )
    tgt.add_argument(
        "--server-log",
        action="append",
        default=[],
        help="--url: each server's log (plugin stats, block size), in --url order",
    )
    tgt.add_argument("--launch", metavar="MODEL_DIR", help="launch vLLM servers for this model directory")
    tgt.add_argument("--model", help="served model name (--url: required; --launch: default the directory name)")
    tgt.add_argument(
        "--policies",
        default=f"{STOCK_POLICY},{PLUGIN_POLICY}",
        help="--launch: comma-separated policies, one server each",
    )
    tgt.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="--launch: one more server named LABEL whose boundary_checkpoints section is JSON "
        '(repeatable), e.g. \'no_prompt={"policy": "request_boundaries", '
        '"prompt_checkpoints": false}\'',
    )
    tgt.add_argument(
        "--variant-arg",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="--launch: extra vLLM flags (shell-split) for the server LABEL only, after --server-arg; "
        "repeatable. Stock at its best setting beside the default: --variant "
        '\'aligned_unit16={"policy": "aligned"}\' --variant-arg '
        "'aligned_unit16=--prefix-match-unit 16'",
    )
    tgt.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="--launch: extra vLLM flag(s), repeatable, shell-split (e.g. "
        "--server-arg='--load-format dummy'); later flags override the launcher's defaults",
    )
    tgt.add_argument(
        "--additional-config",
        default=None,
        metavar="JSON",
        help="--launch: extra keys merged into every server's --additional-config",
    )
    tgt.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--launch: extra environment variable for the servers, repeatable",
    )
    tgt.add_argument("--host", default="127.0.0.1", help="--launch: the address the servers listen on")
    tgt.add_argument(
        "--port",
        type=int,
        default=None,
        help="--launch: the first server's port, the others follow (default: free ports)",
    )
    tgt.add_argument(
        "--relaunch",
        action="store_true",
        help="--launch: one server at a time, started and stopped around each slot (default: every server up at once)",
    )
    tgt.add_argument(
        "--sleep-others",
        action="store_true",
        help="every server started once, only the slot's server awake (vLLM's sleep mode): before "
        "each slot every other server is put to sleep (POST /sleep?level=1: weights to CPU RAM, KV "
        "cache and prefix cache dropped) and the slot's server woken (POST /wake_up), then warmed up "
        "again with --warmup's conversations after every wake (its KV cache was discarded; CUDA "
        "graphs stay). --launch adds --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 and starts the "
        "servers one by one, each asleep before the next starts; --url servers need both. The "
        "seconds to wake, sleep and warm up per slot go to --out-json's servers. Not with --relaunch",
    )
    tgt.add_argument(
        "--keep-servers",
        default=None,
        metavar="FILE",
        help="--launch --sleep-others: leave the servers running after the run, recorded in FILE; a "
        "later run with the same launch and FILE adopts the live ones instead of starting them, one "
        "with another launch stops them first (python -m bc_tools.bench.kept_servers --stop FILE "
        "stops them). Give --log-dir a folder that outlives the runs",
    )
    tgt.add_argument(
        "--start-one-by-one",
        action="store_true",
        help="--launch: start each server once the previous one is healthy (all stay up): "
        "vLLM's memory profile counts what servers starting beside it take on the GPU",
    )
    tgt.add_argument(
        "--startup-timeout", type=float, default=900.0, help="--launch: seconds a server may take to answer /health"
    )
    tgt.add_argument("--log-dir", default=None, help="--launch: server logs (default: a new temp dir)")
    tgt.add_argument(
        "--stats-log-interval",
        type=float,
        default=1.0,
        help="plugin stats_log_interval_s (seconds between its bytes_retained lines)",
    )
    tgt.add_argument(
        "--no-plugin-log-config",
        dest="plugin_log_config",
        action="store_false",
        help="--launch: do not route the plugin's INFO log lines into the server log",
    )
    wl = p.add_argument_group("workload")
    wl.add_argument(
        "--mode",
        choices=MODES,
        default="tokens",
        help="tokens: /v1/completions with token-id prompts; chat: /v1/chat/completions with "
        "messages (a system message shared by every conversation of a slot, a user message "
        "per turn, each answer sent back as an assistant message)",
    )
    wl.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="--mode chat: draw the messages' words from DIR/tokenizer.json, one token each "
        "(default: --launch's model directory; without one, or a tokenizer without enough "
        "single-token words, the tiny model's words w8..w1023)",
    )
    wl.add_argument(
        "-N", "--conversations", type=int, default=4, help="conversations per slot (at least the in-flight level)"
    )
    wl.add_argument("-T", "--turns", type=int, default=4, help="turns per conversation")
    wl.add_argument(
        "-S",
        "--system-tokens",
        type=int,
        default=300,
        help="system-like prefix ids of each conversation's turn 1 (chat: words of the system message)",
    )
    wl.add_argument(
        "-U", "--user-tokens", type=int, default=60, help="new user ids per turn (chat: words of each user message)"
    )
    wl.add_argument("-A", "--answer-tokens", type=int, default=32, help="tokens per answer (max_tokens, ignore_eos)")
    wl.add_argument(
        "-C",
        "--in-flight",
        default="2",
        help="conversations driven at once; a comma-separated list sweeps the levels (e.g. 1,8,32,64)",
    )
    wl.add_argument(
        "--turn1-only",
        action="store_true",
        help="every conversation one turn (-T ignored); tokens mode: each with its own system ids, "
        "nothing is reused; chat mode: all share the system message",
    )
    wl.add_argument(
        "--turn-order",
        choices=TURN_ORDERS,
        default="each",
        help="each: a conversation's turns back to back; rounds: turn k of every conversation before "
        "any turn k + 1, so a conversation's next turn waits for all others (KV cache pressure)",
    )
    wl.add_argument("--think-time", type=float, default=0.0, metavar="S",
                    help="mean seconds a user pauses before each next turn (exponential, seeded per conversation "
                    "and turn, the same for every label; default 0: at once, so conversations that start "
                    "together send their next turns together)")  # fmt: skip
    wl.add_argument("--repeat", type=int, default=5, help="rounds per in-flight level, alternating the labels")
    wl.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start a round only if it is expected to end within SECONDS of the run's start "
        "(server starts included; estimate: the longest round so far), stop a server still "
        "starting when it ends, and report the rounds that ran: for runs under a hard time "
        "limit (leave the stop's grace, up to 25 s per server, before that limit)",
    )
    wl.add_argument("--seed", type=int, default=0, help="seed of the workload's random ids")
    wl.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="random ids come from [4, vocab) (default: the model directory's config.json)",
    )
    wl.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="throw-away 2-turn conversations per server start (--sleep-others: and per wake), sent all at once",
    )
    wl.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    fl = p.add_argument_group("floor")
    fl.add_argument(
        "--floor",
        dest="floor",
        action="store_true",
        default=None,
        help="measure the floor (default: on with --launch when aligned is a policy; off with --url)",
    )
    fl.add_argument("--no-floor", dest="floor", action="store_false", help="do not measure the floor")
    fl.add_argument(
        "--block-size", type=int, default=None, help="engine block size B (default: parsed from the server log)"
    )
    out = p.add_argument_group("output")
    out.add_argument("--out-json", default=None, help="write the result and every per-request record")
    out.add_argument("--plot", default=None, help="PNG of TTFT p50 per level and per turn (needs matplotlib)")
    out.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    mk = p.add_argument_group("model directory")
    mk.add_argument("--write-model", metavar="DIR", default=None, help="write a model directory first")
    mk.add_argument(
        "--arch",
        choices=ARCHES,
        default="tiny",
        help="--write-model: the model to write (tiny: the random-weight tiny Qwen3-Next; the "
        "others: real-size configs for --load-format dummy)",
    )
    mk.add_argument(
        "--write-dflash-drafter",
        metavar="DIR",
        default=None,
        help="also write a random-weight DFlash drafter sized to the model (--write-model's or "
        '--launch\'s) for --server-arg=\'--speculative-config {"method": "dflash", '
        '"model": DIR, ...}\'',
    )
    mk.add_argument(
        "--dflash-variant",
        choices=("dflash", "dflash2"),
        default="dflash",
        help="--write-dflash-drafter: which drafter to write",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.url and args.launch:
        p.error("--url and --launch are mutually exclusive")
    if not (args.url or args.launch or args.write_model):
        p.error("give --url, --launch or --write-model")
    if args.sleep_others and args.relaunch:
        p.error("--sleep-others and --relaunch are mutually exclusive: --sleep-others starts every server "
                "once and keeps all but the slot's asleep, --relaunch starts one server per slot")  # fmt: skip
    if args.keep_servers and not (args.launch and args.sleep_others):
        p.error("--keep-servers needs --launch and --sleep-others: a kept server is put to sleep when a run "
                "adopts it, so that its first slot wakes it with an empty cache")  # fmt: skip
    if args.write_dflash_drafter and not (args.write_model or args.launch):
        p.error("--write-dflash-drafter needs the target model: --write-model or --launch")
    if args.url and not args.model:
        p.error("--url needs --model")
    if args.url:
        if not args.label:
            args.label = ["server"] if len(args.url) == 1 else [f"server{i + 1}" for i in range(len(args.url))]
        if len(args.label) != len(args.url) or len(set(args.label)) != len(args.label):
            p.error("give one distinct --label per --url")
        if len(args.server_log) > len(args.url):
            p.error("at most one --server-log per --url")
    try:
        args.in_flight = parse_in_flight(args.in_flight)
    except ValueError as err:
        p.error(f"--in-flight: {err}")
    if args.turn1_only:
        args.turns = 1
    if args.tokenizer and args.mode != "chat":
        p.error("--tokenizer applies to --mode chat only")
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.sections = {policy: {"policy": policy} for policy in args.policies}
    for item in args.variant:
        label, _, text = item.partition("=")
        try:
            section = json.loads(text)
            if not isinstance(section, dict):
                raise ValueError("not an object")
        except ValueError as err:
            p.error(f"--variant takes LABEL=JSON object (got {item!r}: {err})")
        if not label or label in args.sections:
            p.error(f"--variant needs a new label (got {label!r})")
        args.sections[label] = section
    args.policies += [label for label in args.sections if label not in args.policies]
    args.label_args = {}
    for item in args.variant_arg:
        label, _, flags = item.partition("=")
        if label not in args.sections or not flags.strip():
            p.error(f"--variant-arg takes LABEL=FLAGS for a launched label {list(args.sections)} (got {item!r})")
        args.label_args.setdefault(label, []).extend(shlex.split(flags))
    for name in ("conversations", "turns", "answer_tokens", "user_tokens", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.time_budget is not None and args.time_budget <= 0:
        p.error("--time-budget must be > 0 seconds")
    if args.system_tokens < 0:
        p.error("--system-tokens must be >= 0")
    if not args.think_time >= 0:
        p.error("--think-time must be >= 0 seconds")
    for item in args.server_env:
        if "=" not in item or not item.split("=", 1)[0]:
            p.error(f"--server-env takes KEY=VALUE (got {item!r})")
    if args.additional_config:
        try:
            if not isinstance(json.loads(args.additional_config), dict):
                raise ValueError("not an object")
        except ValueError as err:
            p.error(f"--additional-config must be a JSON object: {err}")
    return args
