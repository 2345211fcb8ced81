"""PromptBuilder: canonical bytes and chained fingerprints under shuffles and Unicode forms."""

from __future__ import annotations

import random
import unicodedata
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentcache.canonical import JSONValue
from agentcache.exceptions import PromptError
from agentcache.prompt import Document, Prompt, PromptBuilder
from agentcache.prompt.segments import SegmentKind
from agentcache.prompt.tools import ToolLike


def search_docs(query: str, limit: int = 5) -> list[str]:
    """Search the documentation.

    Args:
        query: Words to look for.
        limit: Maximum number of hits.
    """
    return []


class Weather(pydantic.BaseModel):
    """Current weather for a city."""

    city: str
    unit: str = "celsius"


def make_tool(name: str, props: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": props, "required": sorted(props)}
    return {
        "type": "function",
        "function": {"name": name, "description": name, "parameters": schema},
    }


TOOLS: list[ToolLike] = [
    make_tool("lookup", {"key": {"type": "string"}, "fuzzy": {"type": "boolean"}}),
    make_tool("add", {"a": {"type": "number", "minimum": 0.0}, "b": {"type": "number"}}),
    search_docs,
    Weather,
]
DOCS = [Document(f"doc-{i}", f"Body of document {i}.", source=f"docs/{i}.md") for i in range(6)]
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 2+3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]


