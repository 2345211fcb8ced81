"""The agent loop on the scripted fake backend: tools, caching, bad calls, step limit, prefixes."""

from __future__ import annotations

import json

import pytest

from agentcache.agent import Agent, AgentConfig, parse_hermes
from agentcache.agent.parsing import MarkupFilter
from agentcache.backends import ToolCall
from agentcache.backends.fake import FakeBackend, FakeTurn, prompt_units
from agentcache.cache import MemoryStore, ToolCache
from agentcache.exceptions import AgentError, ConfigError
from agentcache.prompt import Document

CALLS: list[str] = []


def get_weather(city: str, unit: str = "C") -> str:
    """Current weather of a city.

    Args:
        city: City name.
        unit: "C" or "F".
    """
    CALLS.append(city)
    return f"{city}: 21{unit}"


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("database down")


def make_agent(backend: FakeBackend, **kw: object) -> Agent:
    CALLS.clear()
    return Agent(
        backend,
        system="You are a weather bot.",
        tools=[get_weather, broken],
        documents=[Document("d1", "Paris is in France.")],
        tool_cache=ToolCache(MemoryStore()),
        **kw,  # type: ignore[arg-type]
    )


def test_tool_round_then_answer_with_append_only_history() -> None:
    backend = FakeBackend(
        [ToolCall("c1", "get_weather", '{"city": "Paris"}'), "It is 21C in Paris."]
    )
    agent = make_agent(backend)
    streamed: list[str] = []
    result = agent.run("Weather in Paris?", on_text=streamed.append)
    assert result.output == "It is 21C in Paris." == "".join(streamed)
    assert result.finish_reason == "stop" and CALLS == ["Paris"]
    roles = [m["role"] for m in agent.history]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert agent.history[2] == {"role": "tool", "tool_call_id": "c1", "content": "Paris: 21C"}
    # Append-only: the second model call's prompt extends the first one unit for unit.
    first, second = (prompt_units(p) for p in backend.prompts)
    assert second[: len(first)] == first
    assert result.usages[1].cached_tokens == len(first)


def test_repeated_tool_call_is_served_from_the_tool_cache() -> None:
    call = ToolCall("c1", "get_weather", '{"city": "Oslo"}')
    backend = FakeBackend([call, "cold", ToolCall("c2", "get_weather", '{"city":"Oslo"}'), "still"])
    agent = make_agent(backend)
    first = agent.run("Oslo?")
    second = agent.run("Oslo again?")
    assert CALLS == ["Oslo"]
    assert first.tool_cache_stats is not None and first.tool_cache_stats.misses == 1
    assert second.tool_cache_stats is not None and second.tool_cache_stats.hits == 1
    assert agent.history[-2]["content"] == "Oslo: 21C"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (ToolCall("c", "nope", "{}"), "unknown tool 'nope'; available tools: broken, get_weather"),
        (ToolCall("c", "get_weather", '{"city": '), "are not a JSON object"),
        (ToolCall("c", "get_weather", '{"town": "X"}'), "bad arguments for 'get_weather'"),
        (ToolCall("c", "broken", '{"x": 1}'), "raised RuntimeError: database down"),
    ],
)
def test_model_mistakes_become_messages_not_crashes(call: ToolCall, expected: str) -> None:
    agent = make_agent(FakeBackend([call, "sorry"]))
    result = agent.run("go")
    assert result.output == "sorry"
    assert expected in agent.history[2]["content"] and result.steps[0].outcomes[0].is_error


def test_malformed_hermes_call_is_reported_back_to_the_model() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    turns: list[FakeTurn] = [bad, ToolCall("c", "get_weather", '{"city": "Rome"}'), "ok"]
    backend = FakeBackend(turns, tool_call_format="hermes")
    agent = make_agent(backend)
    streamed: list[str] = []
    result = agent.run("Rome?", on_text=streamed.append)
    assert result.output == "ok" and CALLS == ["Rome"]
    assert agent.history[1] == {"role": "assistant", "content": bad}
    assert (
        agent.history[2]["role"] == "user"
        and "could not parse tool call" in agent.history[2]["content"]
    )
    assert agent.history[3]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "<tool_call>" not in "".join(streamed)


