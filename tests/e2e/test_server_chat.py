"""End to end: multi-turn chats through ``/v1/chat/completions`` and text prompts through
``/v1/completions`` on the real OpenAI server (CPU engine, tiny Qwen3-Next, the plugin on).

The conversation goes back to the server as ``messages``; the server renders it with the chat
template (``<s> ROLE CONTENT </s> `` per message, generation prompt ``<s> assistant ``) and
tokenizes the text. A turn can resume at the previous turn's response boundary only if that
rendering starts with the previous turn's exact tokens (its rendered prompt + its answer), so each
test computes the expected count itself: render and tokenize the previous turn's prompt, append
the answer as the template will re-render it, and take one less (the last sampled token has no KV
yet). Whether the answer ended on EOS or on ``max_tokens`` does not change the count: an EOS
answer's re-rendering ends with the template's ``</s>``, the very token the engine sampled; a
``max_tokens`` answer gets a ``</s>`` after its last token. Both make the previous turn's
committed tokens (prompt + answer - 1) a prefix of the next prompt.

Special tokens: the random model sometimes emits ``<unk>``, ``<s>`` or ``<pad>`` inside an answer.
The server detokenizes with ``skip_special_tokens`` (its default), so they vanish from the content
and the re-rendered answer is no longer a token prefix. A trained model never emits them there;
the main conversations forbid them the way an OpenAI client can, with ``logit_bias`` -100 on the
three ids (EOS stays allowed). ``test_skipped_special_tokens_only_hit_less`` shows what happens
without that (fewer cached tokens, never wrong ones) and that ``skip_special_tokens: false`` (a
vLLM extra) restores exactness without constraining the model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import pytest
from prompts import common_prefix, render_ids, words
from servers import resend_config, server_fixture

from bc_tools.bench.client import Completion, chat, complete
from bc_tools.bench.probes import same_greedy_output
from bc_tools.fixtures.tiny_models import BOS_ID, EOS_ID, PAD_ID, UNK_ID

pytestmark = pytest.mark.slow

POLICY = "request_boundaries"
TURNS = 5
MAX_TOKENS = 16
SKIPPED_SPECIALS = (UNK_ID, BOS_ID, PAD_ID)  # dropped from the content when detokenizing
NO_SPECIALS = {str(t): -100 for t in SKIPPED_SPECIALS}  # logit_bias: never emit them
FORCE_EOS = {str(EOS_ID): 100}  # with min_tokens=k: exactly k words, then EOS
# A template that does not re-render earlier turns as a token prefix: earlier assistant messages
# keep only their frame (like templates that strip the reasoning of earlier turns).
DROP_ASSISTANT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<s> assistant </s> "
    "{% else %}<s> {{ message['role'] }} {{ message['content'] }} </s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


server = server_fixture(
    f"server_chat_{POLICY}",
    additional_config=resend_config(POLICY),
    extra_args=["--trust-request-chat-template"],  # the non-prefix template is sent per request
)


def rerendered_answer_ids(tokenizer, out: Completion) -> list[int]:
    """The answer as the next turn's rendering carries it, up to its last sampled token: the
    content's tokens, plus EOS when the answer ended on it (the template writes ``</s>`` there)."""
    ids = tokenizer.encode(out.text, add_special_tokens=False)
    if out.finish_reason == "stop" and out.stop_reason is None:  # stopped on EOS
        ids.append(EOS_ID)
    return ids


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    boundary: int  # previous turn's committed length: its prompt + answer ids - 1 (0 on turn 1)
    expected: int  # the same from our own rendering: previous prompt + re-rendered answer - 1
    common: int  # tokens this prompt shares with the previous turn's prompt + answer ids
    cached: int | None
    finish_reason: str | None
    out: Completion
    cold: Completion | None = None


