"""A scripted backend for tests and examples: each call plays the next scripted turn.

A turn is text, one or more ``ToolCall``, a full ``ModelResponse``, an exception to raise, or a
callable that receives the prompt and returns one of those. It simulates an exact prefix cache
over word-level units, so cache-friendliness can be tested without a model. Knows no network.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeAlias

from agentcache.backends.base import (
    BaseBackend,
    Capabilities,
    GenerationOptions,
    ModelResponse,
    PromptInput,
    PromptLike,
    StreamEvent,
    ToolCall,
    ToolCallFormat,
    as_prompt,
)
from agentcache.canonical import canonical_json
from agentcache.exceptions import BackendError
from agentcache.usage import Usage

__all__ = ["FakeBackend", "FakeTurn", "prompt_units"]

FakeTurn: TypeAlias = (
    "str | ToolCall | Sequence[ToolCall] | ModelResponse | BaseException"
    " | Callable[[PromptLike], FakeTurn]"
)

_UNIT = re.compile(r"\w+|[^\w\s]")


def prompt_units(prompt: PromptLike) -> list[str]:
    """Word-level units of a prompt in render order: tool schemas, then each message.

    Used as the fake backend's "tokens": a prompt that extends an earlier one keeps its units as
    a prefix, exactly like token ids under an append-only chat template.
    """
    parts = [canonical_json(schema) for schema in prompt.tool_schemas()]
    for message in prompt.to_messages():
        parts.append(str(message.get("role", "")))
        content = message.get("content")
        parts.append(content if isinstance(content, str) else canonical_json(content))
        for key in ("tool_calls", "tool_call_id", "name"):
            if key in message:
                parts.append(canonical_json(message[key]))
    return [unit for part in parts for unit in _UNIT.findall(part)]


class FakeBackend(BaseBackend):
    """Plays scripted turns in order; records every prompt it receives.

    Attributes:
        prompts: Every prompt passed to ``stream``, in call order.
        responses: Every response returned, in call order.
    """

    name = "fake"

    def __init__(
        self,
        turns: Iterable[FakeTurn] = (),
        *,
        model: str = "fake-model",
        tool_call_format: ToolCallFormat = "native",
        default: str | None = None,
    ) -> None:
        """Create a fake backend.

        Args:
            turns: Scripted turns, consumed one per call.
            model: Name reported in responses.
            tool_call_format: ``native`` returns tool calls as data; ``hermes`` renders them as
                ``<tool_call>`` JSON in the text, like a local ChatML model.
            default: Text returned once the script is exhausted; ``None`` raises instead.
        """
        self._turns = list(turns)
        self._model = model
        self._format: ToolCallFormat = tool_call_format
        self._default = default
        self._last_units: list[str] = []
        self.prompts: list[PromptLike] = []
        self.responses: list[ModelResponse] = []

    @property
    def capabilities(self) -> Capabilities:
        """Simulated prefix cache; tool calls in the configured format."""
        return Capabilities(
            supports_prefix_cache=True,
            reports_cached_tokens=True,
            tool_call_format=self._format,
            is_local=True,
        )

    @property
    def model(self) -> str:
        """The configured model name."""
        return self._model

    @property
    def num_remaining(self) -> int:
        """Scripted turns not yet played."""
        return len(self._turns)

    def add_turns(self, *turns: FakeTurn) -> None:
        """Append turns to the script."""
        self._turns.extend(turns)

    def stream(
        self, prompt: PromptInput, options: GenerationOptions | None = None
    ) -> Iterator[StreamEvent]:
        """Play the next turn (see ``BaseBackend.stream``).

        Raises:
            BackendError: The script is exhausted and no ``default`` was given.
            BaseException: Whatever exception the scripted turn holds.
        """
        options = options or GenerationOptions()
        prompt = as_prompt(prompt)
        start = time.perf_counter()
        self.prompts.append(prompt)
        response = self._to_response(self._next_turn(prompt), prompt)
        usage = self._usage(prompt, response, time.perf_counter() - start)
        response = ModelResponse(
            text=response.text,
            tool_calls=response.tool_calls,
            finish_reason=response.finish_reason,
            usage=usage,
            cost_usd=0.0,
            model=self._model,
        )
        self.responses.append(response)
        for piece in re.findall(r"\S+\s*|\s+", response.text):
            yield StreamEvent(piece)
        yield StreamEvent("", response)

    def _next_turn(self, prompt: PromptLike) -> FakeTurn:
        if not self._turns:
            if self._default is None:
                raise BackendError("FakeBackend script exhausted: add turns or pass default=")
            return self._default
        turn = self._turns.pop(0)
        while callable(turn) and not isinstance(turn, ToolCall):
            turn = turn(prompt)
        return turn

    def _to_response(self, turn: FakeTurn, prompt: PromptLike) -> ModelResponse:
        if isinstance(turn, BaseException):
            raise turn
        if isinstance(turn, ModelResponse):
            return turn
        if isinstance(turn, str):
            return ModelResponse(text=turn, finish_reason="stop")
        calls = (turn,) if isinstance(turn, ToolCall) else tuple(turn)  # type: ignore[arg-type]
        if self._format == "hermes":
            return ModelResponse(text=_hermes_text(calls), finish_reason="stop")
        return ModelResponse(text="", tool_calls=calls, finish_reason="tool_calls")

    def _usage(self, prompt: PromptLike, response: ModelResponse, elapsed_s: float) -> Usage:
        units = prompt_units(prompt)
        cached = _common_prefix_len(units, self._last_units)
        completion = _UNIT.findall(response.text) + [
            unit for call in response.tool_calls for unit in _UNIT.findall(call.arguments)
        ]
        self._last_units = units
        return Usage(
            prompt_tokens=len(units),
            completion_tokens=len(completion),
            cached_tokens=cached,
            ttft_s=elapsed_s,
        )


def _hermes_text(calls: Sequence[ToolCall]) -> str:
    blocks = []
    for call in calls:
        arguments: Any
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            arguments = call.arguments
        body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks)


def _common_prefix_len(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
