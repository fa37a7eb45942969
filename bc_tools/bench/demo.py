"""``bc-demo``: a multi-turn conversation against vLLM with and without boundary checkpoints.

For each policy (default ``request_boundaries``, then ``aligned`` = stock vLLM behaviour) the demo
starts one OpenAI server on 127.0.0.1 with the tiny Qwen3-Next model, drives the same N-turn
conversation through it (``demo_conversation``), and stops the server, also on errors and
interrupts. Servers run one after the other: on a 2-core machine two CPU engines at once would
compete for the cores and distort the TTFT columns. Before its conversation each server gets one
throw-away request of turn 1's shape under its own ``cache_salt`` (its TTFT is printed, not
tabled), so turn 1's TTFT does not carry the server's first-request costs. Then it prints the
table, one verdict line per policy and, for each plugin server, its counter line
(``demo_table``), and writes ``--json-out``. Plugin and stock answers are not compared with each
other: the plugin ends a prefill chunk one token before the prompt end, and on a random-weight
model that alone can flip a near-tie. Exit code 0; 1 if a server failed to start; 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from bc_tools.bench import logs
from bc_tools.bench.demo_conversation import (
    ChatPlan,
    ConversationPlan,
    TurnResult,
    make_chat_plan,
    make_plan,
    read_checkpoint_counters,
    run_chat_conversation,
    run_conversation,
    warm_up,
)
from bc_tools.bench.demo_table import LEGEND, POLICY_LABELS, counter_line, format_ms, format_table, verdict
from bc_tools.bench.server import (
    ServerProcess,
    ServerStartError,
    interrupt_on_termination,
    policy_config,
    start_server,
    stop_server,
    wait_until_healthy,
)

# The plugin lets this variable override --additional-config; the demo sets the policy per server.
POLICY_ENV = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"
MODES = ("tokens", "chat")


class Progress:
    """Spinner with elapsed seconds on a terminal; a line every 5 s otherwise."""

    FRAMES = "|/-\\"

    def __init__(self, label: str, stream=sys.stderr):
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.ticks = 0
        self.last_line = 0.0

    def tick(self, elapsed: float) -> None:
        self.ticks += 1
        if self.tty:
            frame = self.FRAMES[self.ticks % len(self.FRAMES)]
            self.stream.write(f"\r  {frame} {self.label} {elapsed:5.1f} s ")
            self.stream.flush()
        elif elapsed - self.last_line >= 5.0:
            self.last_line = elapsed
            self.stream.write(f"  ... {self.label} {elapsed:.0f} s\n")
            self.stream.flush()

    def done(self, message: str) -> None:
        if self.tty:
            self.stream.write("\r" + " " * (len(self.label) + 16) + "\r")
        self.stream.write(f"  {message}\n")
        self.stream.flush()


@dataclass
class PolicyRun:
    """What one server's run gave: the table rows and what the demo prints around them."""

    results: list[TurnResult]
    ready_s: float
    warmup_ttft_s: float | None = None
    counters: dict | None = None  # parse_checkpoint_counters of /metrics after the last request
    log_stats: dict | None = None  # the server log's last periodic boundary_checkpoints stats line


def run_policy(
    policy: str,
    model_dir: Path,
    log_dir: Path,
    plan: ConversationPlan | ChatPlan,
    *,
    max_tokens: int,
    startup_timeout: float,
    seed: int = 0,
) -> PolicyRun:
    """Start a server with ``policy``, warm it up with one throw-away request, run the
    conversation, read its counters, stop it."""
    log_path = log_dir / f"server_{policy}.log"
    server: ServerProcess | None = None
    try:
        server = start_server(model_dir, log_path, additional_config=policy_config(policy), unset_env=(POLICY_ENV,))
        progress = Progress(f"starting vLLM ({policy}, port {server.port})")
        ready_s = wait_until_healthy(server, timeout=startup_timeout, on_tick=progress.tick)
        progress.done(f"{policy}: server ready in {ready_s:.1f} s (pid {server.pid})")
        warm = warm_up(server.base_url, plan, max_tokens=max_tokens, seed=seed)
        print(f"  {policy}: warm-up request (turn 1's shape, its own cache_salt, not in the table): "
              f"TTFT {format_ms(warm.ttft_s)} ms", flush=True)  # fmt: skip
        salt = f"bc-demo-{policy}-{uuid.uuid4().hex[:12]}"
        drive = run_chat_conversation if isinstance(plan, ChatPlan) else run_conversation
        results = drive(server.base_url, plan, max_tokens=max_tokens, cache_salt=salt)
        counters = read_checkpoint_counters(server.base_url)
        log_stats = logs.parse_boundary_stats(logs.read_text(log_path))
        return PolicyRun(results, ready_s, warm.ttft_s, counters, log_stats)
    finally:
        if server is not None:
            stop_server(server)


