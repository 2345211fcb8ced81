"""What the serving layer needs from an engine: ``ServingEngine`` (``runtime.Engine`` satisfies it).

A Protocol so the serve layer depends on the engine's shape, not on its module, and a scripted fake
engine can stand in for tests. It knows nothing about HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from runtime.outputs import CacheStats, StreamDelta
from runtime.request.spec import RequestSpec
from runtime.sampling.grammar import Grammar, GrammarSpec
from runtime.scheduler.config import SchedulerStats

__all__ = ["ServingEngine"]


class ServingEngine(Protocol):
    """What the server needs from ``runtime.Engine`` (a fake engine can stand in for tests)."""

    @property
    def model_id(self) -> str: ...

    @property
    def max_context_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def submit(self, spec: RequestSpec) -> Sequence[Iterator[StreamDelta]]:
        """One stream per choice of ``spec`` (the engine checks only what needs the model)."""
        ...

    def compile_grammar(self, spec: GrammarSpec) -> Grammar: ...

    def cache_stats(self) -> CacheStats: ...

    def scheduler_stats(self) -> SchedulerStats: ...

    def flush_cache(self, *, include_disk: bool = False) -> int: ...

    def flush_namespace(self, cache_salt: str | None) -> int: ...
