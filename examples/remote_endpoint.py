"""The same tool-using agent against any OpenAI-compatible endpoint: only the backend changes.

Run: AGENTCACHE_BASE_URL=http://127.0.0.1:8000/v1 python examples/remote_endpoint.py
(e.g. after `agentcache serve`; OPENAI_API_KEY or AGENTCACHE_API_KEY if the server needs one)
"""

from __future__ import annotations

from agentcache import env
from agentcache.agent import Agent
from agentcache.backends import BaseBackend, create_backend
from agentcache.cache import MemoryStore, ToolCache


def python_version() -> str:
    """Return the Python version the tools run on."""
    import platform

    return platform.python_version()


def main(backend: BaseBackend | None = None, model: str = "default") -> str:
    """One question; a real model decides itself whether to call the tool."""
    if backend is None:
        url = env.base_url()
        if url is None:
            raise SystemExit("set AGENTCACHE_BASE_URL to an OpenAI-compatible /v1 endpoint")
        backend = create_backend(url, model=env.default_model() or model)
    agent = Agent(
        backend,
        system="You answer questions about the Python runtime; use tools when helpful.",
        tools=[python_version],
        tool_cache=ToolCache(MemoryStore()),
    )
    result = agent.run("Which Python version are the tools running on?", on_text=print)
    usage = result.usages[-1]
    print(f"prompt={usage.prompt_tokens} cached={usage.cached_tokens} ttft={usage.ttft_s}")
    return result.output


if __name__ == "__main__":
    main()