@dataclass
class ChatSession:
    """One conversation sent back as messages, turn by turn, under its own ``cache_salt``."""

    name: str
    seed: int
    request_args: Callable[[int], dict]  # turn (1-based) -> extra request fields
    system_words: int = 0
    user_words: int = 40
    followup_words: int = 12
    stream: Callable[[int], bool] = lambda turn: False
    template: str | None = None
    cold_controls: bool = False
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        if self.system_words:
            self.messages.append({"role": "system", "content": words(self.rng, self.system_words)})
        self.messages.append({"role": "user", "content": words(self.rng, self.user_words)})

    def step(self, base_url: str, tokenizer) -> Turn:
        index = len(self.turns) + 1
        args = dict(self.request_args(index), max_tokens=MAX_TOKENS, logprobs=2)
        if self.template is not None:
            args["chat_template"] = self.template
        out = chat(base_url, self.messages, stream=self.stream(index), cache_salt=f"chat-{self.name}", **args)
        prompt = render_ids(tokenizer, self.messages, self.template)
        assert out.prompt_token_ids == prompt, f"{self.name} turn {index}: server rendered another prompt"
        assert out.completion_tokens == len(out.token_ids) > 0
        boundary = expected = common = 0
        if self.turns:
            prev = self.turns[-1].out
            committed = prev.prompt_token_ids + prev.token_ids
            boundary, common = len(committed) - 1, common_prefix(committed, prompt)
            previous_prompt = render_ids(tokenizer, self.messages[:-2], self.template)
            expected = len(previous_prompt + rerendered_answer_ids(tokenizer, prev)) - 1
        cold = None
        if self.cold_controls:
            cold = chat(base_url, self.messages, cache_salt=f"chat-{self.name}-cold-{index}", **args)
        turn = Turn(index, len(prompt), boundary, expected, common, out.cached_tokens, out.finish_reason, out, cold)
        self.turns.append(turn)
        self.messages += [
            {"role": "assistant", "content": out.text},
            {"role": "user", "content": words(self.rng, self.followup_words)},
        ]
        return turn


def run_round_robin(sessions: list[ChatSession], base_url: str, tokenizer, turns: int = TURNS) -> None:
    """Every conversation's turn k before any turn k + 1 (they share the checkpoint store)."""
    for _ in range(turns):
        for session in sessions:
            session.step(base_url, tokenizer)


def report(sessions: list[ChatSession]) -> str:
    lines = []
    for s in sessions:
        cells = [f"t{t.turn}: P={t.prompt_tokens} b={t.boundary} c={t.cached} {t.finish_reason}" for t in s.turns]
        specials = sum(tok in SKIPPED_SPECIALS for t in s.turns for tok in t.out.token_ids)
        cells.append(f"skipped specials emitted: {specials}")
        lines.append(f"{s.name}: " + " | ".join(cells))
    return "\n".join(lines)


def _eos_after(words_of_turn: Callable[[int], int]) -> Callable[[int], dict]:
    return lambda turn: dict(logit_bias=dict(NO_SPECIALS, **FORCE_EOS), min_tokens=words_of_turn(turn))


def test_chat_turns_resume_at_response_boundary(server, tiny_tokenizer):
    sessions = [
        # Every answer runs to max_tokens; a system prompt pushes the prompts past the 256 block.
        ChatSession("length", seed=1, system_words=300, request_args=lambda t: dict(logit_bias=NO_SPECIALS)),
        # Every answer ends on EOS after 0, 3, 6, ... words (turn 1: an empty answer, EOS only).
        ChatSession("eos", seed=2, request_args=_eos_after(lambda t: 3 * (t - 1)), stream=lambda t: True),
        # Alternating EOS / max_tokens endings, streaming on even turns.
        ChatSession(
            "mixed",
            seed=3,
            system_words=60,
            request_args=lambda t: _eos_after(lambda _: 5)(t) if t % 2 else dict(logit_bias=NO_SPECIALS),
            stream=lambda t: t % 2 == 0,
        ),
        # No logit_bias: the special tokens stay in the content instead (turn 2: <s> only).
        ChatSession(
            "keep-specials",
            seed=5,
            system_words=80,
            request_args=lambda t: dict(skip_special_tokens=False, logit_bias={str(BOS_ID): 100} if t == 2 else None),
        ),
    ]
    run_round_robin(sessions, server.base_url, tiny_tokenizer)
    print("\n" + report(sessions))
    for s in sessions:
        assert s.turns[0].cached == 0, s.name  # a fresh salt: nothing to resume from
        for t in s.turns[1:]:
            where = f"{s.name} turn {t.turn}"
            assert t.expected == t.boundary, f"{where}: the re-rendered answer is not the answer's ids"
            assert t.common == t.boundary + 1, f"{where}: the template did not re-render the last turn as a prefix"
            assert t.cached == t.expected, f"{where}: cached {t.cached}, boundary {t.expected}"
    endings = {t.finish_reason for s in sessions for t in s.turns}
    assert endings == {"stop", "length"}
    assert set(sessions[3].turns[1].out.token_ids) == {BOS_ID}  # kept in the content, re-rendered exactly
    assert sessions[1].turns[0].out.token_ids == [EOS_ID]  # the empty answer: its boundary is P itself
    assert sessions[1].turns[1].boundary == sessions[1].turns[0].prompt_tokens


