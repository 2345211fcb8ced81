"""Parts of the OpenAI request bodies: chat messages, tools, tool choice, response formats,
stream options and our ``chunk_reuse`` extension (pydantic models with their own 400 rules).

``runtime.serve.protocol`` builds the request models from these. It knows field names and
shapes only, never the engine or HTTP routing.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_SPANS = 1024
"""Most document spans in one request's ``chunk_reuse``."""

__all__ = [
    "MAX_SPANS",
    "CalledFunction",
    "ChatMessage",
    "ChunkReuseSpec",
    "FunctionName",
    "FunctionSpec",
    "JsonSchemaFormat",
    "Lenient",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "ToolCall",
    "ToolSpec",
]

# Function names as OpenAI accepts them (a-z, A-Z, 0-9, underscores and dashes, max 64).
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Lenient(BaseModel):
    """A request body or part: unknown fields ignored, strict types."""

    # NOTE: clients send fields we do not use (user, metadata, prompt_cache_key, ...): ignore them.
    # Strict: OpenAI rejects "10" or true for an integer and "yes" for a boolean; so do we.
    model_config = ConfigDict(extra="ignore", strict=True)


class _Options(BaseModel):
    """An options object: unknown fields refused, strict types."""

    # NOTE: objects that set request options (stream_options, response_format, tool_choice) are
    # written by the client, never echoed back, so an unknown field is a 400 naming it: vLLM's
    # stream_options.continuous_usage_stats or a misplaced response_format.schema was dropped.
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionSpec(Lenient):
    """``tools[i].function``: a callable the model may name."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _FUNCTION_NAME.match(value):
            raise ValueError(f"function name {value!r} must match ^[A-Za-z0-9_-]{{1,64}}$")
        return value

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON Schema with type 'object'")
        props = (value or {}).get("properties", {})
        if not isinstance(props, dict):
            raise ValueError("parameters.properties must be an object")
        return value


class ToolSpec(Lenient):
    """One entry of ``tools``: only ``{"type": "function", "function": {...}}`` exists."""

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Options):
    """``tool_choice.function``: ``{"name": ...}``."""

    name: str


class NamedToolChoice(_Options):
    """``tool_choice`` that forces one function: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Options):
    """``response_format.json_schema``: ``{"name", "schema", "strict", "description"}``."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(default_factory=dict)
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Options):
    """``response_format``: ``text``, ``json_object`` or ``json_schema`` (enforced by a grammar)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "response_format.json_schema is required with type 'json_schema' (and only then)"
            )
        return self


class CalledFunction(Lenient):
    """``tool_calls[i].function`` of an assistant message sent back: the function and its
    arguments, a JSON string as OpenAI writes them (or an object, as chat templates also take)."""

    name: str
    arguments: str | dict[str, Any]


class ToolCall(Lenient):
    """One call of an assistant message sent back (OpenAI's ``tool_calls`` entry)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Lenient):
    """One chat message; ``content`` may be a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)
    """The call a ``tool`` message answers: required on that role (as OpenAI requires it)."""

    @field_validator("content")
    @classmethod
    def _only_text_parts(
        cls, value: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            if not value:  # NOTE: OpenAI refuses an empty parts list (minimum length 1)
                raise ValueError("content parts list is empty; send at least one text part")
            for part in value:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_on_tool(cls, value: str | None, info: ValidationInfo) -> str | None:
        # NOTE: validated here, not in a model validator, so the 400 names
        # messages[i].tool_call_id; role is declared first, so info.data holds it.
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return value

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # NOTE: OpenAI requires content on every role but assistant (which may carry only
        # tool_calls); rendering a missing user message as "" would hide the client's bug.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined, developer=system)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(_Options):
    """``stream_options``: ``include_usage`` adds a last chunk with usage and no choices."""

    include_usage: bool = False
    include_obfuscation: Literal[False] | None = None
    """OpenAI's random padding of stream events: this server sends none, so only ``false``."""


_Span = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=2, max_length=2)]


class ChunkReuseSpec(BaseModel):
    """``chunk_reuse`` (this server's extension): reuse documents' KV in any order.

    ``spans`` are ``[start, end)`` token index pairs of the prompt's token ids (as ``/tokenize``
    returns them for chat messages), sorted and disjoint, ending before the last prompt token.
    See ``runtime.chunks.assembler`` for the modes; ``usage.chunk_reuse`` reports what was reused.
    """

    # NOTE: only clients that know this extension send it: an unknown sub-field is a 400.
    model_config = ConfigDict(extra="forbid", strict=True)
    spans: Annotated[list[_Span], Field(min_length=1, max_length=MAX_SPANS)]
    mode: Literal["exact", "blend"] = "exact"
    recompute_fraction: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    """Blend only (default 0.15); with ``mode: "exact"`` it is a 400, never silently unused."""

    @model_validator(mode="after")
    def _fraction_is_blends(self) -> ChunkReuseSpec:
        if self.recompute_fraction is not None and self.mode != "blend":
            raise ValueError(
                f"recompute_fraction applies to mode 'blend' only (mode is {self.mode!r}); "
                "drop it or send mode 'blend'"
            )
        return self
