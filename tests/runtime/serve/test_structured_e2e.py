"""Structured output through the official ``openai`` client on the real engine (bundled ``tiny``).

``response_format`` (``json_object``, strict ``json_schema``) and ``tool_choice`` (``required``,
named, ``none``, ``auto``; ``parallel_tool_calls``) are enforced while decoding by an xgrammar
mask, so answers parse, calls name declared tools with arguments that follow their schemas, and
``tool_choice="none"`` never shows ``<tool_call>`` markup. Constrained requests still hit the
prefix cache.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import BadRequestError
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall

from runtime.sampling.grammar import StructuralTagSpec
from runtime.serve.constraints import grammar_spec
from runtime.serve.protocol import ChatCompletionRequest
from tests.runtime.serve.conftest import Served

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


def chat(served: Served, **options: Any) -> ChatCompletion:
    """A (non-streamed) chat completion of ``MESSAGES``; ``options`` as the client takes them."""
    engine, client = served
    done: ChatCompletion = client.chat.completions.create(
        model=engine.model_id, messages=MESSAGES, **options
    )
    return done


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
    tiny_served: Served,
) -> None:
    fmt: Any = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
    }
    for seed in (None, 1, 2):
        done = chat(
            tiny_served,
            max_tokens=40,
            temperature=0 if seed is None else 1.0,
            seed=seed,
            response_format=fmt,
        )
        value = json.loads(done.choices[0].message.content or "")
        assert set(value) == {"city", "sunny"} and value["city"] in CITY["enum"]
        assert isinstance(value["sunny"], bool)


def test_json_object_answer_is_a_json_object(tiny_served: Served) -> None:
    done = chat(
        tiny_served,
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


def test_tool_choice_required_returns_valid_calls_to_declared_tools(
    tiny_served: Served,
) -> None:
    for parallel in (True, False):
        done = chat(
            tiny_served,
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


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
"""One well-formed Hermes/Qwen call of ``get_time``, as the grammar spells it."""


@pytest.mark.parametrize(
    ("choice", "parallel", "calls"),
    [
        ("required", True, [CALL, f"{CALL}\n{CALL}"]),
        ("required", False, [CALL]),
        ({"type": "function", "function": {"name": "get_time"}}, True, [CALL]),
    ],
)
def test_required_and_named_grammars_allow_tool_calls_only(
    tiny_served: Served, choice: Any, parallel: bool, calls: list[str]
) -> None:
    import xgrammar as xgr

    engine, _ = tiny_served
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}
    req = ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": parallel})
    spec = grammar_spec(req, has_tool_format=True)
    assert isinstance(spec, StructuralTagSpec)
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(spec.tag)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return bool(matcher.accept_string(text)) and matcher.is_terminated()

    for text in calls:
        assert accepts(text), text
        # OpenAI: the answer is tool calls only; no text before, after or (required) between.
        assert not accepts(f"{text}\n}}\n</tool_response>")
        assert not accepts(f"{text} done")
        assert not accepts(f"Sure. {text}")
    assert not accepts("")
    if not parallel:
        assert not accepts(f"{CALL}\n{CALL}")


def test_required_answers_have_no_content_on_tiny(tiny_served: Served) -> None:
    # NOTE: before, xgrammar's triggered tags let free text around the calls: seeds 2, 4 and 5
    # of this request answered content such as '>>opt' next to tool_calls.
    max_tokens = 160
    finished = 0
    for seed in range(6):
        done = chat(
            tiny_served, max_tokens=max_tokens, temperature=1.0, seed=seed, tools=TOOLS,
            tool_choice="required",
        )  # fmt: skip
        message = done.choices[0].message
        assert message.tool_calls, seed
        assert done.usage is not None
        if done.usage.completion_tokens < max_tokens:  # NOTE: a cut-off call stays as text
            finished += 1
            assert message.content is None, (seed, message.content)
        else:
            assert (message.content or "<tool_call>").startswith("<tool_call>"), seed
    assert finished >= 3


def test_named_tool_choice_calls_that_tool(tiny_served: Served) -> None:
    engine, client = tiny_served
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


def test_tool_choice_none_never_returns_tool_call_markup(tiny_served: Served) -> None:
    for seed in range(3):
        done = chat(
            tiny_served,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            tools=TOOLS,
            tool_choice="none",
        )
        message = done.choices[0].message
        assert not message.tool_calls and "<tool_call>" not in (message.content or "")


def test_tool_choice_auto_calls_only_declared_tools(tiny_served: Served) -> None:
    done = chat(tiny_served, max_tokens=120, temperature=0, tools=TOOLS, n=2)
    for choice in done.choices:
        for call in choice.message.tool_calls or []:
            assert isinstance(call, ChatCompletionMessageFunctionToolCall)
            check_arguments(call.function.name, call.function.arguments)
        assert (
            "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"
        )


def test_constrained_requests_use_the_prefix_cache(tiny_served: Served) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    outs = [
        chat(
            tiny_served,
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


def test_unenforceable_combinations_are_refused(tiny_served: Served) -> None:
    with pytest.raises(BadRequestError) as info:
        chat(
            tiny_served,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert info.value.body is not None and "response_format" in str(info.value.body)
    bad: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": 5}}}
    with pytest.raises(BadRequestError):
        chat(tiny_served, response_format=bad)


SAY: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "say",
            "description": "Say one fixed line.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "enum": ["a </tool_call> b"]}},
                "required": ["text"],
                "additionalProperties": False,
            },
        },
    }
]
"""A tool whose only grammar-valid argument holds the Hermes close tag (issue 35)."""


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "say"}}],
    ids=["required", "named"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["final", "streamed"])
def test_forced_call_whose_argument_holds_the_close_tag_is_a_call(
    tiny_served: Served, choice: Any, stream: bool
) -> None:
    # NOTE: before, the parser cut the block at the "</tool_call>" inside the string: no
    # tool_calls, and the raw markup came back as content.
    engine, client = tiny_served
    options: Any = {"tools": SAY, "tool_choice": choice, "parallel_tool_calls": False}
    request: Any = {"model": engine.model_id, "messages": MESSAGES, "max_tokens": 60}
    if not stream:
        done = client.chat.completions.create(**request, **options, temperature=0)
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls"
        assert message.content is None
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    else:
        chunks = list(
            client.chat.completions.create(**request, **options, temperature=0, stream=True)
        )
        choices = [choice for chunk in chunks for choice in chunk.choices]
        assert [c.finish_reason for c in choices if c.finish_reason] == ["tool_calls"]
        assert "".join(c.delta.content or "" for c in choices) == ""
        calls = [
            (call.function.name, call.function.arguments)
            for c in choices
            for call in c.delta.tool_calls or []
            if call.function is not None
        ]
    assert [(name, json.loads(args or "")) for name, args in calls] == [
        ("say", {"text": "a </tool_call> b"})
    ]
