"""One Hermes ``<tool_call>`` behaviour: every row of ``tool_call_cases`` against both parsers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from agentcache.agent.parsing import MarkupFilter, parse_hermes
from runtime.serve.tool_parser import ToolCallParser
from tests.tool_call_cases import CASES, HOLDBACK, Case

Parsed = tuple[str, list[tuple[str, dict[str, Any]]], int | None]


def sdk_parse(text: str) -> Parsed:
    parsed = parse_hermes(text)
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    return parsed.content, calls, len(parsed.errors)


def server_parse(text: str) -> Parsed:
    content, calls = ToolCallParser().parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], None


def sdk_shown(text: str) -> int:
    return len(MarkupFilter().feed(text))


def server_shown(text: str) -> int:
    return ToolCallParser().safe_prefix_len(text)


@pytest.mark.parametrize("parse", [sdk_parse, server_parse], ids=["sdk", "server"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_parsers_agree_with_the_spec(case: Case, parse: Callable[[str], Parsed]) -> None:
    content, calls, num_errors = parse(case.text)
    assert content == case.content
    assert calls == case.calls
    if num_errors is not None:  # only the SDK reports errors (the agent sends them to the model)
        assert num_errors == case.num_malformed


@pytest.mark.parametrize("shown", [sdk_shown, server_shown], ids=["sdk", "server"])
@pytest.mark.parametrize(("text", "safe"), HOLDBACK)
def test_streams_hold_back_the_same_text(text: str, safe: int, shown: Callable[[str], int]) -> None:
    assert shown(text) == safe
