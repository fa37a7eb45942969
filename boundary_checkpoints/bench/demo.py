"""``bc-demo``: a multi-turn conversation against vLLM with and without boundary checkpoints.

For each policy (default ``request_boundaries``, then ``aligned`` = stock vLLM behaviour) the demo
starts one OpenAI server on 127.0.0.1 with the tiny Qwen3-Next model, drives the same N-turn
conversation through ``/v1/completions`` with token-ID prompts, and stops the server. Servers run
one after the other: on a 2-core machine two CPU engines at once would compete for the cores and
distort the TTFT columns.

Conversation (identical inputs for every policy, drawn from ``--seed``):
- turn 1: a system-like prefix of ``--system-tokens`` random ids + ``--user-tokens`` user ids;
- turn k > 1: previous prompt + the previous answer's token ids + ``--followup-tokens`` new ids.
Greedy, ``max_tokens=--max-tokens``, ``ignore_eos``, a per-run ``cache_salt``.

The table has one row per turn: the prompt length, the exact boundary the turn could resume from
(0 on turn 1; otherwise the previous turn's committed length = previous prompt + previous answer
- 1, since the last sampled token has no KV yet), ``cached_tokens`` and streaming TTFT per policy,
and, per policy, whether the answer equals a cold control: the same prompt sent to the same server
under a fresh ``cache_salt`` (``same``; ``tie`` when they part only at a bf16 near-tie of the top
two candidates, which chunking alone can flip on a random-weight model; ``DIFF`` otherwise).
Plugin and stock answers are not compared with each other: the plugin ends a prefill chunk one
token before the prompt end, and on a random-weight model that alone can flip a near-tie.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from boundary_checkpoints.bench.client import complete, stream_complete
from boundary_checkpoints.bench.probes import same_greedy_output
from boundary_checkpoints.bench.server import (
    ServerProcess,
    ServerStartError,
    policy_config,
    start_server,
    stop_server,
    wait_until_healthy,
)

POLICY_LABELS = {"request_boundaries": "plugin", "aligned": "stock"}
# The plugin lets this variable override --additional-config; the demo sets the policy per server.
POLICY_ENV = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"
FIRST_WORD_ID, VOCAB_SIZE = 4, 1024


@dataclass
class TurnResult:
    turn: int
    prompt_tokens: int
    boundary: int
    cached_tokens: int | None
    ttft_s: float | None
    latency_s: float
    answer_ids: list[int]
    vs_cold: str = ""  # "identical" | "tie" | "different" (see module docstring)


@dataclass
class ConversationPlan:
    """The new user tokens of every turn (turn 1 includes the system-like prefix)."""

    turn_inputs: list[list[int]]


def make_plan(
    turns: int, system_tokens: int, user_tokens: int, followup_tokens: int, seed: int
) -> ConversationPlan:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]

    first = draw(system_tokens) + draw(user_tokens)
    return ConversationPlan([first] + [draw(followup_tokens) for _ in range(turns - 1)])


def run_conversation(
    base_url: str, plan: ConversationPlan, *, max_tokens: int, cache_salt: str, model: str = "tiny"
) -> list[TurnResult]:
    """Drive the conversation turn by turn; each prompt extends the last by its answer ids."""
    results: list[TurnResult] = []
    prompt: list[int] = []
    boundary = 0
    for index, new_tokens in enumerate(plan.turn_inputs, start=1):
        prompt = prompt + new_tokens
        logprob_args = dict(model=model, max_tokens=max_tokens, logprobs=2, return_tokens_as_token_ids=True)
        out = stream_complete(base_url, prompt, cache_salt=cache_salt, **logprob_args)
        cold = complete(base_url, prompt, cache_salt=f"{cache_salt}-cold-{index}", **logprob_args)
        vs_cold, _ = same_greedy_output(out.token_ids, cold.token_ids, out.top_logprobs, cold.top_logprobs)
        results.append(
            TurnResult(
                turn=index,
                prompt_tokens=len(prompt),
                boundary=boundary,
                cached_tokens=out.cached_tokens,
                ttft_s=out.ttft_s,
                latency_s=out.latency_s,
                answer_ids=out.token_ids,
                vs_cold=vs_cold,
            )
        )
        boundary = len(prompt) + len(out.token_ids) - 1  # committed length of this turn
        prompt = prompt + out.token_ids
    return results


def warm_up(base_url: str, model: str = "tiny") -> None:
    """One short request under a throw-away salt, so turn 1's TTFT excludes first-call costs."""
    complete(base_url, list(range(FIRST_WORD_ID, FIRST_WORD_ID + 16)), model=model,
             max_tokens=2, cache_salt=f"warmup-{uuid.uuid4().hex}")  # fmt: skip


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


