"""Structured output through the official ``openai`` client on the real engine (bundled ``tiny``).

``response_format`` (``json_object``, strict ``json_schema``) and ``tool_choice`` (``required``,
named, ``none``, ``auto``; ``parallel_tool_calls``) are enforced while decoding by an xgrammar
mask, so answers parse, calls name declared tools with arguments that follow their schemas, and
``tool_choice="none"`` never shows ``<tool_call>`` markup. Constrained requests still hit the
prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from runtime.engine import Engine
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread

CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": CITY, "celsius": {"type": "boolean"}},
                "required": ["city", "celsius"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": CITY},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": CITY, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Engine, OpenAI]]:
    engine = Engine.from_pretrained("tiny", kv_cache_bytes=8 << 20)
    with ServerThread(create_app(engine)) as url:
        yield engine, OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
    engine.close()


def declared(name: str) -> dict[str, Any]:
    return next(t["function"] for t in TOOLS if t["function"]["name"] == name)


def check_arguments(name: str, arguments: str) -> None:
    """The arguments follow the declared schema (required keys, enum values, types)."""
    params = declared(name)["parameters"]
    args = json.loads(arguments)
    assert set(args) == set(params["required"])
    assert args["city"] in CITY["enum"]
    if "celsius" in args:
        assert isinstance(args["celsius"], bool)


def test_json_schema_strict_answer_parses_and_follows_the_schema(
    served: tuple[Engine, OpenAI],
) -> None:
    engine, client = served
    fmt: Any = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
    }
    for seed in (None, 1, 2):
        done = client.chat.completions.create(
            model=engine.model_id,
            messages=MESSAGES,
            max_tokens=40,
            temperature=0 if seed is None else 1.0,
            seed=seed,
            response_format=fmt,
        )
        value = json.loads(done.choices[0].message.content or "")
        assert set(value) == {"city", "sunny"} and value["city"] in CITY["enum"]
        assert isinstance(value["sunny"], bool)


def test_json_object_answer_is_a_json_object(served: tuple[Engine, OpenAI]) -> None:
    engine, client = served
    done = client.chat.completions.create(
        model=engine.model_id,
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


def test_tool_choice_required_returns_valid_calls_to_declared_tools(
    served: tuple[Engine, OpenAI],
) -> None:
    engine, client = served
    for parallel in (True, False):
        done = client.chat.completions.create(
            model=engine.model_id,
            messages=MESSAGES,
            max_tokens=120,
            temperature=0,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        if not parallel:
            assert len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.type == "function"
            check_arguments(call.function.name, call.function.arguments)


def test_named_tool_choice_calls_that_tool(served: tuple[Engine, OpenAI]) -> None:
    engine, client = served
    stream = client.chat.completions.create(
        model=engine.model_id,
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        stream=True,
    )
    calls = [
        call
        for chunk in stream
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    ]
    assert len(calls) == 1 and calls[0].function is not None
    assert calls[0].function.name == "get_time"
    check_arguments("get_time", calls[0].function.arguments or "")


def test_tool_choice_none_never_returns_tool_call_markup(served: tuple[Engine, OpenAI]) -> None:
    engine, client = served
    for seed in range(3):
        done = client.chat.completions.create(
            model=engine.model_id,
            messages=MESSAGES,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            tools=TOOLS,
            tool_choice="none",
        )
        message = done.choices[0].message
        assert not message.tool_calls and "<tool_call>" not in (message.content or "")


def test_tool_choice_auto_calls_only_declared_tools(served: tuple[Engine, OpenAI]) -> None:
    engine, client = served
    done = client.chat.completions.create(
        model=engine.model_id, messages=MESSAGES, max_tokens=120, temperature=0, tools=TOOLS, n=2
    )
    for choice in done.choices:
        for call in choice.message.tool_calls or []:
            check_arguments(call.function.name, call.function.arguments)
        assert (
            "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"
        )


def test_constrained_requests_use_the_prefix_cache(served: tuple[Engine, OpenAI]) -> None:
    engine, client = served
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    outs = [
        client.chat.completions.create(
            model=engine.model_id,
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            response_format=fmt,
            tools=TOOLS,
            tool_choice="none",
        )
        for _ in range(2)
    ]
    usage = outs[1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= usage.prompt_tokens // 2
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content


def test_unenforceable_combinations_are_refused(served: tuple[Engine, OpenAI]) -> None:
    engine, client = served
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(
            model=engine.model_id,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert info.value.body is not None and "response_format" in str(info.value.body)
    bad: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": 5}}}
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=engine.model_id, messages=MESSAGES, response_format=bad
        )
