"""Isolated and fresh by default: tool results through one Agent per tenant, stateful tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentcache.agent import Agent
from agentcache.backends import ToolCall
from agentcache.backends.fake import FakeBackend
from agentcache.cache import DiskStore, MemoryStore, ToolCache, cache_scope
from agentcache.cache.scope import ScopeKind, current_scope
from agentcache.exceptions import ConfigError
from agentcache.rag import DocumentIndex, TextSource


def whoami(question: str) -> str:
    """Answer a question about the caller's account.

    Args:
        question: What to look up.
    """
    return f"account of {current_scope().tenant}/{current_scope().user}: {question}"


def _script(num_runs: int) -> list[Any]:
    script: list[Any] = []
    for n in range(num_runs):
        script += [ToolCall(f"c{n}", "whoami", '{"question": "balance"}'), "done"]
    return script


def _run_as(agent: Agent, **ids: str) -> str:
    with cache_scope(**ids):
        agent.run("my balance?")
    content = agent.history[-2]["content"]
    assert isinstance(content, str)
    return content


@pytest.mark.parametrize("tenants", [("a", "b"), ("a", "a")])
def test_two_tenants_through_one_agent_never_share_tool_results(tenants: tuple[str, str]) -> None:
    agent = Agent(FakeBackend(_script(2)), tools=[whoami], tool_cache=ToolCache(MemoryStore()))
    first = _run_as(agent, tenant=tenants[0], user="u1")
    second = _run_as(agent, tenant=tenants[1], user="u2")
    assert first == f"account of {tenants[0]}/u1: balance"
    assert second == f"account of {tenants[1]}/u2: balance"


def test_scope_global_opts_in_to_sharing_across_tenants() -> None:
    cache = ToolCache(MemoryStore())
    agent = Agent(FakeBackend(_script(2)), tools=[whoami], tool_cache=cache, tool_scope="global")
    first = _run_as(agent, tenant="a", user="u1")
    second = _run_as(agent, tenant="b", user="u2")
    assert second == first == "account of a/u1: balance"
    assert cache.stats().hits == 1


@pytest.mark.parametrize("agent_scope", ["global", "narrowest"])
def test_a_tool_wrapped_by_the_user_keeps_its_scope(agent_scope: ScopeKind) -> None:
    cache = ToolCache(MemoryStore())
    user_scoped = cache.wrap(whoami, name="whoami", scope="user")
    agent = Agent(
        FakeBackend(_script(3)), tools=[user_scoped], tool_cache=cache, tool_scope=agent_scope
    )
    assert agent.registry.names() == ["whoami"]
    first = _run_as(agent, tenant="a", user="u1")
    assert _run_as(agent, tenant="a", user="u2") == "account of a/u2: balance"
    assert _run_as(agent, tenant="a", user="u1") == first
    assert cache.stats().hits == 1 and cache.stats().misses == 2
    with pytest.raises(ConfigError, match="already wrapped"):
        agent.registry.add(user_scoped, name="again", scope="global")


def _sources(*names: str) -> list[TextSource]:
    return [TextSource(name, f"The {name} document talks about {name} things.") for name in names]


def _search(agent: Agent, query: str) -> str:
    agent.reset()
    agent.run(query)
    content = agent.history[-2]["content"]
    assert isinstance(content, str)
    return content


def _search_agent(
    index: DocumentIndex, store: DiskStore | MemoryStore, query: str = "zebra", **kw: Any
) -> Agent:
    script: list[Any] = []
    for n in range(4):
        script += [ToolCall(f"s{n}", "search_docs", f'{{"query": "{query}"}}'), "ok"]
    return Agent(FakeBackend(script), tools=[index.search_tool(**kw)], tool_cache=ToolCache(store))


def test_search_tool_sees_documents_right_after_they_are_added() -> None:
    index = DocumentIndex.from_sources(_sources("apple", "pear"))
    agent = _search_agent(index, MemoryStore())
    assert "zebra" not in _search(agent, "zebra?")
    index.add_sources(_sources("zebra"))
    assert "zebra things" in _search(agent, "zebra?")


def test_search_tool_sees_new_documents_after_a_restart(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "tools")
    before = _search_agent(DocumentIndex.from_sources(_sources("apple", "pear")), store)
    assert "zebra" not in _search(before, "zebra?")
    store.close()
    store = DiskStore(tmp_path / "tools")  # a new process: same directory, a grown corpus
    after = _search_agent(DocumentIndex.from_sources(_sources("apple", "pear", "zebra")), store)
    assert "zebra things" in _search(after, "zebra?")
    store.close()


def test_search_tools_with_different_k_do_not_share_entries() -> None:
    index = DocumentIndex.from_sources(_sources("apple", "pear", "plum", "zebra"))
    store = MemoryStore()
    one = _search(_search_agent(index, store, "document things", k=1), "any?")
    three = _search(_search_agent(index, store, "document things", k=3), "any?")
    assert one.count("] (") == 1 and three.count("] (") == 3
