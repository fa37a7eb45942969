"""The command lines' help, rendered in-process (no server): every option says what it does, and
no default is printed twice (``bc-bench`` once showed ``(default: a new temp dir) (default: None)``)."""

from __future__ import annotations

import argparse

import pytest

from bc_tools.bench import cli_args, demo

PARSERS = {"bc-demo": demo.build_parser, "bc-bench": cli_args.build_parser}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text ``--help`` prints for ``action`` (with the formatter's default added)."""
    return parser._get_formatter()._expand_help(action)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_option_has_help_and_each_default_once(name):
    parser = PARSERS[name]()
    for action in _options(parser):
        assert action.help and action.help.strip(), f"{name} {action.option_strings[0]} has no help text"
        text = _help_text(parser, action)
        assert text.count("(default:") <= 1, f"{name} {action.option_strings[0]}: {text!r}"
        assert "(default: None)" not in text and "(default: [])" not in text, text
    rendered = parser.format_help()
    assert all(line.count("(default:") <= 1 for line in rendered.splitlines()), rendered
    # One option's help is one block of the rendered text: count per option, across wrapped lines too.
    assert rendered.count("(default:") == sum("(default:" in _help_text(parser, a) for a in _options(parser))


def test_bc_demo_help_names_every_default():
    parser = demo.build_parser()
    for action in _options(parser):
        assert "(default:" in _help_text(parser, action), action.option_strings[0]
    text = parser.format_help()
    for flag, default in (("--turns", "8"), ("--max-tokens", "32"), ("--user-tokens", "100"),
                          ("--followup-tokens", "60"), ("--startup-timeout", "300.0")):  # fmt: skip
        action = next(a for a in parser._actions if flag in a.option_strings)
        assert f"(default: {default})" in _help_text(parser, action), flag
        assert flag in text


def test_bc_bench_help_keeps_a_written_default_and_adds_plain_ones():
    parser = cli_args.build_parser()
    by_flag = {a.option_strings[-1]: a for a in _options(parser)}
    assert _help_text(parser, by_flag["--log-dir"]).endswith("(default: a new temp dir)")
    assert _help_text(parser, by_flag["--turns"]).endswith("(default: 4)")
    assert "(default:" not in _help_text(parser, by_flag["--relaunch"]).replace("(default: every", "")
    assert "(default:" not in _help_text(parser, by_flag["--launch"])  # no default: nothing printed
