"""Chat-template markers of a leading system block, learned once per engine; the instruction
boundary of a rendered chat prompt found from them in the engine core.

Contract
--------
* :func:`learn_markers` renders probe conversations through a tokenizer's own chat template
  (``[system S, user U]``, ``[system S]`` alone, the generation prompt, ``[system S1, system S2,
  user U]``, ``[developer D, user U]``, with sentinel texts) and learns, as token sequences, the
  head that opens a leading system (or developer) block, the ``close`` that ends one and the
  ``opening`` of the next message (ChatML: ``<|im_start|>system\\n`` / ``<|im_end|>\\n`` /
  ``<|im_start|>``). It returns a :class:`MarkerLearning` whose ``markers`` is None, with the
  ``reason``, when they cannot be learned unambiguously: a render fails, a sentinel is not found
  exactly once, the system block renders differently once later messages follow, the template
  puts no marker between the blocks, the tokenizer merges tokens across a block edge, or the
  learned markers miss the probes' own boundary.
* :meth:`ChatMarkers.boundary` maps a prompt's token ids to ``N``, the token count up to and
  including the close of the leading system/developer block(s), when the prompt starts with such
  a block and has more after it (``0 < N < P``); otherwise None. ``N`` only picks where a
  checkpoint is kept: its key holds the exact tokens, so a wrong ``N`` costs usefulness, never
  exactness.
* :func:`learn_for_engine` loads the model's tokenizer from the engine's ``VllmConfig`` (through
  ``compat.engine_tokenizer``; no network beyond vLLM's own loading) and never raises. The engine
  sees no server-side ``--chat-template`` or per-request template: markers come from the
  tokenizer's own template only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Sentinel message texts: plain words that no template adds, found by text search in a render.
_SYSTEM = "Zyxq sysalpha quorv"
_SYSTEM_2 = "Zyxq sysbeta vontl plimb"
_DEVELOPER = "Zyxq devgamma trelk"
_USER = "Zyxq userdelta wembo"
_USER_2 = "Zyxq userepsilon frazzle dorp"
_ASSISTANT = "Zyxq assistzeta glimm"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return tuple(a[:n])


def _find(ids: Sequence[int], pattern: tuple[int, ...], start: int) -> int:
    """First index >= ``start`` where ``pattern`` occurs in ``ids``, else -1."""
    first, size, end = pattern[0], len(pattern), len(ids) - len(pattern)
    i = start
    while i <= end:
        try:
            i = ids.index(first, i, end + 1)
        except ValueError:
            return -1
        if tuple(ids[i : i + size]) == pattern:
            return i
        i += 1
    return -1


def _starts_with(ids: Sequence[int], prefix: tuple[int, ...], at: int = 0) -> bool:
    return tuple(ids[at : at + len(prefix)]) == prefix


@dataclass(frozen=True)
class ChatMarkers:
    """Token sequences of a chat template's block structure (see the module docstring)."""

    heads: tuple[tuple[int, ...], ...]  # a prompt that starts a leading system/developer block
    close: tuple[int, ...]  # ends a system/developer block
    opening: tuple[int, ...]  # begins whatever message follows
    further: tuple[tuple[int, ...], ...]  # after ``close``: opens another system/developer block
    description: str = ""

    def boundary(self, prompt_ids: Sequence[int] | None) -> int | None:
        """``N`` for a prompt that starts with system/developer block(s) and goes on, else None."""
        if not prompt_ids:
            return None
        ids = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
        head = next((h for h in self.heads if _starts_with(ids, h)), None)
        if head is None:
            return None
        mark = self.close + self.opening
        position, n = len(head), None
        while True:
            i = _find(ids, mark, position)
            if i < 0:
                break
            n = i + len(self.close)
            following = next((f for f in self.further if _starts_with(ids, f, n)), None)
            if following is None:
                break
            position = n + len(following)
        if n is None or not 0 < n < len(ids):
            return None
        return n


@dataclass(frozen=True)
class MarkerLearning:
    """The outcome of :func:`learn_markers`: ``markers``, or None and the ``reason``."""

    markers: ChatMarkers | None
    reason: str = ""

    def describe(self) -> str:
        """A few words for the startup line."""
        if self.markers is not None:
            return f"on ({self.markers.description})"
        return f"off: {self.reason}"


class _Unlearnable(Exception):
    pass