def shuffle_keys(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffle_keys(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffle_keys(v, rng) for v in value]
    return value


def build(
    tools: list[ToolLike] = TOOLS,
    docs: list[Document] = DOCS,
    history: list[dict[str, Any]] = HISTORY,
    system: str = "You are a careful assistant.",
    user: str = "And 3+4?",
) -> Prompt:
    b = PromptBuilder(namespace="tenant-a").system(system).tools(tools).documents(docs)
    return b.history(history).user(user).volatile("Today is 2026-11-29.").build()


def function_of(schema: dict[str, JSONValue]) -> dict[str, JSONValue]:
    """The ``function`` object of an OpenAI ``tools`` entry."""
    function = schema["function"]
    assert isinstance(function, dict)
    return function


def render(p: Prompt) -> str:
    import json

    return json.dumps([p.to_messages(), p.tool_schemas()], ensure_ascii=False)


BASE = build()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_shuffled_keys_tools_and_documents_render_identically(seed: int) -> None:
    rng = random.Random(seed)
    tools = [shuffle_keys(t, rng) if isinstance(t, dict) else t for t in TOOLS]
    rng.shuffle(tools)
    docs = list(DOCS) + [rng.choice(DOCS)]  # plus an exact duplicate
    rng.shuffle(docs)
    history = shuffle_keys(HISTORY, rng)
    p = build(tools=tools, docs=docs, history=history)
    assert render(p) == render(BASE)
    assert p.fingerprints == BASE.fingerprints


@settings(max_examples=30, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_equivalent_unicode_forms_give_equal_fingerprints(text: str) -> None:
    nfc = build(system=unicodedata.normalize("NFC", text), user="é")
    nfd = build(system=unicodedata.normalize("NFD", text) + "  \n", user="e\u0301")
    assert render(nfc) == render(nfd)
    assert nfc.fingerprints == nfd.fingerprints


KINDS: list[SegmentKind] = ["system", "tools", "documents", "history", "user", "volatile"]


@pytest.mark.parametrize(
    ("changed", "overrides"),
    [
        ("system", {"system": "You are a terse assistant."}),
        ("tools", {"tools": [*TOOLS[:1], make_tool("add", {"a": {"type": "integer"}})]}),
        (
            "documents",
            {"docs": [*DOCS[:-1], Document("doc-5", "Edited body.", source="docs/5.md")]},
        ),
        ("history", {"history": [*HISTORY[:-1], {"role": "assistant", "content": "It's 5."}]}),
        ("user", {"user": "And 4+4?"}),
    ],
)
def test_changed_value_moves_exactly_that_fingerprint_and_later(
    changed: SegmentKind, overrides: dict[str, Any]
) -> None:
    p = build(**overrides)
    first = KINDS.index(changed)
    for i, kind in enumerate(KINDS):
        assert (p.fingerprints[kind] == BASE.fingerprints[kind]) == (i < first), kind


def test_segments_come_in_stability_order_whatever_the_call_order() -> None:
    b = PromptBuilder().volatile("now").user("u").history(HISTORY).documents(DOCS)
    p = b.tools(TOOLS).system("s").build()
    assert [s.kind for s in p.segments] == KINDS
    assert p.to_messages()[-1] == {"role": "user", "content": "u\n\nnow"}


def test_namespace_changes_every_fingerprint() -> None:
    other = PromptBuilder(namespace="tenant-b").system("You are a careful assistant.").build()
    mine = PromptBuilder(namespace="tenant-a").system("You are a careful assistant.").build()
    assert other.fingerprints["system"] != mine.fingerprints["system"]


def test_tools_sorted_by_name_unless_pinned() -> None:
    names: list[str] = []
    for schema in BASE.tool_schemas():
        name = function_of(schema)["name"]
        assert isinstance(name, str)
        names.append(name)
    assert names == sorted(names) == ["Weather", "add", "lookup", "search_docs"]
    pinned = PromptBuilder().tools(TOOLS, pinned_order=True).build()
    assert [t.name for t in pinned.tools] == ["lookup", "add", "search_docs", "Weather"]


def test_callable_schema_from_hints_and_docstring() -> None:
    spec = PromptBuilder().tools([search_docs]).build().tools[0]
    assert spec.description == "Search the documentation."
    assert spec.parameters["required"] == ["query"]
    props = spec.parameters["properties"]
    assert props == {
        "limit": {"default": 5, "description": "Maximum number of hits.", "type": "integer"},
        "query": {"description": "Words to look for.", "type": "string"},
    }


def test_numbers_render_one_way() -> None:
    one = PromptBuilder().tools([make_tool("t", {"x": {"type": "number", "maximum": 1.0}})]).build()
    two = PromptBuilder().tools([make_tool("t", {"x": {"type": "number", "maximum": 1}})]).build()
    assert one.fingerprints == two.fingerprints
    assert '"maximum":1,' in one.segments[0].text


def test_stale_cache_control_stripped_from_history() -> None:
    marked = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]
    plain = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    a = PromptBuilder().history(marked).build()
    assert a.fingerprints == PromptBuilder().history(plain).build().fingerprints


@pytest.mark.parametrize(
    "bad",
    [
        lambda b: b.tools([make_tool("x", {}), make_tool("x", {"y": {}})]),
        lambda b: b.documents([Document("a", "one"), Document("a", "two")]),
        lambda b: b.history([{"role": "wizard", "content": "x"}]),
        lambda b: b.tools([lambda *args: None]),
        lambda b: b.system(3),
    ],
)
def test_bad_input_raises_prompt_error(bad: Any) -> None:
    with pytest.raises(PromptError):
        bad(PromptBuilder())


def test_to_openai_body_shape() -> None:
    body = BASE.to_openai(model="gpt-4o", max_tokens=64)
    assert set(body) == {"max_tokens", "messages", "model", "prompt_cache_key", "tools"}
    assert body["messages"][0]["role"] == "system"
    assert '<document id="doc-0"' in body["messages"][0]["content"]
    assert body["prompt_cache_key"].startswith("ac-")
    assert "tenant-a" not in body["prompt_cache_key"]
    # The key follows the stable prefix only: a new user turn keeps it, a new system prompt not.
    assert build(user="Other?").to_openai(model="m")["prompt_cache_key"] == body["prompt_cache_key"]
    assert build(system="New.").to_openai(model="m")["prompt_cache_key"] != body["prompt_cache_key"]


def test_cached_tool_schemas_cannot_be_corrupted_by_callers() -> None:
    first = build()
    function_of(first.tool_schemas()[0])["name"] = "mutated"
    first.to_messages()[1]["content"] = "mutated"
    again = build()
    assert render(again) == render(BASE) and again.fingerprints == BASE.fingerprints


def test_bench_prints_p50_and_p99_json_last(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from agentcache.prompt.bench import main

    main(["--tools", "6", "--docs", "3", "--iterations", "5", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tools"] == 6 and result["p50_ms"] <= result["p99_ms"]


def test_templates_load_outside_the_repo_root(tmp_path: Any) -> None:
    import subprocess
    import sys

    code = (
        "from agentcache.prompt import Document, PromptBuilder\n"
        "p = PromptBuilder().documents([Document('a', 'x')]).build()\n"
        "print(p.documents_block().splitlines()[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "<documents>"
