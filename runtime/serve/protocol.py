"""OpenAI wire format for the server: the request models and their 400s.

Validates ``/v1/chat/completions``, ``/v1/completions`` and vLLM's ``/tokenize`` bodies
(pydantic); errors are ``api_error``'s, response bodies ``streams``'. It knows field names and
shapes only; it never calls the engine, and it does not know HTTP routing or tenants.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    model_validator,
)

from runtime.sampling.params import LOGIT_BIAS_MAX, MAX_LOGPROBS, PENALTY_MAX, SEED_MAX, SEED_MIN
from runtime.serve import api_error
from runtime.serve.api_error import ApiError
from runtime.serve.messages import (
    MAX_SPANS,
    ChatMessage,
    ChunkReuseSpec,
    FunctionName,
    FunctionSpec,
    JsonSchemaFormat,
    Lenient,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    ToolSpec,
)

__all__ = [
    "CacheResetRequest",
    "ChatCompletionRequest",
    "ChunkReuseSpec",
    "MAX_SPANS",
    "MAX_N",
    "MAX_PROMPTS",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TokenizeRequest",
    "ToolSpec",
    "NO_OP_PARAMS",
    "UNSUPPORTED_COMPLETION_PARAMS",
    "UNSUPPORTED_PARAMS",
    "validation_error",
]

UNSUPPORTED_PARAMS: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "typical_p": (None, 1, 1.0),
    "functions": (None,),
    "function_call": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
"""OpenAI and vLLM request fields this server does not honour, with the values that mean "off".

Any other value is refused with a 400 naming the field (never silently ignored); ``best_of``
equal to ``n`` is also accepted (it then means nothing more than ``n``). The fields of
``NO_OP_PARAMS`` are accepted and change nothing; any other top-level field is a 400 naming it
(a misspelt ``temprature`` must not be dropped in silence)."""
UNSUPPORTED_COMPLETION_PARAMS: dict[str, tuple[object, ...]] = {"suffix": (None,)}
"""``UNSUPPORTED_PARAMS`` of ``/v1/completions`` only (in a chat body they are unknown fields)."""
NO_OP_PARAMS = ("user", "metadata", "store", "prompt_cache_key", "safety_identifier")
"""OpenAI request fields that are bookkeeping for the provider (end-user id, tags, storing the
completion, prompt-cache routing key) and change nothing about generation: accepted (type-checked)
and otherwise unused."""
MAX_N = 128
"""Largest ``n`` accepted (OpenAI's limit); the engine may refuse fewer (its batch rows)."""
MAX_PROMPTS = 256
"""Most prompts in one batched ``/v1/completions`` request."""


def _null_means(default: bool | int, schema: Any) -> BeforeValidator:
    """Read JSON ``null`` as ``default``: for fields OpenAI documents as nullable whose unset
    value is not None here (``null`` means "unset" for every ``... | None`` field too).

    Args:
        default: the field's default.
        schema: the field's type, for the JSON schema (which then also allows ``null``).
    """

    def read(value: object) -> object:
        return default if value is None else value

    return BeforeValidator(read, json_schema_input_type=schema | None)


_N = Annotated[StrictInt, Field(ge=1, le=MAX_N)]


_Penalty = Annotated[float, Field(ge=-PENALTY_MAX, le=PENALTY_MAX)]
_Bias = Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]