def run_policy(
    policy: str,
    model_dir: Path,
    log_dir: Path,
    plan: ConversationPlan,
    *,
    max_tokens: int,
    startup_timeout: float,
) -> tuple[list[TurnResult], float]:
    """Start a server with ``policy``, run the conversation, stop it; return results and the
    seconds the server took to become healthy."""
    log_path = log_dir / f"server_{policy}.log"
    server: ServerProcess | None = None
    try:
        server = start_server(
            model_dir, log_path, additional_config=policy_config(policy), unset_env=(POLICY_ENV,)
        )
        progress = Progress(f"starting vLLM ({policy}, port {server.port})")
        ready_s = wait_until_healthy(server, timeout=startup_timeout, on_tick=progress.tick)
        progress.done(f"{policy}: server ready in {ready_s:.1f} s (pid {server.pid})")
        warm_up(server.base_url)
        salt = f"bc-demo-{policy}-{uuid.uuid4().hex[:12]}"
        results = run_conversation(server.base_url, plan, max_tokens=max_tokens, cache_salt=salt)
        return results, ready_s
    finally:
        if server is not None:
            stop_server(server)


def _fmt_int(value: int | None) -> str:
    return "-" if value is None else str(value)


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_table(policies: list[str], results: dict[str, list[TurnResult]]) -> str:
    """One row per turn: prompt, boundary, cached and TTFT per policy, answer vs cold control."""
    labels = [POLICY_LABELS.get(p, p) for p in policies]
    header = ["turn", "prompt", "boundary"]
    header += [f"cached {label}" for label in labels]
    header += [f"TTFT ms {label}" for label in labels]
    header += [f"vs cold {label}" for label in labels]
    rows = []
    first = results[policies[0]]
    for i, base in enumerate(first):
        per = [results[p][i] for p in policies]
        row = [str(base.turn), str(base.prompt_tokens), str(base.boundary)]
        row += [_fmt_int(r.cached_tokens) for r in per]
        row += [_fmt_ms(r.ttft_s) for r in per]
        row += [{"identical": "same", "different": "DIFF"}.get(r.vs_cold, r.vs_cold) for r in per]
        rows.append(row)
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _raise_keyboard_interrupt(signum, frame):  # SIGTERM/SIGHUP -> same clean-up as Ctrl-C
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bc-demo",
        description="Multi-turn conversation on a tiny hybrid model: boundary checkpoints vs stock.",
    )
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: build the tiny Qwen3-Next under "
                             "~/.cache/boundary_checkpoints/tiny_qwen3_next)")  # fmt: skip
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--policies", default="request_boundaries,aligned",
                        help="comma-separated policies, one server each, run in this order")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--user-tokens", type=int, default=100)
    parser.add_argument("--followup-tokens", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0, help="seed of the conversation's token ids")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--json-out", type=Path, default=None, help="also write results as JSON")
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
    from boundary_checkpoints.fixtures.tiny_models import default_model_dir, make_tiny_model

    target = default_model_dir("qwen3_next", 0)
    start = time.monotonic()
    out = make_tiny_model(target, family="qwen3_next", seed=0)
    print(f"model: {out} ({time.monotonic() - start:.1f} s)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = {sig: signal.signal(sig, _raise_keyboard_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        model_dir = resolve_model(args.model)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bc-demo-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"server logs: {log_dir}")
        if os.environ.get(POLICY_ENV):
            print(f"note: ignoring {POLICY_ENV}={os.environ[POLICY_ENV]} for the demo's servers")
        plan = make_plan(args.turns, args.system_tokens, args.user_tokens, args.followup_tokens,
                         args.seed)  # fmt: skip
        results: dict[str, list[TurnResult]] = {}
        ready: dict[str, float] = {}
        for policy in args.policies:
            results[policy], ready[policy] = run_policy(
                policy, model_dir, log_dir, plan,
                max_tokens=args.max_tokens, startup_timeout=args.startup_timeout,
            )  # fmt: skip
        print()
        print(format_table(args.policies, results))
        print()
        labels = ", ".join(f"{POLICY_LABELS.get(p, p)} = {p}" for p in args.policies)
        print(f"columns: {labels}; boundary = committed length of the previous turn")
        if args.json_out:
            payload = {
                "policies": args.policies,
                "server_ready_s": ready,
                "turns": {p: [asdict(r) for r in rs] for p, rs in results.items()},
            }
            args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
            print(f"results: {args.json_out}")
        return 0
    except ServerStartError as err:
        print(f"\nserver failed to start: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
