"""Hermes ``<tool_call>`` parsing: well-formed calls, model mistakes kept as text, streaming cut."""

from __future__ import annotations

import json

import pytest

from runtime.serve.tool_parser import ToolCallParser, detect_tool_parser

PARSER = ToolCallParser()


def test_single_call_becomes_structured_and_content_is_the_rest() -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call>"
    content, calls = PARSER.parse(text)
    assert content == "Let me look."
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_two_calls_keep_their_order_and_arguments_are_canonical_json() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"z": 1, "y": [1, 2]}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"k\\": \\"v\\"}"}</tool_call>'
    )
    content, calls = PARSER.parse(text)
    assert content == ""
    assert [c.name for c in calls] == ["a", "b"]
    assert calls[0].arguments == '{"y": [1, 2], "z": 1}'
    assert json.loads(calls[1].arguments) == {"k": "v"}


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": "{broken"}',
        "[1, 2]",
    ],
)
def test_malformed_block_stays_in_content(body: str) -> None:
    text = f"before <tool_call>{body}</tool_call> after"
    content, calls = PARSER.parse(text)
    assert calls == []
    assert content == text


def test_text_without_calls_is_returned_unchanged() -> None:
    assert PARSER.parse("  plain answer \n") == ("  plain answer \n", [])


@pytest.mark.parametrize(
    ("text", "safe"),
    [
        ("hello", 5),
        ("hello <tool", 6),
        ("hello <", 6),
        ("hello <tool_call>{", 6),
        ("<tool_call>", 0),
        ("a < b", 5),
        ("", 0),
    ],
)
def test_safe_prefix_never_includes_a_possible_open_tag(text: str, safe: int) -> None:
    assert PARSER.safe_prefix_len(text) == safe


def test_detect_by_template() -> None:
    assert detect_tool_parser("...<tool_call>...") is not None
    assert detect_tool_parser("{{ messages }}") is None
    assert detect_tool_parser(None) is None