class _SamplingFields(Lenient):
    # NOTE: top level only: an unknown field is a 400 naming it (nested objects such as messages
    # stay lenient, as clients echo back assistant messages with fields like ``refusal``).
    # Python's JSON reader takes NaN and Infinity: allow_inf_nan=False says "finite number"
    # rather than a range error (NaN fails every comparison: "less than or equal to 2").
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    unsupported: ClassVar[dict[str, tuple[object, ...]]] = UNSUPPORTED_PARAMS
    """Fields refused unless "off", with their off values (the endpoint's)."""
    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    """vLLM/HF repetition penalty (1 = off); over 10 is refused as surely a mistake."""
    logit_bias: dict[str, _Bias] | None = None
    """Token id (as a string, OpenAI's JSON shape) -> bias in [-100, 100]."""
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    """Signed 64-bit, as OpenAI documents; negative seeds are used two's-complement."""
    stop: str | list[str] | None = None
    n: Annotated[_N, _null_means(1, _N)] = 1
    """Choices per prompt, from one prefill of the prompt (choice ``i`` seeded ``seed + i``)."""
    stream: Annotated[bool, _null_means(False, bool)] = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Per-tenant prefix-cache namespace (vLLM's field); combined with the API key server-side."""
    chunk_reuse: ChunkReuseSpec | None = None
    """Document spans whose KV comes from the chunk store (opt-in extension; one prompt only)."""
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    """(``user`` .. ``safety_identifier``: ``NO_OP_PARAMS``, accepted and unused.)"""

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400,
                "stream_options is only allowed with stream=true",
                param="stream_options",
                code="invalid_value",
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        """400 naming the first field of ``unsupported`` set to a value that is not off.

        NOTE: raises ``ApiError`` (not ValueError) so pydantic lets it through unchanged.
        """
        if not isinstance(body, dict):
            return body
        body = dict(body)  # NOTE: an "off" value is dropped below, so extra="forbid" passes it
        for name, off in cls.unsupported.items():
            value = body.get(name)
            if name == "best_of" and value is not None and value == body.get("n", 1):
                del body[name]
                continue
            if name in body and not any(value == o and type(value) is type(o) for o in off):
                raise ApiError(
                    400,
                    f"{name}={value!r} is not supported by this server; omit it",
                    param=name,
                    code="unsupported_parameter",
                )
            body.pop(name, None)
        return body

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with integer keys.

        Raises:
            ApiError: 400 for a key that is not a non-negative integer.
        """
        out: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # NOTE: str.isdigit() is true for "²" (int() then raises: a 500) and "٣" (int()
            # reads it as 3); JSON token-id keys are ASCII decimal digits only.
            if not (key.isascii() and key.isdigit()):
                raise ApiError(
                    400,
                    f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                    param="logit_bias",
                    code="invalid_value",
                )
            out[int(key)] = float(value)
        return out

    def stop_list(self) -> list[str]:
        """``stop`` as a list (OpenAI accepts one string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when the client asked for a final usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions`` (the subset this runtime serves)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """False: at most one tool call per choice (enforced by the tool-call grammar)."""
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    """True: each generated token's logprob (raw model distribution) in ``choices[].logprobs``."""
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    """Alternatives per token (needs ``logprobs: true``)."""

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(
                400,
                "top_logprobs needs logprobs=true",
                param="top_logprobs",
                code="invalid_value",
            )
        return self

    @model_validator(mode="after")
    def _tool_options_need_tools(self) -> ChatCompletionRequest:
        # NOTE: OpenAI answers 400 "'tool_choice' is only allowed when 'tools' are specified"
        # (any value, "none" included), and the same for parallel_tool_calls.
        if self.tools:
            return self
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise ApiError(
                    400,
                    f"{name} is only allowed when tools are given; add tools or omit {name}",
                    param=name,
                    code="invalid_value",
                )
        return self

    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: None, or the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> int | None:
        """Chat never returns prompt logprobs."""
        return None

    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (current name) or the legacy ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        """Tools as plain dicts for the chat template, or None."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def named_tool_choice(self) -> str | None:
        """The function name of a ``{"type": "function", "function": {"name": ...}}`` choice."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``: one prompt or a batch, as text or token ids."""

    unsupported: ClassVar[dict[str, tuple[object, ...]]] = {
        **UNSUPPORTED_PARAMS,
        **UNSUPPORTED_COMPLETION_PARAMS,
    }

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    """0 only with ``echo``: score the prompt, generate nothing (lm-evaluation-harness)."""
    echo: Annotated[bool, _null_means(False, bool)] = False
    """Return the prompt before the completion (with ``logprobs``: the prompt's logprobs too)."""
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    """k: each generated token's logprob (raw model distribution) and the k most likely."""

    @model_validator(mode="after")
    def _zero_tokens_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(
                400,
                "max_tokens=0 is only accepted with echo=true (scoring the prompt)",
                param="max_tokens",
                code="invalid_value",
            )
        return self

    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: None, or the alternatives per token."""
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs``: set when echoing with logprobs."""
        return self.logprobs if self.echo else None

    def prompt_values(self) -> list[str | list[int]]:
        """The prompts in order: one text, one token-id list, or a batch of either.

        Raises:
            ApiError: 400 for an empty prompt list or a batch over ``MAX_PROMPTS`` prompts.
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "prompt is an empty list", param="prompt", code="invalid_value")
        if all(isinstance(p, int) for p in prompt):
            return [[p for p in prompt if isinstance(p, int)]]
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(
                400,
                f"batch of {len(prompt)} prompts is over this server's limit of {MAX_PROMPTS}; "
                "split it into several requests",
                param="prompt",
                code="invalid_value",
            )
        values: list[str | list[int]] = []
        for item in prompt:
            assert isinstance(item, str | list), "pydantic let a non-prompt through"
            values.append(
                item if isinstance(item, str) else [p for p in item if isinstance(p, int)]
            )
        return values


class _Strict(BaseModel):
    # NOTE: unlike the completion bodies (which clients fill with fields for other servers),
    # these are only sent by callers that know vLLM's shape: an unknown field is a 400.
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheResetRequest(_Strict):
    """Optional body of a tenant's cache reset (``POST /v1/admin/cache/reset``)."""

    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Reset the namespace of the caller's key with this ``cache_salt`` (None: without one)."""


class TokenizeRequest(_Strict):
    """Body of ``POST /tokenize``: exactly one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolSpec] | None = None
    add_generation_prompt: bool = True
    """Chat only: end with the assistant turn's opening, as a chat completion does."""
    add_special_tokens: bool | None = None
    """Text: default True (BOS etc., as ``/v1/completions``). Chat: only False (the template
    writes the special tokens itself)."""
    continue_final_message: Literal[False] = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError(
                "add_special_tokens must be false with messages (the chat template adds them)"
            )
        if self.prompt is not None and (self.tools is not None or not self.add_generation_prompt):
            raise ValueError("tools and add_generation_prompt only apply to messages")
        return self


class DetokenizeRequest(_Strict):
    """Body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[StrictInt]


_MODELS: tuple[type[BaseModel], ...] = (
    ChunkReuseSpec,
    FunctionSpec,
    ToolSpec,
    FunctionName,
    NamedToolChoice,
    ResponseFormat,
    JsonSchemaFormat,
    ChatMessage,
    StreamOptions,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
)
# Field names of the request models: any other loc part in a pydantic error is a union tag.
_FIELD_NAMES = frozenset(
    field.alias or name for model in _MODELS for name, field in model.model_fields.items()
)


def validation_error(exc: ValidationError) -> ApiError:
    """A pydantic error of one of this module's request models as a 400 naming the field
    (``api_error.validation_error`` with these models' field names)."""
    return api_error.validation_error(exc, _FIELD_NAMES)
