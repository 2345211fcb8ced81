"""Anthropic bodies: at most 4 markers, stable-to-volatile order, turn-to-turn byte prefix."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentcache.backends.anthropic import AnthropicBackend
from agentcache.exceptions import PromptError
from agentcache.prompt import Document, PromptBuilder
from agentcache.prompt.anthropic import MAX_BREAKPOINTS
from agentcache.prompt.render import check_anthropic_markers, count_anthropic_markers

MARK = {"type": "ephemeral"}
TOOL = {"name": "search", "description": "Search.", "input_schema": {"type": "object"}}
text = st.text(alphabet="abcxyz ", min_size=1, max_size=30).map(lambda t: t.strip() or "x")


def _part(body: str, marked: bool) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": body}
    return {**part, "cache_control": MARK} if marked else part


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Alternating turns; user text, tool calls and tool results, many with nested markers."""
    history: list[dict[str, Any]] = []
    for n in range(draw(st.integers(1, 6))):
        marked = st.booleans()
        parts = [_part(draw(text), draw(marked)) for _ in range(draw(st.integers(1, 3)))]
        if n:  # an Anthropic-native tool_result block, markers inside its content
            inner = [_part(draw(text), draw(marked)) for _ in range(draw(st.integers(1, 3)))]
            parts.insert(0, {"type": "tool_result", "tool_use_id": f"x{n}", "content": inner})
        history.append({"role": "user", "content": parts})
        call = {
            "id": f"c{n}",
            "type": "function",
            "function": {"name": "search", "arguments": "{}"},
        }
        history.append({"role": "assistant", "content": None, "tool_calls": [call]})
        nested = [_part(draw(text), draw(marked)) for _ in range(draw(st.integers(1, 3)))]
        result: dict[str, Any] = {"role": "tool", "tool_call_id": f"c{n}", "content": nested}
        if draw(marked):
            result["cache_control"] = MARK
        history.append(result)
        history.append({"role": "assistant", "content": [_part(draw(text), draw(marked))]})
    return history


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), big=st.booleans(), model=st.sampled_from(["claude-sonnet-4-5", "x"]))
def test_no_body_ever_carries_more_than_four_markers(
    history: list[dict[str, Any]], big: bool, model: str
) -> None:
    prompt = (
        PromptBuilder()
        .system("S" * 40)
        .tools([TOOL])
        .documents([Document("d", "D" * 40)])
        .history(history)
        .user("question")
        .build()
    )
    body = prompt.to_anthropic(model=model, count_tokens=(lambda _: 5000) if big else len)
    assert json.dumps(body).count('"cache_control":') <= MAX_BREAKPOINTS  # on the wire text
    assert "cache_control" not in json.dumps([m["content"] for m in body["messages"][:-1]])