def test_skipped_special_tokens_only_hit_less(server, tiny_tokenizer):
    """Without ``logit_bias`` an answer may carry a special token the server drops from the
    content; the next turn then shares less with the checkpointed tokens and must hit less, never
    more. Turn 2 is forced to consist of ``<unk>`` only (its content is empty)."""

    def args(turn: int) -> dict:
        return dict(logit_bias={str(UNK_ID): 100}) if turn == 2 else {}

    session = ChatSession("skipped", seed=5, system_words=80, request_args=args, cold_controls=True)
    run_round_robin([session], server.base_url, tiny_tokenizer)
    print("\n" + report([session]))
    lossy_turns = 0
    for prev, t in zip(session.turns, session.turns[1:]):
        where = f"turn {t.turn}"
        if any(tok in SKIPPED_SPECIALS for tok in prev.out.token_ids):
            lossy_turns += 1
            assert t.expected < t.boundary and t.common <= t.boundary, where  # the content lost tokens
            assert t.cached is not None and t.cached <= t.common and t.cached < t.boundary, where
        else:
            assert t.cached == t.expected == t.boundary, where
        verdict, detail = same_greedy_output(t.out.token_ids, t.cold.token_ids, t.out.top_logprobs, t.cold.top_logprobs)
        assert verdict != "different", f"{where}: {detail}"
    assert lossy_turns >= 1
    assert set(session.turns[1].out.token_ids) == {UNK_ID}


def test_template_that_drops_earlier_answers_hits_less(server, tiny_tokenizer):
    """A request-level template that renders earlier assistant messages without their content:
    the previous answer is not a prefix of the next prompt, so no turn can resume at its response
    boundary; it resumes earlier (at most where the renderings part), and answers as a cold run."""
    session = ChatSession(
        "drop-answers",
        seed=11,
        system_words=60,
        request_args=lambda t: dict(logit_bias=NO_SPECIALS),
        template=DROP_ASSISTANT_TEMPLATE,
        cold_controls=True,
    )
    run_round_robin([session], server.base_url, tiny_tokenizer, turns=4)
    print("\n" + report([session]))
    for prev, t in zip(session.turns, session.turns[1:]):
        where = f"turn {t.turn}"
        assert t.common == prev.prompt_tokens, where  # the renderings part where the answer began
        assert t.cached is not None and t.cached <= t.common and t.cached < t.boundary, where
        assert t.cold.cached_tokens == 0
        verdict, detail = same_greedy_output(t.out.token_ids, t.cold.token_ids, t.out.top_logprobs, t.cold.top_logprobs)
        assert verdict != "different", f"{where}: {detail}"


def test_text_prompt_resend_and_continuation(server, tiny_tokenizer):
    """``/v1/completions`` with a text prompt: the exact resend resumes at P - 1, and the prompt
    text + answer text + new words resumes at the committed boundary (P + answer - 1)."""
    rng = random.Random(21)
    text = words(rng, 300)
    args = dict(max_tokens=MAX_TOKENS, cache_salt="text-prompt", ignore_eos=False, logit_bias=NO_SPECIALS)
    first = complete(server.base_url, text, **args)
    n_prompt = len(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert first.prompt_tokens == n_prompt == 300 and first.cached_tokens == 0
    resend = complete(server.base_url, text, **args)
    assert resend.cached_tokens == n_prompt - 1
    assert resend.token_ids == first.token_ids
    continuation = text + first.text + " " + words(rng, 30)  # the answer text starts with its space
    restored = complete(server.base_url, continuation, **args)
    # An EOS answer's text lacks its EOS: the continuation carries one token less, the boundary
    # (which excludes the last sampled token either way) is the same.
    answer_in_text = len(first.token_ids) - (first.finish_reason == "stop")
    assert restored.prompt_tokens == n_prompt + answer_in_text + 30
    assert restored.cached_tokens == n_prompt + first.completion_tokens - 1