class _Probe:
    """Renders and tokenizes probe conversations the way vLLM's chat renderer does (template
    text, then tokens without added special tokens)."""

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template

    def text(self, messages: list[dict], generation: bool = False) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation, chat_template=self.template
            )
        except Exception as err:  # a template may refuse a conversation shape
            raise _Unlearnable(f"the template does not render {[m['role'] for m in messages]} ({err})") from err
        if not isinstance(text, str):
            raise _Unlearnable("the template does not render text")
        return text

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def cuts(self, text: str, positions: Sequence[int]) -> list[tuple[int, ...]]:
        """The tokens of ``text`` cut at each character position, checked to be the same as
        tokenizing the pieces up to each cut (the tokenizer merges nothing across a cut)."""
        full = self.ids(text)
        pieces, start = [], 0
        for position in (*positions, len(text)):
            prefix = self.ids(text[:position])
            if full[: len(prefix)] != prefix or len(prefix) < start:
                raise _Unlearnable("the tokenizer merges tokens across a message edge")
            pieces.append(tuple(prefix[start:]))
            start = len(prefix)
        return pieces


def _locate(text: str, *needles: str) -> list[int]:
    """Start of each needle, each found exactly once, in order."""
    positions = []
    for needle in needles:
        if text.count(needle) != 1:
            raise _Unlearnable("a probe message's text is not rendered exactly once")
        positions.append(text.index(needle))
    if positions != sorted(positions):
        raise _Unlearnable("the template reorders messages")
    return positions


def _leading_text(probe: _Probe, leading: list[dict], rest: list[dict]) -> str:
    """The text the ``leading`` messages render to at the start of ``leading + rest``: their
    rendering alone where the template renders them alone (it must be a text prefix), else what
    comes before the rendering of ``rest`` alone (templates that refuse a conversation without a
    user message); raises when neither works."""
    full = probe.text([*leading, *rest])
    try:
        alone = probe.text(leading)
    except _Unlearnable:
        alone = None
    if alone is not None:
        if not full.startswith(alone):
            raise _Unlearnable("the system block renders differently once a user message follows")
        return alone
    tail = probe.text(rest)
    common = 0
    while common < min(len(full), len(tail)) and full[-1 - common] == tail[-1 - common]:
        common += 1
    cut = len(full) - common
    if cut <= 0:
        raise _Unlearnable("the system block cannot be told apart from the next message")
    return full[:cut]


def _learn_block(probe: _Probe, role: str, content: str) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(head, close, rendered text) of a leading ``role`` block followed by a user message; raises
    when that block's rendering depends on what follows."""
    leading = [{"role": role, "content": content}]
    full = probe.text([*leading, {"role": "user", "content": _USER}])
    alone = _leading_text(probe, leading, [{"role": "user", "content": _USER}])
    start, user = _locate(full, content, _USER)
    end = start + len(content)
    if not end <= len(alone) <= user:
        raise _Unlearnable(f"the {role} block does not end before the next message")
    head, _, close, _, _ = probe.cuts(full, [start, end, len(alone), user])
    return head, close, alone


def learn_markers(tokenizer: Any, chat_template: str | None = None) -> MarkerLearning:
    """Learn the markers from ``tokenizer``'s chat template (or ``chat_template``); never raises."""
    try:
        return MarkerLearning(_learn(_Probe(tokenizer, chat_template)))
    except _Unlearnable as err:
        return MarkerLearning(None, str(err))
    except Exception as err:  # a tokenizer without chat templates, or any other surprise
        return MarkerLearning(None, f"learning the template's markers failed ({type(err).__name__}: {err})")


