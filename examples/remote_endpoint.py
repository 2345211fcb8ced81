"""The same tool-using agent against any OpenAI-compatible endpoint: only the backend changes.

Run: AGENTCACHE_BASE_URL=http://127.0.0.1:8000/v1 python examples/remote_endpoint.py
(e.g. after `agentcache serve`). The model is AGENTCACHE_MODEL, or else the first one the endpoint
lists at /v1/models; OPENAI_API_KEY or AGENTCACHE_API_KEY if the server needs a key.
"""

from __future__ import annotations

import sys

from agentcache import AgentCacheError, env
from agentcache.agent import Agent
from agentcache.backends import BaseBackend, create_backend
from agentcache.cache import MemoryStore, ToolCache


def python_version() -> str:
    """Return the Python version the tools run on."""
    import platform

    return platform.python_version()


def show(text: str) -> None:
    print(text, end="", flush=True)


def main(backend: BaseBackend | None = None) -> str:
    """One question; a real model decides itself whether to call the tool."""
    if backend is None:
        url = env.base_url()
        if url is None:
            raise SystemExit("set AGENTCACHE_BASE_URL to an OpenAI-compatible /v1 endpoint")
        backend = create_backend(url, model=env.default_model())  # None: ask /v1/models
    agent = Agent(
        backend,
        system="You answer questions about the Python runtime; use tools when helpful.",
        tools=[python_version],
        tool_cache=ToolCache(MemoryStore()),
    )
    result = agent.run("Which Python version are the tools running on?", on_text=show)
    usage = result.usages[-1]
    print(f"\nmodel={backend.model} prompt={usage.prompt_tokens} cached={usage.cached_tokens}")
    return result.output


if __name__ == "__main__":
    try:
        main()
    except AgentCacheError as exc:
        sys.exit(f"remote_endpoint: {exc}")