def build_parser() -> argparse.ArgumentParser:
    """``bc-demo``'s options; every help text ends with the option's default."""
    parser = argparse.ArgumentParser(
        prog="bc-demo",
        description="Multi-turn conversation on a tiny hybrid model: boundary checkpoints vs stock. Each "
                    "server first gets one throw-away request shaped like turn 1 (not in the table).",
    )  # fmt: skip
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: build the tiny Qwen3-Next under "
                             "~/.cache/boundary_checkpoints/tiny_qwen3_next)")  # fmt: skip
    parser.add_argument("--mode", choices=MODES, default="tokens",
                        help="tokens: /v1/completions with token-ID prompts; chat: /v1/chat/completions "
                             "with the conversation sent back as messages (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--turns", type=int, default=8, help="turns of the conversation, one table row each (default: %(default)s)"
    )
    parser.add_argument("--policies", default="request_boundaries,aligned",
                        help="comma-separated policies, one server each, run in this order "
                             "(default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens per answer (greedy; tokens mode ignores EOS) (default: %(default)s)",
    )
    parser.add_argument("--system-tokens", type=int, default=300,
                        help="length of turn 1's system-like prefix (chat: words of the system message, one "
                             "token each) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--user-tokens", type=int, default=100,
                        help="new user tokens of turn 1, after the system prefix (chat: words) "
                             "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--followup-tokens", type=int, default=60,
                        help="new user tokens of every later turn, after the previous answer (chat: words) "
                             "(default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the conversation's token ids (default: %(default)s)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds each server may take to answer /health (default: %(default)s)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="directory for the server logs (default: a new temp dir)"
    )
    parser.add_argument(
        "--json-out", type=Path, default=None, help="also write the results as JSON to this file (default: none)"
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be >= 1")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policies:
        parser.error("--policies is empty")
    return args


def resolve_model(model: Path | None) -> Path:
    if model is not None:
        return model.expanduser().resolve()
    from bc_tools.fixtures.tiny_models import default_model_dir, make_tiny_model

    target = default_model_dir("qwen3_next", 0)
    start = time.monotonic()
    out = make_tiny_model(target, family="qwen3_next", seed=0)
    print(f"model: {out} ({time.monotonic() - start:.1f} s)")
    return out


def _run_demo(args: argparse.Namespace) -> int:
    """The demo proper: both servers, the table, the JSON file."""
    model_dir = resolve_model(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bc-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}")
    if os.environ.get(POLICY_ENV):
        print(f"note: ignoring {POLICY_ENV}={os.environ[POLICY_ENV]} for the demo's servers")
    make = make_chat_plan if args.mode == "chat" else make_plan
    plan = make(args.turns, args.system_tokens, args.user_tokens, args.followup_tokens, args.seed)
    runs: dict[str, PolicyRun] = {}
    for policy in args.policies:
        runs[policy] = run_policy(
            policy, model_dir, log_dir, plan,
            max_tokens=args.max_tokens, startup_timeout=args.startup_timeout, seed=args.seed,
        )  # fmt: skip
    results = {policy: run.results for policy, run in runs.items()}
    print()
    print(format_table(args.policies, results))
    print()
    for policy in args.policies:
        print(verdict(POLICY_LABELS.get(policy, policy), results[policy], expects_boundary=policy != "aligned"))
    for policy in args.policies:
        if policy != "aligned":
            run = runs[policy]
            print(counter_line(POLICY_LABELS.get(policy, policy), run.results, run.counters, run.log_stats))
    print()
    labels = ", ".join(f"{POLICY_LABELS.get(p, p)} = {p}" for p in args.policies)
    endpoint = "/v1/chat/completions, messages" if args.mode == "chat" else "/v1/completions, token ids"
    print(f"mode: {args.mode} ({endpoint}); columns: {labels}; "
          "boundary = committed length of the previous turn; TTFT excludes a warm-up request per server")  # fmt: skip
    print(LEGEND)
    if args.json_out:
        payload = {
            "policies": args.policies,
            "mode": args.mode,
            "server_ready_s": {p: run.ready_s for p, run in runs.items()},
            "warmup_ttft_s": {p: run.warmup_ttft_s for p, run in runs.items()},
            "server_counters": {p: run.counters for p, run in runs.items()},
            "turns": {p: [asdict(r) for r in rs] for p, rs in results.items()},
        }
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"results: {args.json_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with interrupt_on_termination():
            return _run_demo(args)
    except ServerStartError as err:
        print(f"\nserver failed to start: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
