"""Pure checks of the instruction-boundary helpers (no engine, no server)."""

from __future__ import annotations

import pytest

from boundary_checkpoints.core.instruction import (
    INSTRUCTION_TOKENS_KEY,
    REQUEST_FIELD,
    instruction_boundary,
    instruction_error,
)
from boundary_checkpoints.frontend.serving import instruction_prefix_length, leading_instructions


@pytest.mark.parametrize(
    "value, expected",
    [(5, (5, "")), (1, (1, "")), (9, (9, "")), (0, (None, "out_of_range")), (-2, (None, "out_of_range")),
     (10, (None, "out_of_range")), (True, (None, "not_an_integer")), ("5", (None, "not_an_integer")),
     (5.0, (None, "not_an_integer")), (None, (None, "not_an_integer"))],
)  # fmt: skip
def test_instruction_boundary_validation(value, expected):
    assert instruction_boundary({INSTRUCTION_TOKENS_KEY: value}, 10) == expected
    message = instruction_error({INSTRUCTION_TOKENS_KEY: value}, 10)
    assert (message is None) == (expected[0] is not None)
    if message is not None:
        assert REQUEST_FIELD in message


def test_absent_boundary():
    assert instruction_boundary(None, 10) == (None, "")
    assert instruction_boundary({"other": 1}, 10) == (None, "")
    assert instruction_error({}, 10) is None


def test_leading_instructions_and_prefix():
    messages = [{"role": "system", "content": "a"}, {"role": "developer", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "system", "content": "d"}]  # fmt: skip
    assert leading_instructions(messages) == messages[:2]
    assert leading_instructions(messages[2:]) == []
    assert instruction_prefix_length([1, 2], [1, 2, 3]) == 2
    assert instruction_prefix_length([1, 2, 3], [1, 2, 3]) is None  # not a proper prefix
    assert instruction_prefix_length([1, 4], [1, 2, 3]) is None
    assert instruction_prefix_length([], [1, 2, 3]) is None
