"""Chat-template markers learned in the engine core (``core/chat_markers.py``) and the per-request
instruction boundary they give, on the tiny model's tokenizer and template, on a ChatML (Qwen3-
style) template over a small byte-level BPE tokenizer, and on templates where nothing can be
learned unambiguously (None for every request). The expected ``N`` is always the rendering of
the leading system message(s) alone, checked to be a token prefix of the full prompt."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from prompts import words

from bc_tools.fixtures.tiny_models import FIRST_PLAIN_ID, VOCAB_SIZE
from boundary_checkpoints.core.chat_markers import chat_markers_for, learn_markers
from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY
from boundary_checkpoints.core.ledger import Ledgers
from boundary_checkpoints.core.scheduler import BoundaryCheckpointMixin
from boundary_checkpoints.settings import BoundaryConfig, BoundaryConfigError

QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
# Like Qwen3.5's: refuses a conversation without a user message (no system-only rendering).
NEEDS_USER = (
    "{%- set ns = namespace(query=false) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.query = true %}{%- endif %}{%- endfor %}"
    "{%- if not ns.query %}{{- raise_exception('No user query found in messages.') }}{%- endif %}" + QWEN3_STYLE
)
# The system text folded into the first user turn (no system block of its own).
FOLDED_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] + ' ' %}"
    "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}<s> {{ m['role'] }} {% if loop.first %}{{ sys }}{% endif %}{{ m['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"
)
# The system block names the message count: it renders differently once more messages follow.
COUNTING = (
    "{% for message in messages %}<s> {{ message['role'] }} w{{ messages|length + 10 }} "
    "{{ message['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"
)
# No marker between messages at all (the tiny tokenizer drops the newline).
NO_MARKERS = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A small byte-level BPE tokenizer with Qwen's pre-tokenizer split and ChatML specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    qwen_split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen_split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = ["You are a helpful assistant.\nAnswer briefly.", "system user assistant\n\n<think>"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.chat_template = QWEN3_STYLE
    return tokenizer


def prose(rng: random.Random, n: int) -> str:
    vocab = ["You", "are", "a", "helpful", "assistant.", "Answer", "in", "French,\n", "please", "1234", "<b>"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def render(tokenizer, messages, template=None, generation=True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                         chat_template=template)  # fmt: skip
    return tokenizer.encode(text, add_special_tokens=False)


def expected_n(tokenizer, messages, template=None) -> int:
    """The leading system/developer messages rendered alone, checked to be a token prefix."""
    leading = []
    for message in messages:
        if message["role"] not in ("system", "developer"):
            break
        leading.append(message)
    alone = render(tokenizer, leading, template, generation=False)
    assert render(tokenizer, messages, template)[: len(alone)] == alone
    return len(alone)


def conversations(text, system_words: int):
    rng = random.Random(system_words)
    system, system_2 = text(rng, system_words), text(rng, 5)
    user, answer, user_2 = text(rng, 9), text(rng, 7), text(rng, 4)
    one = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {
        "one system block": one,
        "later turns": [*one, {"role": "assistant", "content": answer}, {"role": "user", "content": user_2}],
        "two system blocks": [one[0], {"role": "system", "content": system_2}, one[1]],
    }


@pytest.mark.parametrize("system_words", [1, 12, 300])
def test_tiny_template_gives_the_system_block(tiny_tokenizer, system_words):
    learned = learn_markers(tiny_tokenizer)
    assert learned.markers is not None, learned.reason
    assert "'</s>'" in learned.describe() and learned.describe().startswith("on (")
    for name, messages in conversations(words, system_words).items():
        n = learned.markers.boundary(render(tiny_tokenizer, messages))
        assert n == expected_n(tiny_tokenizer, messages), name
    # The tiny template renders "<s> system CONTENT </s> ": N = words + 3.
    assert learned.markers.boundary(render(tiny_tokenizer, conversations(words, 97)["one system block"])) == 100


def test_tiny_template_without_a_leading_system_block(tiny_tokenizer):
    markers = learn_markers(tiny_tokenizer).markers
    rng = random.Random(3)
    user_first = [{"role": "user", "content": words(rng, 9)}, {"role": "assistant", "content": words(rng, 3)},
                  {"role": "system", "content": words(rng, 5)}, {"role": "user", "content": words(rng, 4)}]  # fmt: skip
    assert markers.boundary(render(tiny_tokenizer, user_first)) is None
    system_only = [{"role": "system", "content": words(rng, 9)}]
    assert markers.boundary(render(tiny_tokenizer, system_only, generation=False)) is None  # nothing after it
    assert markers.boundary([]) is None and markers.boundary(None) is None
    random_ids = [rng.randrange(FIRST_PLAIN_ID, VOCAB_SIZE) for _ in range(500)]
    assert markers.boundary(random_ids) is None


@pytest.mark.parametrize("template", [QWEN3_STYLE, NEEDS_USER], ids=["qwen3_style", "needs_user"])
@pytest.mark.parametrize("system_words", [1, 40])
def test_chatml_template_gives_the_system_block(bpe_tokenizer, template, system_words):
    learned = learn_markers(bpe_tokenizer, template)
    assert learned.markers is not None, learned.reason
    assert learned.describe().startswith("on (ChatML markers learned from the chat template")
    im_start, im_end = bpe_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert learned.markers.close[0] == im_end and learned.markers.opening == (im_start,)
    for name, messages in conversations(prose, system_words).items():
        prompt = render(bpe_tokenizer, messages, template)
        leading = [m for m in messages if m["role"] == "system"]
        alone = render(bpe_tokenizer, leading, QWEN3_STYLE, generation=False)  # NEEDS_USER refuses this
        assert prompt[: len(alone)] == alone
        assert learned.markers.boundary(prompt) == len(alone), name
        assert bpe_tokenizer.decode(prompt[: len(alone)]).endswith("<|im_end|>\n")
    no_system = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert learned.markers.boundary(render(bpe_tokenizer, no_system, template)) is None


@pytest.mark.parametrize(
    "template, reason",
    [
        (FOLDED_SYSTEM, "does not end before the next message"),
        (COUNTING, "renders differently"),
        (NO_MARKERS, "no marker"),
        ("{{ raise_exception('no') }}", "does not render"),
    ],
    ids=["folded_system", "counting", "no_markers", "raises"],
)
def test_templates_without_learnable_markers_give_no_boundary(tiny_tokenizer, template, reason):
    learned = learn_markers(tiny_tokenizer, template)
    assert learned.markers is None
    assert reason in learned.reason and learned.describe() == f"off: {learned.reason}"


def test_a_tokenizer_without_chat_templates_gives_no_boundary():
    learned = learn_markers(object())
    assert learned.markers is None and "does not render" in learned.reason


def test_config_key_and_off(tiny_model_dir):
    assert BoundaryConfig().chat_instruction_boundary == "auto"
    config = BoundaryConfig.from_additional_config({"boundary_checkpoints": {"chat_instruction_boundary": "off"}})
    assert chat_markers_for(config, None).describe() == "off: chat_instruction_boundary is off"
    for bad in ("on", True, None):
        with pytest.raises(BoundaryConfigError, match="boundary_checkpoints.chat_instruction_boundary"):
            BoundaryConfig(chat_instruction_boundary=bad)


def _target(markers, prompt, extra_args=None):
    """The scheduler's ``_instruction_target`` on a stub scheduler and request."""
    counts: dict[str, int] = {}
    stub = SimpleNamespace(
        _ledgers=Ledgers(), _instruction_counts=counts, _chat_markers=markers, _grid_only=False,
        _count_instruction=lambda name: counts.__setitem__(name, counts.get(name, 0) + 1),
    )  # fmt: skip
    request = SimpleNamespace(
        request_id="r", prompt_token_ids=prompt, num_prompt_tokens=len(prompt),
        sampling_params=SimpleNamespace(extra_args=extra_args),
    )  # fmt: skip
    return BoundaryCheckpointMixin._instruction_target(stub, request), counts


def test_scheduler_uses_an_explicit_value_first_then_the_markers(tiny_tokenizer):
    learned = learn_markers(tiny_tokenizer)
    messages = conversations(words, 50)["one system block"]
    prompt = render(tiny_tokenizer, messages)
    n = expected_n(tiny_tokenizer, messages)
    assert _target(learned, prompt) == (n, {"instruction_from_template": 1, "instruction_requests": 1})
    assert _target(learned, prompt, {INSTRUCTION_TOKENS_KEY: 7}) == (7, {"instruction_requests": 1})
    target, counts = _target(learned, prompt, {INSTRUCTION_TOKENS_KEY: len(prompt)})  # invalid: ignored
    assert target == n and counts["instruction_ignored_out_of_range"] == 1
    off = learn_markers(tiny_tokenizer, NO_MARKERS)
    assert _target(off, prompt) == (None, {})