def test_hermes_call_whose_argument_holds_the_close_tag_runs_with_it() -> None:
    # Issue 35: the block used to end at the first "</tool_call>", inside the argument string,
    # so the call was reported as malformed and its markup kept as text.
    city = "Paris </tool_call> <tool_call>"
    backend = FakeBackend(
        [ToolCall("c", "get_weather", json.dumps({"city": city})), "done"],
        tool_call_format="hermes",
    )
    agent = make_agent(backend)
    streamed: list[str] = []
    result = agent.run("Paris?", on_text=streamed.append)
    assert result.output == "done" and CALLS == [city]
    assert not any(outcome.is_error for step in result.steps for outcome in step.outcomes)
    assert agent.history[1]["content"] is None
    assert "".join(streamed) == "done"


def test_step_limit_raises_or_returns() -> None:
    loop = [ToolCall(f"c{i}", "get_weather", '{"city": "A"}') for i in range(3)]
    with pytest.raises(AgentError, match="max_steps=2"):
        make_agent(FakeBackend(loop), config=AgentConfig(max_steps=2)).run("x")
    soft = make_agent(FakeBackend(loop), config=AgentConfig(max_steps=2, raise_on_step_limit=False))
    result = soft.run("x")
    assert result.finish_reason == "max_steps" and len(result.steps) == 2


def test_planner_calls_run_through_the_same_path_and_cache() -> None:
    backend = FakeBackend(["answer one", "answer two"])
    agent = make_agent(backend, planner=lambda text: [("get_weather", {"city": text})])
    agent.run("Lima")
    second = agent.run("Lima")
    assert CALLS == ["Lima"] and second.tool_cache_stats is not None
    assert second.tool_cache_stats.hits == 1
    ids = [m["tool_calls"][0]["id"] for m in agent.history if m.get("tool_calls")]
    assert ids == ["call_0", "call_1"]
    first_prompt, second_prompt = (prompt_units(p) for p in backend.prompts)
    assert second_prompt[: len(first_prompt)] == first_prompt


def test_parse_hermes_and_markup_filter() -> None:
    text = 'Let me check.<tool_call>{"name": "f", "arguments": {"b": 1, "a": 2}}</tool_call>'
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check." and parsed.calls[0].arguments == '{"a":2,"b":1}'
    markup = MarkupFilter()
    shown = [markup.feed(p) for p in ["Hi <to", "ol_call>{", "}</tool_call>"]]
    assert "".join(shown) + markup.flush() == "Hi "
    plain = MarkupFilter()
    assert plain.feed("a <t") + plain.feed("able>") + plain.flush() == "a <table>"


def test_streamed_text_never_shows_tool_call_markup_from_a_native_backend() -> None:
    # A server without a tool parser returns the model's Hermes markup as plain content.
    text = 'Let me look. <tool_call>{"name": "x", "arguments": {}}</tool_call>'
    shown: list[str] = []
    result = Agent(FakeBackend([text])).run("q", on_text=shown.append)
    assert "".join(shown) == "Let me look. "
    assert result.output == text  # the answer record keeps what the model wrote


@pytest.mark.parametrize(
    ("tools", "says"),
    [
        (get_weather, "got the single tool 'get_weather'; pass tools=[get_weather]"),
        ("get_weather", "got the string 'get_weather'; pass the function itself in a list"),
        ({"name": "f", "parameters": {}}, "got a dict; pass tools=[...] with one entry per tool"),
        (None, "got None; pass tools=[] for no tools"),
    ],
)
def test_tools_not_given_as_a_list_is_a_config_error_naming_the_fix(
    tools: object, says: str
) -> None:
    # NOTE: a single function is the common slip; it used to fail with "'function' object is
    # not iterable", and a string registered its characters as tools ("tool 'g' is not ...").
    with pytest.raises(ConfigError) as exc:
        Agent(FakeBackend(["hi"]), tools=tools)  # type: ignore[arg-type]
    assert says in str(exc.value)
    assert Agent(FakeBackend(["hi"]), tools=(get_weather,)).registry.names() == ["get_weather"]


@pytest.mark.parametrize(
    ("documents", "says"),
    [
        (Document("d1", "text"), "got the single document 'd1'; pass documents=[doc]"),
        ("some text", "got a string; pass a list of Document"),
        (None, "got None; pass a list of Document (documents=[] for none)"),
        ([Document("d1", "text"), "more"], "documents[1] is a str, not a Document"),
    ],
)
def test_documents_not_given_as_a_list_of_documents_is_a_config_error(
    documents: object, says: str
) -> None:
    # NOTE: a bare Document failed with "'Document' object is not iterable".
    with pytest.raises(ConfigError) as exc:
        Agent(FakeBackend(["hi"]), documents=documents)  # type: ignore[arg-type]
    assert says in str(exc.value)
    assert Agent(FakeBackend(["hi"]), documents=(Document("d1", "text"),)).documents[0].id == "d1"
