"""The server's Hermes parser: its wire format (canonical JSON arguments) and template detection.

The behaviour it shares with the SDK is specified once, in ``tests/tool_call_cases.py``.
"""

from __future__ import annotations

import json

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


def test_detect_by_template() -> None:
    assert detect_tool_parser("...<tool_call>...") is not None
    # NOTE: a template that knows no tools gets Hermes text from the engine (hermes_markup)
    assert detect_tool_parser("{{ messages }}") is not None
    assert detect_tool_parser("{% if tools %}[TOOL_CALLS]{% endif %}{{ messages }}") is None
    assert detect_tool_parser(None) is None