def _learn(probe: _Probe) -> ChatMarkers:
    head, close, alone = _learn_block(probe, "system", _SYSTEM)
    if not close:
        raise _Unlearnable("the template puts no marker after a system block")
    conversation = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}]
    full = probe.text(conversation)
    user = _locate(full, _USER)[0]
    _, user_opening, _ = probe.cuts(full, [len(alone), user])
    generation = probe.text(conversation, generation=True)
    opening = user_opening
    if generation.startswith(full) and len(generation) > len(full):
        _, assistant_opening = probe.cuts(generation, [len(full)])
        opening = _common_prefix(user_opening, assistant_opening) or user_opening
    if not opening:
        raise _Unlearnable("the template puts no marker before the message after a system block")
    heads, further = [head], []

    # A second system block, then a leading developer block and one after a system block: each
    # learned only where the template renders it with the same close.
    second = _further_block(probe, [{"role": "system", "content": _SYSTEM}], "system", _SYSTEM_2, alone, close)
    if second:
        further.append(second)
    try:
        dev_head, dev_close, _ = _learn_block(probe, "developer", _DEVELOPER)
    except _Unlearnable:
        dev_head, dev_close = (), ()
    if dev_head and dev_close == close and dev_head != head:
        heads.append(dev_head)
        dev_further = _further_block(
            probe, [{"role": "system", "content": _SYSTEM}], "developer", _DEVELOPER, alone, close
        )
        if dev_further:
            further.append(dev_further)
    if any(not _starts_with(f, opening) for f in further):
        further = []  # a further block must begin with the common opening to be found after a close

    markers = ChatMarkers(
        heads=tuple(heads), close=close, opening=opening, further=tuple(further),
        description=_describe(probe.tokenizer, close, opening, len(further)),
    )  # fmt: skip
    _validate(probe, markers)
    return markers


def _further_block(
    probe: _Probe, before: list[dict], role: str, content: str, before_alone: str, close: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The opening of a ``role`` block rendered after ``before`` (a system block), or None."""
    try:
        messages = [*before, {"role": role, "content": content}, {"role": "user", "content": _USER_2}]
        text = probe.text(messages)
        if not text.startswith(before_alone):
            return None
        start, user = _locate(text, content, _USER_2)
        end = start + len(content)
        _, opening, _, block_close, _ = probe.cuts(text, [len(before_alone), start, end, user])
    except _Unlearnable:
        return None
    return opening if opening and block_close[: len(close)] == close else None


def _validate(probe: _Probe, markers: ChatMarkers) -> None:
    """The learned markers must find the probes' own boundaries (a system block alone as a token
    prefix), and nothing in a conversation without one."""
    cases = [
        ([{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}],
         [{"role": "system", "content": _SYSTEM}]),
        (
            [{"role": "system", "content": _SYSTEM_2}, {"role": "user", "content": _USER},
             {"role": "assistant", "content": _ASSISTANT}, {"role": "user", "content": _USER_2}],
            [{"role": "system", "content": _SYSTEM_2}],
        ),
    ]  # fmt: skip
    for conversation, leading in cases:
        prompt = probe.ids(probe.text(conversation, generation=True))
        expected = probe.ids(_leading_text(probe, leading, conversation[len(leading) :]))
        if prompt[: len(expected)] != expected or markers.boundary(prompt) != len(expected):
            raise _Unlearnable("the learned markers miss a probe conversation's system block")
    plain = probe.text([{"role": "user", "content": _USER}], generation=True)
    n = markers.boundary(probe.ids(plain))
    if n is not None and n > len(probe.ids(plain[: plain.index(_USER)])):
        raise _Unlearnable("the learned markers find a boundary inside a user message")


def _describe(tokenizer: Any, close: tuple[int, ...], opening: tuple[int, ...], further: int) -> str:
    def text(ids: tuple[int, ...]) -> str:
        try:
            return repr(tokenizer.decode(list(ids), skip_special_tokens=False))
        except Exception:
            return repr(list(ids))

    chatml = "ChatML " if "<|im_end|>" in text(close) and "<|im_start|>" in text(opening) else ""
    return (
        f"{chatml}markers learned from the chat template: a system block ends with {text(close)}, "
        f"the next message opens with {text(opening)}" + (", several leading blocks" if further else "")
    )


def learn_for_engine(vllm_config: Any) -> MarkerLearning:
    """:func:`learn_markers` on the model's tokenizer from ``vllm_config``; never raises."""
    from boundary_checkpoints.compat import engine_tokenizer

    try:
        tokenizer = engine_tokenizer(vllm_config.model_config)
    except Exception as err:
        return MarkerLearning(None, f"the tokenizer did not load ({type(err).__name__}: {err})")
    if tokenizer is None:
        return MarkerLearning(None, "no tokenizer (skip_tokenizer_init)")
    if not getattr(tokenizer, "chat_template", None):
        return MarkerLearning(None, "the tokenizer has no chat template")
    return learn_markers(tokenizer)


def chat_markers_for(config: Any, vllm_config: Any) -> MarkerLearning:
    """What the engine uses for chat instruction boundaries under ``config`` (a BoundaryConfig)."""
    if config.chat_instruction_boundary == "off":
        return MarkerLearning(None, "chat_instruction_boundary is off")
    return learn_for_engine(vllm_config)
