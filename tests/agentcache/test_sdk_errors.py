"""Caller mistakes get typed agentcache errors with a message, never a stray library exception."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentcache.agent import Agent
from agentcache.agent.tools import ToolRegistry
from agentcache.backends.base import as_prompt
from agentcache.backends.fake import FakeBackend
from agentcache.cache import DiskStore
from agentcache.exceptions import (
    CacheError,
    ConfigError,
    EmptyCorpusError,
    PromptError,
    PromptTypeError,
)
from agentcache.prompt import Document, PromptBuilder
from agentcache.rag import DocumentIndex
from runtime.exceptions import ModelLoadError
from runtime.model.names import check_model_name
from runtime.models import BUNDLED_MODELS


def test_history_entry_that_is_not_a_message_names_its_index() -> None:
    with pytest.raises(PromptTypeError, match=r"history\[1\].*'role'"):
        PromptBuilder().history([{"role": "user", "content": "hi"}, "hello"])  # type: ignore[list-item]


def test_history_given_one_message_instead_of_a_list() -> None:
    with pytest.raises(PromptTypeError, match="list of chat messages"):
        PromptBuilder().history({"role": "user", "content": "hi"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((None, "x"), "id must be a non-empty str"),
        (("", "x"), "id must be a non-empty str"),
        (("a", 5), "'a': text must be a str, got int"),
        (("a", "x", 3), "'a': source must be a str or None"),
    ],
)
def test_document_fields_are_checked_at_construction(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(PromptTypeError, match=match):
        Document(*args)


@pytest.mark.parametrize(("kwargs", "name"), [({}, "id"), ({"id": "a"}, "text")])
def test_a_missing_document_field_is_a_typed_error(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(PromptTypeError, match=f"Document needs an {name}"):
        Document(**kwargs)


@pytest.mark.parametrize("tools", [len, {"type": "function"}, "get_weather"])
def test_one_tool_instead_of_a_list_asks_for_a_list(tools: Any) -> None:
    with pytest.raises(PromptTypeError, match=r"tools must be a list.*\.tools\(\[get_weather\]\)"):
        PromptBuilder().tools(tools)


def test_an_unknown_tool_scope_is_refused_without_a_tool_cache() -> None:
    with pytest.raises(ConfigError, match="scope must be one of.*'planet'"):
        Agent(FakeBackend([]), tool_scope="planet")  # type: ignore[arg-type]


def test_document_type_error_is_also_a_type_error() -> None:
    with pytest.raises(TypeError):
        Document("a", 5)  # type: ignore[arg-type]


def test_lambda_tool_asks_for_a_name() -> None:
    with pytest.raises(PromptError, match="lambda.*name"):
        PromptBuilder().tools([lambda x: x])


def test_lambda_tool_with_a_name_is_accepted() -> None:
    tool = ToolRegistry().add(lambda city: city, name="echo_city")
    assert tool.spec.name == "echo_city"
    function = tool.spec.openai()["function"]
    assert isinstance(function, dict) and function["name"] == "echo_city"


@pytest.mark.parametrize("name", ["has space", "dotted.name", "x" * 65, "ümlaut"])
def test_tool_names_outside_the_provider_pattern_are_rejected(name: str) -> None:
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    with pytest.raises(PromptError, match="tool name .* is invalid"):
        PromptBuilder().tools([tool])


def test_tool_name_of_64_allowed_characters_is_accepted() -> None:
    name = "a-Z_9" + "x" * 59
    prompt = PromptBuilder().tools([{"name": name, "input_schema": {"type": "object"}}]).build()
    assert prompt.tools[0].name == name


@pytest.mark.parametrize("field", ["messages", "tools"])
def test_to_openai_rejects_params_that_replace_rendered_fields(field: str) -> None:
    prompt = PromptBuilder().system("Be brief.").user("hi").build()
    with pytest.raises(PromptError, match=field):
        prompt.to_openai(model="m", **{field: []})


@pytest.mark.parametrize("field", ["messages", "tools", "system"])
def test_to_anthropic_rejects_params_that_replace_rendered_fields(field: str) -> None:
    prompt = PromptBuilder().system("Be brief.").user("hi").build()
    with pytest.raises(PromptError, match=field):
        prompt.to_anthropic(model="claude-sonnet-4-5", **{field: []})


def test_explicit_prompt_cache_key_is_allowed_and_wins() -> None:
    prompt = PromptBuilder().system("Be brief.").user("hi").build()
    derived = prompt.to_openai(model="m")["prompt_cache_key"]
    body = prompt.to_openai(model="m", prompt_cache_key="tenant-7", max_tokens=5)
    assert body["prompt_cache_key"] == "tenant-7" != derived
    assert body["messages"] == prompt.to_messages() and body["max_tokens"] == 5


def test_disk_store_on_a_file_is_a_cache_error(tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("keep me")
    with pytest.raises(CacheError, match="is a file, not a directory"):
        DiskStore(path)
    below = path / "cache"
    with pytest.raises(CacheError, match=f"{str(below)!r}: {str(path)!r} is a file, not a dir"):
        DiskStore(below)  # NOTE: was a NotADirectoryError from the recovery path
    assert path.read_text() == "keep me"


def test_empty_corpus_is_a_typed_error() -> None:
    with pytest.raises(EmptyCorpusError, match="empty corpus"):
        DocumentIndex([])


def test_backends_accept_plain_text_and_message_lists() -> None:
    backend = FakeBackend(default="ok")
    assert backend.complete("What is json?").text == "ok"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert backend.complete(messages).text == "ok"
    assert backend.prompts[0].to_messages() == [{"role": "user", "content": "What is json?"}]
    assert backend.prompts[1].to_messages() == messages


def test_as_prompt_names_what_it_accepts() -> None:
    with pytest.raises(PromptTypeError, match="built Prompt .* a str or a list of chat message"):
        as_prompt(42)  # type: ignore[arg-type]


def test_local_backend_refuses_an_unknown_model_name_at_once_without_torch(
    tmp_path: Path,
) -> None:
    # NOTE: a None entry in sys.modules makes `import torch` fail, as if it were not installed:
    # a name refused here never reached torch or the hub (that took about 60 s offline).
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "from agentcache.backends import create_backend\n"
        "from agentcache.exceptions import BackendUnavailableError\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        create_backend('local', model=name)\n"
        "    except BackendUnavailableError as exc:\n"
        "        print(exc)\n"
    )
    names = ["nope", "tinyy", "org/name", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, check=True
    )
    refused, typo, hub_id, folder = done.stdout.splitlines()
    for name, said in (("nope", refused), ("tinyy", typo)):
        with pytest.raises(ModelLoadError) as serve_says:
            check_model_name(name)  # what `agentcache serve --model NAME` prints
        assert said == str(serve_says.value)
        assert f"bundled models: {', '.join(BUNDLED_MODELS)}" in said
    assert "did you mean 'tiny'?" in typo
    # Hub ids with an owner and folders pass the check, as before (then torch is missing here).
    assert "local runtime cannot be imported" in hub_id
    assert "local runtime cannot be imported" in folder
