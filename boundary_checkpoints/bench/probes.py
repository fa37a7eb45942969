"""End-to-end boundary probes on an in-process vLLM engine (CPU or GPU).

Scenario per conversation (all conversations of a phase are sent together, so they share
batches): a cold producer sends prompt ``P``; the exact resend of ``P``; the continuation
``P + answer + new tokens``; and a cold control of that continuation under a fresh ``cache_salt``.
Each request is greedy with ``ignore_eos`` and the top-:data:`TOP_LOGPROBS` logprobs of every
position, so that a divergence between a restored output and its cold control can be told apart
from a kernel near-tie, also one between three or more candidates (see :func:`same_greedy_output`).

:func:`run_probes` returns one :class:`ProbeRow` per conversation; the GPU test asserts on them and
the results file is written from them.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

NEW_TOKENS = 50
TIE_TOLERANCE = 0.1  # logprob gap under which two greedy candidates count as tied (bf16 logits)
TOP_LOGPROBS = 5  # candidates recorded per position


@dataclass
class ProbeRow:
    prompt_len: int
    resend_cached: int
    resend_same: str  # resend vs producer: "identical" | "tie" | "different"
    continuation_len: int
    committed: int
    continuation_cached: int
    continuation_same: str  # "identical" | "tie" | "different"
    cold_cached: int
    divergence: str = ""  # where and how the continuation left its cold control, if it did
    first_token_delta: float = 0.0  # max |logprob difference| of the first token's top-k, vs cold
    resend_divergence: str = ""  # where and how the resend left its producer, if it did
    resend_first_token_delta: float = 0.0  # the same for the resend vs its producer
    resend_first_token_same: str = "identical"  # the verdict on the first generated token alone

    def as_dict(self) -> dict:
        return asdict(self)


def same_greedy_output(
    tokens: list[int],
    cold_tokens: list[int],
    logprobs: list[dict[int, float]],
    cold_logprobs: list[dict[int, float]],
    tolerance: float = TIE_TOLERANCE,
) -> tuple[str, str]:
    """(verdict, detail): ``identical``; ``tie`` when the first difference is a near-tie in BOTH
    runs' recorded top logprobs (kernels that are not batch- or chunk-invariant may break ties either
    way); ``different`` otherwise. ``detail`` names the position and both runs' recorded candidates."""
    if list(tokens) == list(cold_tokens):
        return "identical", ""
    i = next(i for i, (a, b) in enumerate(zip(tokens, cold_tokens)) if a != b)
    a, b = tokens[i], cold_tokens[i]
    detail = f"token {i}: restored top {logprobs[i]}, cold top {cold_logprobs[i]}"
    for lp in (logprobs[i], cold_logprobs[i]):
        if a not in lp or b not in lp or abs(lp[a] - lp[b]) > tolerance:
            return "different", detail
    return "tie", detail


def first_token_delta(logprobs: list[dict[int, float]], cold_logprobs: list[dict[int, float]]) -> float:
    """How far the first generated token's top logprobs are from the cold control's.

    The first token is computed straight from the restored state, before any decode step can add
    its own rounding: a wrong restore moves these logprobs by far more than bf16 noise."""
    common = logprobs[0].keys() & cold_logprobs[0].keys()
    if not common:
        return float("inf")
    return max(abs(logprobs[0][t] - cold_logprobs[0][t]) for t in common)


def top_logprobs(vllm_logprobs) -> list[dict[int, float]]:
    """vLLM's per-position ``{token: Logprob}`` as ``{token: logprob}`` rounded for reports."""
    return [{token: round(entry.logprob, 4) for token, entry in position.items()} for position in vllm_logprobs]


