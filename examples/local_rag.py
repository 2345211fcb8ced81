"""Local RAG: index a folder (default: stdlib docstrings), retrieve through a cache, answer.

Run: python examples/local_rag.py [FOLDER]   (bundled tiny model, offline)
"""

from __future__ import annotations

import sys

from agentcache.agent import Agent
from agentcache.backends import BaseBackend, create_backend
from agentcache.cache import MemoryStore, RetrievalCache
from agentcache.rag import DocumentIndex, load_folder, stdlib_sources


def main(backend: BaseBackend | None = None, folder: str | None = None) -> list[str]:
    """Index, then ask three questions (the third repeats the first: a retrieval-cache hit)."""
    sources = load_folder(folder) if folder else stdlib_sources(max_files=60)
    retrieval_cache = RetrievalCache(MemoryStore())
    index = DocumentIndex.from_sources(sources, cache=retrieval_cache)
    search_docs = index.search_tool(k=3)
    agent = Agent(
        backend or create_backend("local", model="tiny"),
        system="Answer from the passages returned by search_docs; cite their ids.",
        tools=[search_docs],
        planner=lambda question: [("search_docs", {"query": question})],
    )
    answers = []
    questions = ["What does the abc module provide?", "How do I use argparse?"]
    for question in [*questions, questions[0]]:
        before = retrieval_cache.stats()
        result = agent.run(question)
        hits = retrieval_cache.stats().since(before).hits
        usage = result.usages[-1]
        ttft = "n/a" if usage.ttft_s is None else f"{1000 * usage.ttft_s:.1f} ms"
        print(f"Q: {question}\nA: {result.output}")
        print(
            f"   prompt {usage.prompt_tokens} tokens, {usage.cached_tokens} cached; TTFT {ttft}; "
            f"retrieval cache {'hit' if hits else 'miss'}"
        )
        answers.append(result.output)
    return answers


if __name__ == "__main__":
    main(folder=sys.argv[1] if len(sys.argv) > 1 else None)
