"""``bc-demo``: a multi-turn conversation against vLLM with and without boundary checkpoints.

For each policy (default ``request_boundaries``, then ``aligned`` = stock vLLM behaviour) the demo
starts one OpenAI server on 127.0.0.1 with the tiny Qwen3-Next model, drives the same N-turn
conversation through it, and stops the server. Servers run one after the other: on a 2-core
machine two CPU engines at once would compete for the cores and distort the TTFT columns.

Conversation (identical inputs for every policy, drawn from ``--seed``), ``--mode tokens``
(default), through ``/v1/completions`` with token-ID prompts:
- turn 1: a system-like prefix of ``--system-tokens`` random ids + ``--user-tokens`` user ids;
- turn k > 1: previous prompt + the previous answer's token ids + ``--followup-tokens`` new ids.
Greedy, ``max_tokens=--max-tokens``, ``ignore_eos``, a per-run ``cache_salt``.

``--mode chat``: the same conversation as messages through ``/v1/chat/completions``: turn 1 is a
system message of ``--system-tokens`` words and a user message of ``--user-tokens`` words; every
later turn sends the whole conversation back (each answer as an assistant message) plus a user
message of ``--followup-tokens`` words. The server renders it with the model's chat template, so a
turn resumes at the previous answer's boundary when the template re-renders the earlier turns as
an exact token prefix (the tiny model's template does). Greedy, EOS honoured, and
``skip_special_tokens: false``: a random-weight model emits special tokens (``<unk>``, ``<s>``)
inside answers, and content with them skipped would re-render as other tokens; kept in the
content they re-render exactly, on any model, without constraining what it generates.

The table has one row per turn: the prompt length, the exact boundary the turn could resume from
(0 on turn 1; otherwise the previous turn's committed length = previous prompt + previous answer
- 1, since the last sampled token has no KV yet), ``cached_tokens`` and streaming TTFT per policy,
and, per policy, what a comparison with a cold control measured (the same prompt sent to the same
server under a fresh ``cache_salt``): the first answer token's logprob delta (the largest
|difference| over the top-2 candidates both runs report), and, if the greedy answers part, the
token index where they part and the cold run's top-2 logprob gap there. bf16 GDN kernels make two
correct runs part at near-ties (a gap of a few hundredths), which chunking alone can flip on a
random-weight model; a wrong restore shows as a first-token delta far above bf16 noise or a
parting where the cold run's top two are far apart.
Plugin and stock answers are not compared with each other: the plugin ends a prefill chunk one
token before the prompt end, and on a random-weight model that alone can flip a near-tie.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from boundary_checkpoints.bench.client import Completion, chat, complete, stream_complete
from boundary_checkpoints.bench.probes import Answer, first_token_deviation, same_greedy_output
from boundary_checkpoints.bench.server import (
    ServerProcess,
    ServerStartError,
    interrupt_on_termination,
    policy_config,
    start_server,
    stop_server,
    wait_until_healthy,
)

POLICY_LABELS = {"request_boundaries": "plugin", "aligned": "stock"}
# The plugin lets this variable override --additional-config; the demo sets the policy per server.
POLICY_ENV = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"
FIRST_WORD_ID, VOCAB_SIZE = 4, 1024
FIRST_PLAIN_WORD_ID = 8  # chat words: "w8" .. "w1023" (ids 4..7 are the tiny tokenizer's role words)
MODES = ("tokens", "chat")
COMPARE_LOGPROBS = 2  # top-k recorded per position for the comparison with the cold control


@dataclass
class TurnResult:
    turn: int
    prompt_tokens: int
    boundary: int
    cached_tokens: int | None
    ttft_s: float | None
    latency_s: float
    answer_ids: list[int]
    vs_cold: str = ""  # "identical" | "tie" | "different" (probes.same_greedy_output; JSON only)
    first_token_delta: float | None = None  # max |logprob delta| of the first token's top-k vs cold
    parts_at: int | None = None  # first answer index where the greedy answer leaves the cold one
    cold_gap: float | None = None  # the cold run's top-2 logprob gap at ``parts_at``


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


@dataclass
class ChatPlan:
    """The new messages of every turn (turn 1: a system and a user message; then a user message)."""

    turn_messages: list[list[dict]]


def make_chat_plan(
    turns: int, system_tokens: int, user_tokens: int, followup_tokens: int, seed: int
) -> ChatPlan:
    """Word-level messages of the given lengths (one token per word on the tiny tokenizer)."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(FIRST_PLAIN_WORD_ID, VOCAB_SIZE)}" for _ in range(n))

    first = [{"role": "user", "content": words(user_tokens)}]
    if system_tokens:
        first.insert(0, {"role": "system", "content": words(system_tokens)})
    later = [[{"role": "user", "content": words(followup_tokens)}] for _ in range(turns - 1)]
    return ChatPlan([first] + later)