def run_probes(llm, lengths: list[int], conversations: int, max_tokens: int, seed: int = 0) -> list[ProbeRow]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    salt = f"probe-{seed}-{rng.random()}"

    def send(prompts, salt_of):
        batch = [TokensPrompt(prompt_token_ids=p, cache_salt=salt_of(i)) for i, p in enumerate(prompts)]
        outs = llm.generate(batch, params, use_tqdm=False)
        return [(o.num_cached_tokens, list(o.outputs[0].token_ids), top_logprobs(o.outputs[0].logprobs)) for o in outs]

    def draw(n):
        return [rng.randrange(4, vocab) for _ in range(n)]

    prompts = [draw(lengths[i % len(lengths)]) for i in range(conversations)]
    producers = send(prompts, lambda i: salt)
    resends = send(prompts, lambda i: salt)
    continuations = [p + out[1] + draw(NEW_TOKENS) for p, out in zip(prompts, producers)]
    restored = send(continuations, lambda i: salt)
    cold = send(continuations, lambda i: f"{salt}-cold-{i}")
    rows = []
    for p, prod, res, cont, rest, cl in zip(prompts, producers, resends, continuations, restored, cold):
        verdict, detail = same_greedy_output(rest[1], cl[1], rest[2], cl[2])
        resend_verdict, resend_detail = same_greedy_output(res[1], prod[1], res[2], prod[2])
        rows.append(
            ProbeRow(
                prompt_len=len(p),
                resend_cached=res[0],
                resend_same=resend_verdict,
                continuation_len=len(cont),
                committed=len(p) + len(prod[1]) - 1,
                continuation_cached=rest[0],
                continuation_same=verdict,
                cold_cached=cl[0],
                divergence=detail,
                first_token_delta=first_token_delta(rest[2], cl[2]),
                resend_divergence=resend_detail,
                resend_first_token_delta=first_token_delta(res[2], prod[2]),
                resend_first_token_same=same_greedy_output(res[1][:1], prod[1][:1], res[2][:1], prod[2][:1])[0],
            )
        )
    return rows


AGREEING = ("identical", "tie")
MIN_AGREEING_ANSWERS = 0.9  # share of whole answers that must agree up to near-ties


def probe_failures(rows: list[ProbeRow]) -> list[str]:
    """Why a plugin probe run is not exact (empty when it is).

    * every resend restores ``P - 1`` and every continuation its committed length; cold controls
      restore nothing;
    * a continuation's first generated token has the cold control's top logprobs within
      :data:`TIE_TOLERANCE` (the restored state is the cold state up to bf16 noise);
    * a resend's first generated token is its producer's, or a near-tie with it. Its logprobs are
      not held to the tolerance: producer and resend run the last prompt token as a one-token step
      in different batches, and batch-variant decode kernels move them by up to ~0.5 on the
      random-weight model -- stock vLLM's own block-aligned resends move as much in the same run;
    * whole answers (64 greedy tokens) agree up to near-ties in at least
      :data:`MIN_AGREEING_ANSWERS` of the rows, resends and continuations each.
    """
    failures = []
    for row in rows:
        if row.resend_cached < row.prompt_len - 1 or row.continuation_cached < row.committed:
            failures.append(f"not an exact hit: {row}")
        if row.cold_cached:
            failures.append(f"cold control restored something: {row}")
        if row.first_token_delta > TIE_TOLERANCE:
            failures.append(f"continuation's first token is not the cold control's: {row}")
        if row.resend_first_token_same not in AGREEING:
            failures.append(f"resend's first token is not the producer's: {row}")
    for field in ("resend_same", "continuation_same"):
        agreeing = sum(getattr(r, field) in AGREEING for r in rows)
        if agreeing < MIN_AGREEING_ANSWERS * len(rows):
            failures.append(f"{field}: only {agreeing} of {len(rows)} answers agree up to near-ties")
    return failures


def summarize(rows: list[ProbeRow]) -> str:
    """A markdown table, one line per distinct prompt length."""
    lines = [
        "| P | resend cached | resend vs producer | continuation | committed | continuation cached "
        "| continuation vs cold control | max first-token delta | cold cached |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in rows:
        if r.prompt_len in seen:
            continue
        seen.add(r.prompt_len)
        group = [x for x in rows if x.prompt_len == r.prompt_len]
        def count(field):
            return {v: n for v in ("identical", "tie", "different") if (n := sum(getattr(x, field) == v for x in group))}

        lines.append(
            f"| {r.prompt_len} | {min(x.resend_cached for x in group)}-{max(x.resend_cached for x in group)} "
            f"| {count('resend_same')} | {r.continuation_len} | {r.committed} "
            f"| {min(x.continuation_cached for x in group)}-{max(x.continuation_cached for x in group)} "
            f"| {count('continuation_same')} "
            f"| {max(max(x.first_token_delta, x.resend_first_token_delta) for x in group):.3f} "
            f"| {max(x.cold_cached for x in group)} |"
        )
    return "\n".join(lines)
