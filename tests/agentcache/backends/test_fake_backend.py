"""The scripted fake backend: turns, exceptions, the simulated prefix cache, env helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentcache import env
from agentcache.backends import ToolCall, create_backend
from agentcache.backends.fake import FakeBackend
from agentcache.exceptions import BackendError, BackendHTTPError
from agentcache.prompt import PromptBuilder


def prompt_with(history: list[dict[str, str]]):  # type: ignore[no-untyped-def]
    return PromptBuilder().system("sys prompt here").history(history).build()


def test_turns_play_in_order_and_prompts_are_recorded() -> None:
    call = ToolCall("c1", "lookup", '{"q": "x"}')
    backend = FakeBackend(["hello there", call, BackendHTTPError("boom", status_code=503)])
    first = list(backend.stream(prompt_with([{"role": "user", "content": "hi"}])))
    assert "".join(e.text for e in first) == "hello there" == first[-1].response.text  # type: ignore[union-attr]
    assert backend.complete(prompt_with([])).tool_calls == (call,)
    with pytest.raises(BackendHTTPError):
        backend.complete(prompt_with([]))
    with pytest.raises(BackendError, match="exhausted"):
        backend.complete(prompt_with([]))
    assert len(backend.prompts) == 4


def test_callable_turns_see_the_prompt_and_hermes_renders_markup() -> None:
    backend = FakeBackend(
        [lambda p: ToolCall("c", "search", '{"query": "json"}')], tool_call_format="hermes"
    )
    text = backend.complete(prompt_with([])).text
    assert text == '<tool_call>\n{"name": "search", "arguments": {"query": "json"}}\n</tool_call>'


def test_simulated_prefix_cache_counts_shared_units() -> None:
    backend = FakeBackend(default="ok")
    history = [{"role": "user", "content": "first question"}]
    u1 = backend.complete(prompt_with(history)).usage
    history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
    u2 = backend.complete(prompt_with(history)).usage
    assert u1.cached_tokens == 0
    assert u2.cached_tokens == u1.prompt_tokens and u2.prompt_tokens > u1.prompt_tokens  # type: ignore[operator]
    changed = backend.complete(PromptBuilder().system("other").history(history).build()).usage
    assert changed.cached_tokens == 1  # only the leading role unit "system" is shared


def test_create_backend_fake() -> None:
    backend = create_backend("fake", model="m", default="x")
    assert isinstance(backend, FakeBackend) and backend.model == "m"


def test_env_cache_dir_override_and_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AGENTCACHE_CACHE_DIR", str(tmp_path / "c"))
    assert env.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("AGENTCACHE_CACHE_DIR")
    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path / "home"))
    assert env.cache_dir() == tmp_path / "home"  # NOTE: the one root of all state when set
    monkeypatch.delenv("AGENTCACHE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert env.cache_dir().name == "agentcache"
    monkeypatch.setenv("AGENTCACHE_API_KEY", "k1")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k2")
    assert env.api_key("anthropic") == "k1"
    monkeypatch.delenv("AGENTCACHE_API_KEY")
    assert env.api_key("anthropic") == "k2"
