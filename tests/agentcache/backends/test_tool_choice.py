"""``GenerationOptions.tool_choice`` on the local engine (a grammar), and Hermes markup for chat
templates that know no tools (SmolLM2's): on the bundled tiny model, offline."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from agentcache.agent import Agent, AgentConfig  # noqa: E402
from agentcache.agent.parsing import parse_hermes  # noqa: E402
from agentcache.backends import GenerationOptions  # noqa: E402
from agentcache.backends.fake import FakeBackend  # noqa: E402
from agentcache.backends.local import LocalBackend  # noqa: E402
from agentcache.prompt import PromptBuilder  # noqa: E402
from runtime.request.hermes_markup import knows_tools, with_hermes_markup  # noqa: E402
from tests.runtime.plain_chatml import PLAIN_CHATML, plain_tiny  # noqa: E402


def search_docs(query: str, k: int = 3) -> str:
    """Search the documentation.

    Args:
        query: Keywords or a question.
        k: How many passages.
    """
    return f"[doc-1] (json) results for {query!r} (k={k})"


def tool_prompt(history: list[dict[str, object]]) -> PromptBuilder:
    agent = Agent(FakeBackend(), system="Answer briefly.", tools=[search_docs])
    return PromptBuilder().system(agent.system).tools(
        [spec.openai() for spec in agent.registry.specs()]
    ).history(history)  # fmt: skip


@pytest.fixture(scope="module")
def tiny() -> LocalBackend:
    return LocalBackend("tiny")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> LocalBackend:
    """The tiny model with a chat template that knows no tools."""
    return LocalBackend(str(plain_tiny(tmp_path_factory.mktemp("plain"))))


@pytest.mark.parametrize("which", ["tiny", "plain"])
def test_required_is_one_valid_call_of_a_declared_tool(
    which: str, request: pytest.FixtureRequest
) -> None:
    backend: LocalBackend = request.getfixturevalue(which)
    prompt = tool_prompt([{"role": "user", "content": "What does json.loads do?"}]).build()
    response = backend.complete(prompt, GenerationOptions(max_tokens=64, tool_choice="required"))
    parsed = parse_hermes(response.text)
    assert parsed.errors == [] and parsed.content.strip() == ""
    [call] = parsed.calls
    arguments = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
    assert call.name == "search_docs" and isinstance(arguments["query"], str)
    assert set(arguments) <= {"query", "k"} and isinstance(arguments.get("k", 0), int)


def test_none_never_opens_a_tool_call(tiny: LocalBackend) -> None:
    history: list[dict[str, object]] = [{"role": "user", "content": "Search for json.loads."}]
    prompt = tool_prompt(history).build()
    response = tiny.complete(prompt, GenerationOptions(max_tokens=48, tool_choice="none"))
    assert "<tool_call>" not in response.text


def test_a_template_without_tools_gets_hermes_markup(plain: LocalBackend) -> None:
    history: list[dict[str, object]] = [
        {"role": "user", "content": "What does json.loads do?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "search_docs", "arguments": '{"query":"json.loads"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "[doc-1] (json) Deserialize s."},
    ]  # fmt: skip
    text = plain.render(tool_prompt(history).build())
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools")
    assert '"name":"search_docs"' in system and "<tool_call>" in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "search_docs", "arguments": ' in text
    assert "<|im_start|>user\n<tool_response>\n[doc-1] (json) Deserialize s.\n</tool_response>" in (
        text
    )
    assert text.endswith("<|im_start|>assistant\n")
    # NOTE: append-only: the rendering of a prefix of the history is a prefix of the text.
    shorter = plain.render(tool_prompt(history[:1]).build()).removesuffix("<|im_start|>assistant\n")
    assert text.startswith(shorter)


def test_knows_tools_reads_the_template() -> None:
    assert not knows_tools(PLAIN_CHATML) and knows_tools("{% if tools %}x{% endif %}")
    assert with_hermes_markup([{"role": "user", "content": "hi"}], []) == [
        {"role": "user", "content": "hi"}
    ]


def test_planned_results_as_context_put_the_sources_before_the_question() -> None:
    backend = FakeBackend(["It parses JSON [doc-1]."])
    agent = Agent(
        backend,
        tools=[search_docs],
        planner=lambda text: [("search_docs", {"query": text})],
        config=AgentConfig(planned_results="context", tool_choices=("none",)),
    )
    result = agent.run("What does json.loads do?")
    assert result.output == "It parses JSON [doc-1]."
    assert [c.name for c in result.tool_calls] == ["search_docs"]
    messages = backend.prompts[0].to_messages()
    assert [m["role"] for m in messages] == ["user"]
    assert messages[0]["content"] == (
        "Context:\n[doc-1] (json) results for 'What does json.loads do?' (k=3)\n\n"
        "Question: What does json.loads do?"
    )
    assert [m["role"] for m in agent.history] == ["user", "assistant"]


def test_tool_choice_values_are_checked() -> None:
    with pytest.raises(ValueError, match="tool_choice must be"):
        GenerationOptions(tool_choice="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tool_choices must be"):
        AgentConfig(tool_choices=("sometimes",))  # type: ignore[arg-type]