def top2_gap(position: dict[int, float]) -> float | None:
    """The logprob gap between the two best recorded candidates of one position."""
    best = sorted(position.values(), reverse=True)[:2]
    return best[0] - best[1] if len(best) == 2 else None


def compare_with_cold(out: Completion, cold: Completion) -> dict:
    """What the comparison with the cold control measured (the ``TurnResult`` fields)."""
    delta = None
    if out.top_logprobs and cold.top_logprobs:
        delta = first_token_deviation(Answer(0, [], out.top_logprobs), Answer(0, [], cold.top_logprobs))
    if out.token_ids == cold.token_ids:
        return dict(vs_cold="identical", first_token_delta=delta, parts_at=None, cold_gap=None)
    pairs = zip(out.token_ids, cold.token_ids)
    parts_at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(out.token_ids), len(cold.token_ids)))
    cold_gap = top2_gap(cold.top_logprobs[parts_at]) if parts_at < len(cold.top_logprobs) else None
    vs_cold = "different"  # one answer a prefix of the other, or no logprobs to tell a near-tie by
    if parts_at < min(len(out.top_logprobs), len(cold.top_logprobs), len(out.token_ids), len(cold.token_ids)):
        vs_cold, _ = same_greedy_output(out.token_ids, cold.token_ids, out.top_logprobs, cold.top_logprobs)
    return dict(vs_cold=vs_cold, first_token_delta=delta, parts_at=parts_at, cold_gap=cold_gap)


def run_conversation(
    base_url: str, plan: ConversationPlan, *, max_tokens: int, cache_salt: str, model: str = "tiny"
) -> list[TurnResult]:
    """Drive the conversation turn by turn; each prompt extends the last by its answer ids."""
    results: list[TurnResult] = []
    prompt: list[int] = []
    boundary = 0
    for index, new_tokens in enumerate(plan.turn_inputs, start=1):
        prompt = prompt + new_tokens
        logprob_args = dict(
            model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS, return_tokens_as_token_ids=True
        )
        out = stream_complete(base_url, prompt, cache_salt=cache_salt, **logprob_args)
        cold = complete(base_url, prompt, cache_salt=f"{cache_salt}-cold-{index}", **logprob_args)
        results.append(
            TurnResult(
                turn=index,
                prompt_tokens=len(prompt),
                boundary=boundary,
                cached_tokens=out.cached_tokens,
                ttft_s=out.ttft_s,
                latency_s=out.latency_s,
                answer_ids=out.token_ids,
                **compare_with_cold(out, cold),
            )
        )
        boundary = len(prompt) + len(out.token_ids) - 1  # committed length of this turn
        prompt = prompt + out.token_ids
    return results


def run_chat_conversation(
    base_url: str, plan: ChatPlan, *, max_tokens: int, cache_salt: str, model: str = "tiny"
) -> list[TurnResult]:
    """Drive the conversation through ``/v1/chat/completions``, sending it back as messages.

    The boundary of turn k + 1 is turn k's committed length as the server counted it: the prompt
    it rendered + the answer ids - 1."""
    results: list[TurnResult] = []
    messages: list[dict] = []
    boundary = 0
    args = dict(model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS, skip_special_tokens=False)
    for index, new_messages in enumerate(plan.turn_messages, start=1):
        messages = messages + new_messages
        out = chat(base_url, messages, stream=True, cache_salt=cache_salt, **args)
        cold = chat(base_url, messages, cache_salt=f"{cache_salt}-cold-{index}", **args)
        results.append(
            TurnResult(
                turn=index,
                prompt_tokens=out.prompt_tokens,
                boundary=boundary,
                cached_tokens=out.cached_tokens,
                ttft_s=out.ttft_s,
                latency_s=out.latency_s,
                answer_ids=out.token_ids,
                **compare_with_cold(out, cold),
            )
        )
        boundary = out.prompt_tokens + len(out.token_ids) - 1
        messages = messages + [{"role": "assistant", "content": out.text}]
    return results


