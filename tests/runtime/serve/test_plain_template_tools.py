"""Tools on a model whose chat template knows none (SmolLM2's plain ChatML), through the server.

The engine writes the tool signatures, calls and results as Hermes text (``hermes_markup``), so
``tools`` reach the prompt instead of being dropped, and ``tool_choice`` ``required`` / named
are enforced by the same ``<tool_call>`` grammar as on a Hermes template. Bundled ``tiny`` under
``PLAIN_CHATML``, offline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from runtime.engine import Engine
from runtime.exceptions import InvalidRequestError
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread
from tests.runtime.plain_chatml import plain_tiny
from tests.runtime.serve.conftest import Served
from tests.runtime.serve.test_structured_e2e import MESSAGES, TOOLS, check_arguments


@pytest.fixture(scope="module")
def plain_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    engine = Engine.from_pretrained(str(plain_tiny(tmp_path_factory.mktemp("plain"))))
    with ServerThread(create_app(engine)) as url:
        yield engine, OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
    engine.close()


def chat(served: Served, *, messages: list[Any] = MESSAGES, **options: Any) -> Any:
    engine, client = served
    return client.chat.completions.create(model=engine.model_id, messages=messages, **options)


def test_tools_reach_the_prompt(plain_served: Served) -> None:
    engine, _ = plain_served
    alone = chat(plain_served, max_tokens=1).usage.prompt_tokens
    for choice in (None, "auto", "none"):
        extra: dict[str, Any] = {} if choice is None else {"tool_choice": choice}
        with_tools = chat(plain_served, max_tokens=1, tools=TOOLS, **extra).usage.prompt_tokens
        assert with_tools > alone + 50, choice  # the signatures are in the prompt
    text = engine.tokenizer.decode(engine.render_chat(MESSAGES, tools=TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name":"get_weather"' in text and '"name":"get_time"' in text


def test_required_and_named_choices_are_enforced(plain_served: Served) -> None:
    done = chat(plain_served, max_tokens=60, temperature=0, tools=TOOLS, tool_choice="required")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_arguments(call.function.name, call.function.arguments)
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    done = chat(plain_served, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named)
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_arguments("get_time", call.function.arguments)


def test_a_tool_round_trip_is_rendered_as_hermes_text(plain_served: Served) -> None:
    engine, _ = plain_served
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris","celsius":true}'},
    }
    messages: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]  # fmt: skip
    done = chat(plain_served, messages=messages, max_tokens=4, tools=TOOLS)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    text = engine.tokenizer.decode(engine.render_chat(
        [{**m, "content": m["content"] or ""} for m in messages], tools=TOOLS
    ))  # fmt: skip
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>" in text


def test_a_malformed_call_given_to_the_engine_is_an_invalid_request(plain_served: Served) -> None:
    """The server refuses it first (400); ``Engine.render_chat`` called directly says the same
    kind of error rather than an AttributeError from the rewrite."""
    engine, _ = plain_served
    bad: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]},
    ]
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        engine.render_chat(bad)