def test_a_hand_made_body_with_nested_markers_is_refused_before_sending() -> None:
    nested = [{"type": "text", "text": "r", "cache_control": MARK} for _ in range(5)]
    body = {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": nested}]}]}
    with pytest.raises(PromptError, match="5 cache_control markers"):
        check_anthropic_markers(body)


def test_a_tool_parameter_named_cache_control_is_not_counted_as_a_marker() -> None:
    def configure(cache_control: str) -> str:
        """Set the caching mode.

        Args:
            cache_control: The mode.
        """
        return cache_control

    prompt = (
        PromptBuilder()
        .system("S" * 40)
        .tools([configure])
        .documents([Document("d", "D" * 40)])
        .history([{"role": "user", "content": [_part("earlier", True)]}])
        .user("question")
        .build()
    )
    body = prompt.to_anthropic(model="claude-sonnet-4-5", count_tokens=lambda _: 5000)
    assert count_anthropic_markers(body) == MAX_BREAKPOINTS  # the planner's four, and no more
    assert "cache_control" in body["tools"][0]["input_schema"]["properties"]
    assert "cache_control" not in body["messages"][0]["content"][0]  # the history's is stripped


def _turns(num_turns: int) -> list[bytes]:
    """Body bytes (as httpx sends them) of an agent's successive model calls."""
    bodies: list[bytes] = []
    history: list[dict[str, Any]] = [{"role": "user", "content": "find the json docs"}]
    for n in range(num_turns):
        prompt = (
            PromptBuilder()
            .system("S" * 400)
            .tools([TOOL])
            .documents([Document("d", "D" * 400)])
            .history(history)
            .build()
        )
        body = prompt.to_anthropic(
            model="claude-sonnet-4-5", count_tokens=lambda t: len(t) * 4, max_tokens=64
        )
        bodies.append(httpx.Request("POST", "http://x", json=body).content)
        call = {
            "id": f"c{n}",
            "type": "function",
            "function": {"name": "search", "arguments": "{}"},
        }
        history += [
            {"role": "assistant", "content": f"step {n}", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{n}", "content": f'{{"hits": {n}, "ok": true}}'},
        ]
    return bodies


def _without_message_markers(data: bytes) -> bytes:
    body = json.loads(data)
    for message in body["messages"]:
        for block in message["content"]:
            block.pop("cache_control", None)
    return httpx.Request("POST", "http://x", json=body).content


def test_each_turns_body_minus_its_closing_brackets_is_a_byte_prefix_of_the_next() -> None:
    bodies = _turns(5)
    assert [list(json.loads(b)) for b in bodies[:1]] == [
        ["model", "max_tokens", "tools", "system", "messages"]
    ]
    for before, after in zip(bodies, bodies[1:], strict=False):
        # Tools and system keep their markers in place: byte-identical up to the messages.
        head = before[: before.index(b'"messages":')]
        assert after.startswith(head) and b"cache_control" in head
        # The conversation marker moves to the newest block; everything else is appended.
        stable = _without_message_markers(before)
        assert stable.endswith(b"]}")
        assert _without_message_markers(after).startswith(stable[:-2])


def test_unknown_keywords_are_refused_and_extra_body_is_explicit() -> None:
    prompt = PromptBuilder().system("S").user("hi").build()
    with pytest.raises(PromptError, match=r"unknown body field\(s\) \['max_token'\]"):
        prompt.to_anthropic(model="claude-sonnet-4-5", max_token=10)
    body = prompt.to_anthropic(model="claude-sonnet-4-5", extra_body={"container": "c1"})
    assert body["container"] == "c1" and list(body)[-1] == "messages"


def test_the_minimum_cacheable_length_can_be_overridden() -> None:
    prompt = PromptBuilder().system("S" * 100).user("hi").build()
    assert "cache_control" not in json.dumps(prompt.to_anthropic(model="claude-sonnet-4-5"))
    body = prompt.to_anthropic(model="claude-sonnet-4-5", min_cacheable_tokens=1)
    assert "cache_control" in json.dumps(body["system"])
    with pytest.raises(ValueError, match="min_tokens"):
        prompt.to_anthropic(model="claude-sonnet-4-5", min_cacheable_tokens=0)


def test_tool_results_given_as_json_text_are_canonical_like_arguments() -> None:
    def history(result: str) -> list[dict[str, Any]]:
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "f", "arguments": '{"b":1,"a":2}'},
        }
        return [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": result},
        ]

    one = PromptBuilder().history(history('{"z": 1, "a": [1, 2]}')).build()
    two = PromptBuilder().history(history('{"a":[1,2],"z":1}')).build()
    assert one.to_openai(model="m") == two.to_openai(model="m")
    scalar = PromptBuilder().history(history("1.0")).build()
    assert scalar.history[-1]["content"] == "1.0"


def _stream(*events: tuple[str, dict[str, Any]]) -> bytes:
    return "".join(f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events).encode()


@respx.mock
def test_a_null_in_message_delta_usage_keeps_the_counts_from_message_start() -> None:
    start_usage = {
        "input_tokens": 10,
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 50,
        "output_tokens": 1,
    }
    late_usage = {
        "input_tokens": None,
        "cache_read_input_tokens": None,
        "cache_creation_input_tokens": None,
        "output_tokens": 7,
    }
    content = _stream(
        ("message_start", {"message": {"model": "claude-x", "usage": start_usage}}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": "hi"}}),
        ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": late_usage}),
        ("message_stop", {}),
    )
    respx.post("https://api.anthropic.test/v1/messages").mock(
        return_value=httpx.Response(200, content=content)
    )
    backend = AnthropicBackend("claude-x", base_url="https://api.anthropic.test", api_key="k")
    usage = backend.complete(PromptBuilder().user("hi").build()).usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (2060, 2000, 7)
