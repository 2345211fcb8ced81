"""An agent with a cached tool: the second identical call is served from the tool cache.

Run: python examples/agent_with_tools.py   (bundled tiny model, offline)
"""

from __future__ import annotations

from agentcache.agent import Agent
from agentcache.backends import BaseBackend, create_backend
from agentcache.cache import MemoryStore, ToolCache


def word_count(text: str) -> int:
    """Count the words in a text.

    Args:
        text: Any text.
    """
    return len(text.split())


def main(backend: BaseBackend | None = None) -> list[str]:
    """Ask twice; the toy model cannot plan tool calls, so a planner picks them."""
    agent = Agent(
        backend or create_backend("local", model="tiny"),
        system="You count words with the word_count tool.",
        tools=[word_count],
        tool_cache=ToolCache(MemoryStore()),
        planner=lambda question: [("word_count", {"text": question})],
    )
    answers = []
    for question in ["How many words are in this sentence?"] * 2:
        result = agent.run(question)
        stats = result.tool_cache_stats
        usage = result.usages[-1]
        print(f"Q: {question}\nA: {result.output}")
        print(
            f"   tool cache hits={stats.hits if stats else 0}, cached tokens={usage.cached_tokens}"
        )
        answers.append(result.output)
    return answers


if __name__ == "__main__":
    main()
