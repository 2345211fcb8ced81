"""One agent test, two backends: the in-process LocalBackend and OpenAIBackend pointed at our
own OpenAI-compatible server (started in the test) over the same random-weight Llama engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from agentcache.agent import Agent, AgentConfig  # noqa: E402
from agentcache.backends import BaseBackend, GenerationOptions  # noqa: E402
from agentcache.backends.local import LocalBackend  # noqa: E402
from agentcache.backends.openai import OpenAIBackend  # noqa: E402
from agentcache.cache import MemoryStore, ToolCache  # noqa: E402

CALLS: list[str] = []


def define(word: str) -> str:
    """Define a word.

    Args:
        word: The word.
    """
    CALLS.append(word)
    return f"{word}: a word used in this test. " * 20


@pytest.fixture(scope="module")
def served(bpe_llama_dir: Path) -> Iterator[tuple[Any, str]]:
    from runtime import Engine
    from runtime.serve.app import create_app
    from runtime.serve.server_thread import ServerThread

    engine = Engine.from_pretrained(str(bpe_llama_dir))
    with ServerThread(create_app(engine)) as url:
        yield engine, url


@pytest.mark.parametrize("kind", ["local", "server"])
def test_same_agent_on_local_and_on_our_server(kind: str, served: tuple[Any, str]) -> None:
    engine, url = served
    engine.flush_cache()
    CALLS.clear()
    backend: BaseBackend
    if kind == "local":
        backend = LocalBackend(engine=engine)
    else:
        backend = OpenAIBackend(engine.model_id, base_url=f"{url}/v1", api_key="unused")
    agent = Agent(
        backend,
        system="You define words. " * 40,
        tools=[define],
        tool_cache=ToolCache(MemoryStore()),
        planner=lambda q: [("define", {"word": q.split()[-1]})],
        config=AgentConfig(generation=GenerationOptions(max_tokens=6), max_steps=2),
    )
    results = [agent.run(q) for q in ["define alpha", "define beta", "define alpha"]]
    usages = [r.usages[-1] for r in results]
    assert CALLS == ["alpha", "beta"]  # the third call is a tool-cache hit
    assert results[2].tool_cache_stats is not None and results[2].tool_cache_stats.hits == 1
    assert usages[0].cached_tokens == 0
    for previous, current in zip(usages, usages[1:], strict=False):
        assert current.prompt_tokens is not None and previous.prompt_tokens is not None
        assert current.cached_tokens is not None
        # Append-only history: the whole previous prompt is reused, up to one partial block.
        assert current.cached_tokens >= previous.prompt_tokens - 16
    assert all(u.completion_tokens and u.ttft_s for u in usages)
    assert [m["role"] for m in agent.history][:4] == ["user", "assistant", "tool", "assistant"]
    backend.close()


def test_cache_salt_separates_tenants(served: tuple[Any, str], tmp_path: Path) -> None:
    engine, _ = served
    engine.flush_cache()
    a = LocalBackend(engine=engine, cache_salt="tenant-a")
    b = LocalBackend(engine=engine, cache_salt="tenant-b")
    agent_a, agent_b = Agent(a, system="S " * 200), Agent(b, system="S " * 200)
    agent_a.run("hi")
    assert agent_b.run("hi").usages[-1].cached_tokens == 0
