"""Anthropic breakpoint planner: count, placement, minimum length and TTL order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentcache.prompt import Document, Prompt, PromptBuilder
from agentcache.prompt.anthropic import (
    MAX_BREAKPOINTS,
    TierSpan,
    min_cacheable_tokens,
    plan_breakpoints,
)

TOOL = {"name": "search", "description": "Search.", "input_schema": {"type": "object"}}


def prompt(*, history: list[dict[str, Any]] | None = None, volatile: bool = True) -> Prompt:
    b = PromptBuilder().system("S" * 40).tools([TOOL]).documents([Document("d", "D" * 40)])
    b = b.history(
        history or [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    b = b.user("question")
    return (b.volatile("2026-11-29") if volatile else b).build()


def markers(body: dict[str, Any]) -> list[str]:
    """Paths of every cache_control marker in a body, in request order (tools, system, messages)."""
    found: list[str] = []
    for i, tool in enumerate(body.get("tools", [])):
        if "cache_control" in tool:
            found.append(f"tools[{i}]")
    for i, block in enumerate(body.get("system", [])):
        if "cache_control" in block:
            found.append(f"system[{i}]")
    for i, msg in enumerate(body["messages"]):
        for j, block in enumerate(msg["content"]):
            if "cache_control" in block:
                found.append(f"messages[{i}][{j}]")
    return found


def big(_: str) -> int:
    return 5000


def test_one_marker_per_tier_at_most_four() -> None:
    body = prompt().to_anthropic(model="claude-sonnet-4-5", count_tokens=big)
    assert markers(body) == ["tools[0]", "system[0]", "system[1]", "messages[2][0]"]
    assert len(markers(body)) <= MAX_BREAKPOINTS
    last = body["messages"][-1]["content"]
    assert [b["text"] for b in last] == ["question", "2026-11-29"]  # volatile after the marker


def test_no_markers_below_the_minimum_cacheable_length() -> None:
    body = prompt().to_anthropic(model="claude-haiku-4-5", count_tokens=len)
    assert markers(body) == []


def test_marker_only_once_the_prefix_reaches_the_minimum() -> None:
    counts = {"tools": 500, "system": 300, "documents": 400}

    def count(text: str) -> int:
        if text.startswith("<documents>"):
            return counts["documents"]
        if text.startswith("S"):
            return counts["system"]
        return counts["tools"] if "search" in text and "input_schema" in text else 10

    body = prompt().to_anthropic(model="claude-sonnet-4-5", count_tokens=count)
    # 500 < 1024, 800 < 1024, 1200 >= 1024: the first marker closes the documents tier.
    assert markers(body) == ["system[1]", "messages[2][0]"]


def test_one_hour_markers_come_before_five_minute_ones() -> None:
    body = prompt().to_anthropic(
        model="claude-sonnet-4-5",
        count_tokens=big,
        ttl={"tools": "1h", "system": "5m", "documents": "1h", "conversation": "5m"},
    )
    ttls = [b["cache_control"]["ttl"] for b in [*body["tools"], *body["system"]]]
    assert ttls == ["1h", "5m", "5m"]  # documents downgraded: 1h may not follow 5m
    plan = plan_breakpoints(
        [TierSpan("tools", 2000, ("tools", 0)), TierSpan("system", 10, ("system", 0))],
        model="claude-sonnet-4-5",
        ttl={"tools": "5m", "system": "1h"},
    )
    assert [b.ttl for b in plan.breakpoints] == ["5m", "5m"]
    assert any("downgraded" in note for note in plan.notes)


def test_stale_markers_in_history_are_stripped() -> None:
    old: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "assistant", "content": "yo"},
    ]
    body = prompt(history=old).to_anthropic(model="claude-sonnet-4-5", count_tokens=big)
    assert "messages[0][0]" not in markers(body)
    assert len(markers(body)) == 4


def test_tool_calls_become_tool_use_and_tool_result_blocks() -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    body = prompt(history=history, volatile=False).to_anthropic(
        model="claude-opus-4-1", count_tokens=big
    )
    assert body["messages"][1]["content"] == [
        {"id": "c1", "input": {"a": 1}, "name": "add", "type": "tool_use"}
    ]
    user = body["messages"][2]
    assert user["content"][0]["type"] == "tool_result" and user["content"][1]["text"] == "question"
    assert list(body) == ["model", "max_tokens", "tools", "system", "messages"]
    for key in ("tools", "system", "messages"):  # inside objects: sorted keys
        assert json.dumps(body[key]) == json.dumps(body[key], sort_keys=True)


@pytest.mark.parametrize(
    ("model", "minimum"),
    [
        ("claude-sonnet-4-5-20250929", 1024),
        ("claude-opus-4-5-20251101", 4096),
        ("claude-haiku-4-5", 4096),
        ("claude-3-5-haiku-20241022", 2048),
        ("claude-opus-4-1", 1024),
        ("some-future-model", 1024),
    ],
)
def test_minimum_cacheable_length_per_family(model: str, minimum: int) -> None:
    assert min_cacheable_tokens(model) == minimum
