"""The probe scenario on an in-process ``vllm.LLM``, and a summary of its rows.

Contract: :func:`run_probes` runs, per conversation, a cold producer of prompt ``P``, the exact
resend, the continuation ``P + answer`` plus ``new_tokens`` new tokens (``NEW_TOKENS`` unless
told), and two cold controls of the continuation under fresh salts; optionally a third, the
decode-path control (``cold_decoded``: the answer's positions computed one token per step, as its
producer computed them, instead of inside a prefill chunk). Every phase sends all conversations
together (shared batches), greedy, with ``TOP_LOGPROBS`` candidates per position; the rows it
returns (``probes.ProbeRow``) are what the criteria of ``probes`` judge. :func:`summarize` renders
rows as a markdown table.
"""

from __future__ import annotations

import random
from collections.abc import Callable, MutableMapping

from bc_tools.bench.probes import Answer, Bounds, LogprobRow, ProbeRow, divergence, first_token_deviation

NEW_TOKENS = 50
TOP_LOGPROBS = 5  # candidates recorded per position


def top_logprobs(vllm_logprobs) -> list[LogprobRow]:
    """vLLM's per-position ``{token: Logprob}`` as ``{token: logprob}``."""
    return [{token: float(entry.logprob) for token, entry in position.items()} for position in vllm_logprobs]


def spec_counts(llm) -> tuple[int, int]:
    """vLLM's ``(spec_decode_num_drafts, spec_decode_num_accepted_tokens)`` counters of ``llm``
    (0, 0 without speculative decoding; needs ``disable_log_stats=False``). ``num_drafts`` counts
    drafting steps, so ``1 + accepted / drafts`` is the mean tokens per drafting step."""
    values = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")}
    drafts = values.get("vllm:spec_decode_num_drafts") or 0
    return int(drafts), int(values.get("vllm:spec_decode_num_accepted_tokens") or 0)


def run_probes(
    llm,
    lengths: list[int],
    conversations: int,
    max_tokens: int,
    seed: int = 0,
    acceptance: dict[str, list[int]] | None = None,
    next_token: Callable[[list[int]], int] | None = None,
    decode_spans: MutableMapping[str, tuple[int, int]] | None = None,
    new_tokens: int = NEW_TOKENS,
) -> list[ProbeRow]:
    """The scenario on ``llm``; every phase sends all conversations together (shared batches).

    ``acceptance`` (a dict, filled in place): per phase (``producer``, ``resend``, ``restored``,
    ``cold``, ``cold_again``, and ``cold_decoded`` if it runs) the ``[drafting steps, accepted
    drafts]`` of :func:`spec_counts` that phase added (speculative decoding with stats enabled).

    ``next_token`` (optional): the first of a continuation's new tokens from its producer's answer
    (random otherwise, like the rest). Under MTP with async scheduling a response finished with a
    step in flight is kept at ``num_tokens`` and serves only a next turn that continues with the
    token that step sampled (the next-token guard, docs/notes/spec-decode.md §10); a caller that
    can predict that token (the planted fixture: the successor of the answer's last token) makes
    those bundles restorable.

    ``decode_spans`` (optional): the registry of a decode-path scheduler (the tests'
    ``decode_path_control``, whose engine core runs in this process). When given, a last phase
    ``cold_decoded`` sends the continuations again under fresh salts, each registered first as
    ``salt -> (max(P - 1, 0), committed)``, which that scheduler runs one token per step
    (``ProbeRow.cold_decoded``): the positions the plugin's producer computed alone in a step --
    the answer tokens it fed back, and its last prompt token, which the plugin's prompt checkpoint
    runs alone (the ``P - 1`` stop; captured in the step, as a one-token decode row inside the GDN
    layers; ``P = 1``: a one-token first chunk, a prefill row in both runs). Off by default."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    salt = f"probe-{seed}-{random.random()}"  # unseeded: reruns on one engine never share a salt

    def send(prompts, salt_of, phase: str) -> list[Answer]:
        batch = [TokensPrompt(prompt_token_ids=p, cache_salt=salt_of(i)) for i, p in enumerate(prompts)]
        before = spec_counts(llm) if acceptance is not None else (0, 0)
        outs = llm.generate(batch, params, use_tqdm=False)
        if acceptance is not None:
            after = spec_counts(llm)
            acceptance[phase] = [after[0] - before[0], after[1] - before[1]]
        return [Answer(o.num_cached_tokens, list(o.outputs[0].token_ids), top_logprobs(o.outputs[0].logprobs))
                for o in outs]  # fmt: skip

    def draw(n):
        return [rng.randrange(4, vocab) for _ in range(n)]

    prompts = [draw(lengths[i % len(lengths)]) for i in range(conversations)]
    producers = send(prompts, lambda i: salt, "producer")
    resends = send(prompts, lambda i: salt, "resend")

    def next_turn(answer: list[int]) -> list[int]:
        tokens = draw(new_tokens)
        if next_token is not None and answer:
            tokens[0] = next_token(answer)
        return tokens

    continuations = [p + out.tokens + next_turn(out.tokens) for p, out in zip(prompts, producers)]
    restored = send(continuations, lambda i: salt, "restored")
    cold = send(continuations, lambda i: f"{salt}-cold-{i}", "cold")
    cold_again = send(continuations, lambda i: f"{salt}-cold-again-{i}", "cold_again")
    decoded: list[Answer | None] = [None] * len(prompts)
    if decode_spans is not None:
        for i, (p, out) in enumerate(zip(prompts, producers)):
            decode_spans[f"{salt}-cold-decoded-{i}"] = (max(len(p) - 1, 0), len(p) + len(out.tokens) - 1)
        decoded = send(continuations, lambda i: f"{salt}-cold-decoded-{i}", "cold_decoded")
    return [
        ProbeRow(len(p), *answers)
        for p, *answers in zip(prompts, producers, resends, restored, cold, cold_again, decoded)
    ]


def summarize(rows: list[ProbeRow], bounds: Bounds | None = None) -> str:
    """A markdown table, one line per distinct prompt length (counts as min-max over the group)."""
    lines = [
        "| P | resend cached | continuation cached / committed | max first-token deviation "
        "| max divergence gap | cold cached |",
        "|---|---|---|---|---|---|",
    ]
    for length in sorted({r.prompt_len for r in rows}):
        group = [r for r in rows if r.prompt_len == length]
        deviation = max(first_token_deviation(run, cold) for r in group for _, run, cold in r.restored_pairs())
        gaps = [d[1] for r in group for _, run, cold in r.restored_pairs() if (d := divergence(run, cold))]
        gap_text = f"{max(gaps):.4f}" if gaps else "-"
        lines.append(
            f"| {length} | {min(r.resend.cached for r in group)}-{max(r.resend.cached for r in group)} "
            f"| {min(r.restored.cached for r in group)}-{max(r.restored.cached for r in group)} "
            f"/ {group[0].committed} | {deviation:.4f} | {gap_text} "
            f"| {max(max(r.cold.cached, r.cold_again.cached) for r in group)} |"
        )
    if bounds is not None:
        lines.append(f"\nbounds: {bounds.as_dict()}")
    return "\n".join(lines)