def warm_up(base_url: str, model: str = "tiny", mode: str = "tokens") -> None:
    """One short request under a throw-away salt, so turn 1's TTFT excludes first-call costs
    (in chat mode a chat request too: the first one compiles the template)."""
    complete(base_url, list(range(FIRST_WORD_ID, FIRST_WORD_ID + 16)), model=model,
             max_tokens=2, cache_salt=f"warmup-{uuid.uuid4().hex}")  # fmt: skip
    if mode == "chat":
        words = " ".join(f"w{i}" for i in range(FIRST_PLAIN_WORD_ID, FIRST_PLAIN_WORD_ID + 16))
        chat(base_url, [{"role": "user", "content": words}], model=model, max_tokens=2, stream=True,
             cache_salt=f"warmup-{uuid.uuid4().hex}")  # fmt: skip


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
    plan: ConversationPlan | ChatPlan,
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
        warm_up(server.base_url, mode="chat" if isinstance(plan, ChatPlan) else "tokens")
        salt = f"bc-demo-{policy}-{uuid.uuid4().hex[:12]}"
        drive = run_chat_conversation if isinstance(plan, ChatPlan) else run_conversation
        results = drive(server.base_url, plan, max_tokens=max_tokens, cache_salt=salt)
        return results, ready_s
    finally:
        if server is not None:
            stop_server(server)


def _fmt_int(value: int | None) -> str:
    return "-" if value is None else str(value)


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _fmt_delta(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _fmt_parts(result: TurnResult) -> str:
    """``-`` for identical answers, else ``@INDEX gap GAP`` (cold run's top-2 gap there)."""
    if result.parts_at is None:
        return "-"
    gap = "?" if result.cold_gap is None else f"{result.cold_gap:.3f}"
    return f"@{result.parts_at} gap {gap}"


LEGEND = (
    "dlp1 = largest |logprob difference| of the first answer token's top-{k} candidates against a cold\n"
    "control (the same prompt under a fresh cache_salt, same server); parts = answer token index where the\n"
    "greedy answer leaves the cold control's, with the cold run's top-2 logprob gap there ('-': identical).\n"
    "bf16 GDN kernels make two correct runs part at near-ties (gap of a few hundredths); a wrong restore\n"
    "shows as a dlp1 far above that noise or a parting where the top two are far apart."
).format(k=COMPARE_LOGPROBS)


def format_table(policies: list[str], results: dict[str, list[TurnResult]]) -> str:
    """One row per turn: prompt, boundary, cached and TTFT per policy, and what the comparison
    with the cold control measured (first-token logprob delta, where the answers part)."""
    labels = [POLICY_LABELS.get(p, p) for p in policies]
    header = ["turn", "prompt", "boundary"]
    header += [f"cached {label}" for label in labels]
    header += [f"TTFT ms {label}" for label in labels]
    header += [f"dlp1 {label}" for label in labels]
    header += [f"parts {label}" for label in labels]
    rows = []
    first = results[policies[0]]
    for i, base in enumerate(first):
        per = [results[p][i] for p in policies]
        row = [str(base.turn), str(base.prompt_tokens), str(base.boundary)]
        row += [_fmt_int(r.cached_tokens) for r in per]
        row += [_fmt_ms(r.ttft_s) for r in per]
        row += [_fmt_delta(r.first_token_delta) for r in per]
        row += [_fmt_parts(r) for r in per]
        rows.append(row)
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bc-demo",
        description="Multi-turn conversation on a tiny hybrid model: boundary checkpoints vs stock.",
    )
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: build the tiny Qwen3-Next under "
                             "~/.cache/boundary_checkpoints/tiny_qwen3_next)")  # fmt: skip
    parser.add_argument("--mode", choices=MODES, default="tokens",
                        help="tokens: /v1/completions with token-ID prompts; chat: /v1/chat/completions "
                             "with the conversation sent back as messages")  # fmt: skip
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--policies", default="request_boundaries,aligned",
                        help="comma-separated policies, one server each, run in this order")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=300, help="(chat: words; one token each)")
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
    endpoint = "/v1/chat/completions, messages" if args.mode == "chat" else "/v1/completions, token ids"
    print(f"mode: {args.mode} ({endpoint}); columns: {labels}; "
          "boundary = committed length of the previous turn")  # fmt: skip
    print(LEGEND)
    if args.json_out:
        payload = {
            "policies": args.policies,
            "mode": args.mode,
            "server_ready_s": ready,
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
