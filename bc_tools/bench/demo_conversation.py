"""What ``bc-demo`` sends to one server, and what it measures there.

Contract: a plan (``make_plan``: ``--mode tokens``; ``make_chat_plan``: ``--mode chat``) holds the
new input of every turn, drawn from a seed, identical for every policy. Tokens mode: turn 1 is a
system-like prefix of random ids + the user ids; turn k > 1 the previous prompt + the previous
answer's token ids + the follow-up ids, through ``/v1/completions`` (greedy, ``ignore_eos``).
Chat mode: turn 1 is a system message and a user message of one-token words; every later turn
sends the whole conversation back (each answer as an assistant message) plus a user message,
through ``/v1/chat/completions`` (greedy, EOS honoured, ``skip_special_tokens: false``: a
random-weight model emits special tokens inside answers, which re-render exactly only if kept).
``run_conversation`` / ``run_chat_conversation`` drive a plan under one ``cache_salt`` and send each
turn again under a fresh salt (the cold control); a :class:`TurnResult` per turn holds the prompt
length, the boundary the turn could resume from (0 on turn 1, then the previous turn's prompt +
answer - 1), ``cached_tokens``, the streaming TTFT and ``compare_with_cold``'s measures.
``warm_up`` sends one throw-away request of turn 1's shape under its own salt, and
``read_checkpoint_counters`` reads the server's hit and miss counters from ``/metrics``.
"""

from __future__ import annotations

import random
import urllib.request
import uuid
from dataclasses import dataclass

from bc_tools.bench.chat_words import TINY_VOCAB_SIZE, draw_words
from bc_tools.bench.client import Completion, chat, complete, stream_complete
from bc_tools.bench.probes import Answer, first_token_deviation, same_greedy_output

FIRST_WORD_ID, VOCAB_SIZE = 4, TINY_VOCAB_SIZE
# chat words: "w8" .. "w1023" (ids 4..7 are the tiny tokenizer's role words), drawn
# by chat_words.draw_words, which bc-bench's chat mode shares
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


def make_plan(turns: int, system_tokens: int, user_tokens: int, followup_tokens: int, seed: int) -> ConversationPlan:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]

    first = draw(system_tokens) + draw(user_tokens)
    return ConversationPlan([first] + [draw(followup_tokens) for _ in range(turns - 1)])


@dataclass
class ChatPlan:
    """The new messages of every turn (turn 1: a system and a user message; then a user message)."""

    turn_messages: list[list[dict]]


def make_chat_plan(turns: int, system_tokens: int, user_tokens: int, followup_tokens: int, seed: int) -> ChatPlan:
    """Word-level messages of the given lengths (one token per word on the tiny tokenizer)."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return draw_words(rng, n)

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


def warmup_input(plan: ConversationPlan | ChatPlan, seed: int = 0) -> list[int] | list[dict]:
    """A throw-away first turn of the same shape as ``plan``'s turn 1 (same token counts; chat:
    the same messages with as many words each) with other random ids or words."""
    rng = random.Random(f"bc-demo-warmup-{seed}")
    if isinstance(plan, ChatPlan):
        return [{"role": m["role"], "content": draw_words(rng, len(m["content"].split()))}
                for m in plan.turn_messages[0]]  # fmt: skip
    return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in plan.turn_inputs[0]]


def warm_up(
    base_url: str, plan: ConversationPlan | ChatPlan, *, max_tokens: int, model: str = "tiny", seed: int = 0
) -> Completion:
    """One throw-away request shaped like turn 1 (same lengths, same endpoint, streamed with the
    same logprobs) under a fresh ``cache_salt``, so the measured turn 1 excludes first-request
    costs (what the first long prompt compiles or allocates); the salt keeps it from restoring
    anything into the measured conversation. Returns the warm-up's completion (its TTFT is printed)."""
    salt = f"bc-demo-warmup-{uuid.uuid4().hex}"
    prompt = warmup_input(plan, seed)
    if isinstance(plan, ChatPlan):
        return chat(base_url, prompt, model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS,
                    skip_special_tokens=False, stream=True, cache_salt=salt)  # fmt: skip
    return stream_complete(base_url, prompt, model=model, max_tokens=max_tokens, logprobs=COMPARE_LOGPROBS,
                           return_tokens_as_token_ids=True, cache_salt=salt)  # fmt: skip


HITS_METRIC = "vllm:boundary_checkpoint_hits"
MISSES_METRIC = "vllm:boundary_checkpoint_misses"


def parse_checkpoint_counters(metrics_text: str) -> dict[str, dict[str, float]] | None:
    """``{"hits": {kind: n}, "misses": {reason: n}}`` from a Prometheus ``/metrics`` page (summed
    over engines and models), or None when the page has no boundary-checkpoint hit series."""
    out: dict[str, dict[str, float]] = {"hits": {}, "misses": {}}
    found = False
    for line in metrics_text.splitlines():
        for key, metric, label in (("hits", HITS_METRIC, "kind"), ("misses", MISSES_METRIC, "reason")):
            if not line.startswith(metric + "_total{"):
                continue
            labels, _, value = line[len(metric) + len("_total{") :].rpartition("} ")
            found = found or key == "hits"
            name = next((item.split("=", 1)[1].strip('"') for item in labels.split(",")
                         if item.split("=", 1)[0] == label), "?")  # fmt: skip
            out[key][name] = out[key].get(name, 0.0) + float(value)
    return out if found else None


def read_checkpoint_counters(base_url: str, timeout: float = 10.0) -> dict[str, dict[str, float]] | None:
    """The server's boundary-checkpoint counters from its ``/metrics`` (None if unavailable)."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as resp:
            return parse_checkpoint_counters(resp.read().decode("utf-8", errors="replace"))
    except OSError:
        return None
