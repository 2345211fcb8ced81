"""OpenAI bodies: stable-to-volatile top-level order and a turn-to-turn byte prefix on the wire."""

from __future__ import annotations

import json
from typing import Any

import httpx

from agentcache.backends.base import GenerationOptions
from agentcache.backends.hints import EngineHints
from agentcache.backends.openai import OpenAIBackend
from agentcache.cache import cache_scope
from agentcache.prompt import Document, Prompt, PromptBuilder

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def _prompts(n: int) -> list[Prompt]:
    """The prompt of each of ``n`` turns of one tool-using conversation."""
    base = PromptBuilder(namespace="t").system("You answer from documents.").tools(TOOLS)
    base = base.documents([Document("faq", "Returns are free within 30 days.")])
    history: list[dict[str, Any]] = []
    prompts = []
    for i in range(n):
        prompts.append(base.copy().history(history).user(f"question {i}").build())
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "search", "arguments": "{}"},
        }
        history += [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"step {i}", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f'{{"ok": true, "hits": {i}}}'},
        ]
    return prompts


def _wire(body: dict[str, Any]) -> bytes:
    return httpx.Request("POST", "http://x", json=body).content


def _assert_each_body_extends_the_last(bodies: list[bytes]) -> None:
    for before, after in zip(bodies, bodies[1:], strict=False):
        assert before.endswith(b"]}")
        assert after.startswith(before[:-2])


def test_each_turns_body_minus_its_closing_brackets_is_a_byte_prefix_of_the_next() -> None:
    bodies = [
        _wire(p.to_openai(model="gpt-4o", temperature=0.2, max_tokens=64, tool_choice="auto"))
        for p in _prompts(5)
    ]
    assert list(json.loads(bodies[0])) == [
        "model",
        "max_tokens",
        "prompt_cache_key",
        "temperature",
        "tool_choice",
        "tools",
        "messages",
    ]
    _assert_each_body_extends_the_last(bodies)


def test_the_backend_keeps_messages_last_after_hints_and_extra_fields() -> None:
    backend = OpenAIBackend(
        "gpt-4o",
        base_url="http://localhost:1/v1",
        api_key="k",
        extra_body={"user": "u1", "metadata": {"b": 1, "a": 2}},
        engine_hints=EngineHints(cache_salt=True),
    )
    options = GenerationOptions(max_tokens=32)
    with cache_scope(tenant="acme"):
        bodies = [_wire(backend.request_body(p, options)) for p in _prompts(4)]
    keys = list(json.loads(bodies[0]))
    assert keys[0] == "model" and keys[-2:] == ["tools", "messages"]
    assert {"cache_salt", "user", "metadata"} <= set(keys)
    assert b'"metadata":{"a":2,"b":1}' in bodies[0]  # sorted inside objects
    _assert_each_body_extends_the_last(bodies)
