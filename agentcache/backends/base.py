"""The backend contract: one interface for the local engine, OpenAI-compatible and Anthropic APIs.

A backend turns a built prompt into a streamed completion plus one honest ``Usage`` record. It knows
nothing about agents, tools' Python functions or retrieval: tool calls come back as data
(``ToolCall``) or, for local chat templates, as text the agent loop parses.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, NamedTuple, Protocol, Self, TypeAlias, runtime_checkable

from agentcache.exceptions import PromptTypeError
from agentcache.usage import Usage

__all__ = [
    "BaseBackend",
    "Capabilities",
    "GenerationOptions",
    "ModelResponse",
    "PromptInput",
    "PromptLike",
    "StreamEvent",
    "ToolCall",
    "ToolCallFormat",
    "ToolChoice",
    "as_prompt",
]

ToolChoice = Literal["auto", "required", "none"]
"""Whether a model call may (``auto``), must (``required``) or must not (``none``) call tools."""

ToolCallFormat = Literal["native", "hermes"]
"""How tool calls come back: ``native`` (structured ``tool_calls`` in the API response) or
``hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` inside the generated text,
the format of Hermes/Qwen ChatML chat templates)."""


@runtime_checkable
class PromptLike(Protocol):
    """What a backend needs from a built prompt (``agentcache.prompt.Prompt`` satisfies it)."""

    def to_messages(self) -> list[dict[str, Any]]:
        """OpenAI-style chat messages, system first, in canonical form."""
        ...

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas (``{"type": "function", "function": {...}}``), in stable order."""
        ...

    def to_openai(self, *, model: str, **params: Any) -> dict[str, Any]:
        """A Chat Completions request body."""
        ...

    def to_anthropic(self, *, model: str, **params: Any) -> dict[str, Any]:
        """A Messages API request body with ``cache_control`` breakpoints planned."""
        ...


PromptInput: TypeAlias = PromptLike | str | Sequence[Mapping[str, Any]]
"""What ``stream``/``complete`` accept: a built prompt, plain user text, or chat messages."""


def as_prompt(value: PromptInput) -> PromptLike:
    """A built prompt for ``value``: built prompts pass through, text becomes the user turn.

    A list of OpenAI-style chat messages becomes system text (a leading ``system`` message with
    string content) plus history.

    Raises:
        PromptTypeError: ``value`` is none of the accepted kinds (the message lists them).
        PromptError: a message has no valid role.
    """
    if isinstance(value, PromptLike):
        return value
    from agentcache.prompt import PromptBuilder  # NOTE: lazy; prompt never imports backends.

    if isinstance(value, str):
        return PromptBuilder().user(value).build()
    items: list[object] = list(value) if isinstance(value, Sequence) else [None]
    if all(isinstance(m, Mapping) for m in items):
        messages = [m for m in items if isinstance(m, Mapping)]
        builder = PromptBuilder()
        if messages and messages[0].get("role") == "system":
            content = messages[0].get("content")
            if isinstance(content, str):
                builder.system(content)
                messages = messages[1:]
        return builder.history(messages).build()
    raise PromptTypeError(
        f"a backend takes a built Prompt (PromptBuilder().build()), a str or a list of chat "
        f"message dicts; got {type(value).__name__}"
    )


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call requested by the model.

    ``arguments`` is the raw JSON text the model produced; it may be malformed, which the agent
    loop reports back to the model instead of crashing.
    """

    id: str
    """Call id (the provider's, or a deterministic one the backend assigned)."""
    name: str
    """Tool (function) name."""
    arguments: str
    """Arguments as JSON text, exactly as produced."""

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI assistant ``tool_calls`` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def parsed_arguments(self) -> dict[str, Any]:
        """Decode ``arguments``.

        Raises:
            ValueError: The text is not a JSON object (``json.JSONDecodeError`` is a ValueError).
        """
        value = json.loads(self.arguments) if self.arguments.strip() else {}
        if not isinstance(value, dict):
            raise ValueError(f"tool arguments must be a JSON object, got {type(value).__name__}")
        return value


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """Sampling options shared by every backend."""

    max_tokens: int = 256
    """Upper bound on generated tokens."""
    temperature: float = 0.0
    """0 means greedy (deterministic on the local engine)."""
    stop: tuple[str, ...] = ()
    """Extra stop strings."""
    tool_choice: ToolChoice = "auto"
    """With tools in the prompt: ``"auto"`` (text or calls), ``"required"`` (one or more tool
    calls, no text) or ``"none"`` (text only). Sent as OpenAI's ``tool_choice`` / Anthropic's
    ``{"type": "any"|"none"}``; the local backend enforces it with a grammar (tool-call JSON
    that follows the tools' schemas). Ignored when the prompt has no tools."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.tool_choice not in ("auto", "required", "none"):
            raise ValueError(
                f"tool_choice must be 'auto', 'required' or 'none', got {self.tool_choice!r}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass(frozen=True, slots=True)
class ModelResponse:
    """The result of one backend call."""

    text: str
    """Generated text (for ``hermes`` backends this still contains any ``<tool_call>`` markup)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Native tool calls (always empty for ``hermes`` backends: the agent parses ``text``)."""
    finish_reason: str | None = None
    """``stop``, ``length``, ``tool_calls``... as reported; ``None`` if unknown."""
    usage: Usage = field(default_factory=Usage)
    """Tokens, cached tokens and timing of this call."""
    cost_usd: float | None = None
    """Estimated price in US dollars from the price table; 0.0 for local; ``None`` if unknown."""
    model: str = ""
    """Model name as reported by the backend."""


class StreamEvent(NamedTuple):
    """One streamed piece: a text delta, and on the last event the complete response."""

    text: str
    response: ModelResponse | None = None


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do; the agent and demo adapt to it."""

    supports_prefix_cache: bool
    """Repeated prompt prefixes are served from a KV/prompt cache."""
    reports_cached_tokens: bool
    """``Usage.cached_tokens`` is filled in (otherwise it stays ``None``)."""
    tool_call_format: ToolCallFormat = "native"
    """How tool calls come back (see ``ToolCallFormat``)."""
    is_local: bool = False
    """Runs in this process (no network)."""


class BaseBackend(ABC):
    """A model endpoint that streams completions for built prompts.

    Contract for implementations:

    - ``stream`` yields zero or more ``StreamEvent`` with text deltas and exactly one final event
      whose ``response`` is set; the concatenated deltas equal ``response.text``.
    - Usage is honest: counts the backend does not know stay ``None``; ``ttft_s`` is measured
      from the call to the first generated text or tool-call delta.
    - Errors: ``BackendHTTPError`` (status + message) for HTTP errors left after bounded retries,
      ``BackendUnavailableError`` when a dependency, model or endpoint is missing,
      ``BackendError`` for anything else the backend detects. Never a bare library exception.
    - Backends may keep state between calls (the local backend carries token ids forward); they
      are not safe for concurrent calls from several threads unless documented.
    """

    name: str = "base"
    """Registry name of the backend kind."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports."""

    @property
    @abstractmethod
    def model(self) -> str:
        """Model name or path requests are sent to."""

    @abstractmethod
    def stream(
        self, prompt: PromptInput, options: GenerationOptions | None = None
    ) -> Iterator[StreamEvent]:
        """Stream a completion for ``prompt``.

        Implementations start with ``prompt = as_prompt(prompt)``.

        Args:
            prompt: A built prompt (messages + tool schemas), plain user text, or a list of
                chat message dicts (see ``as_prompt``).
            options: Sampling options; defaults to ``GenerationOptions()``.

        Yields:
            Text deltas, then one final event carrying the ``ModelResponse``.

        Raises:
            BackendHTTPError: A remote endpoint answered 4xx, or 429/5xx after all retries.
            BackendUnavailableError: The endpoint cannot be reached or a dependency is missing.
            BackendError: Any other failure detected by the backend.
            PromptTypeError: ``prompt`` is not one of the accepted kinds.
        """

    def complete(
        self, prompt: PromptInput, options: GenerationOptions | None = None
    ) -> ModelResponse:
        """Run ``stream`` to the end and return the final response (same errors as ``stream``)."""
        final: ModelResponse | None = None
        for event in self.stream(prompt, options):
            if event.response is not None:
                final = event.response
        assert final is not None, f"{type(self).__name__}.stream ended without a final response"
        return final

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections or models held by the backend; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
