"""Turn a validated OpenAI request into a ``RequestPlan``: prompt, sampling params, namespace.

Renders chat messages and tools through the model's chat template (in a worker thread), fits
``max_tokens`` to the context window and picks the tool-call parser. The prompt itself (empty,
token ids, length) is validated once, by the engine; the app maps its errors to 400. It knows
the engine only as a ``ServingEngine``; it never streams, answers HTTP or touches the cache.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from anyio.to_thread import run_sync
from jinja2 import TemplateError

from runtime.chunks.spans import DEFAULT_RECOMPUTE_FRACTION, ChunkReuse
from runtime.exceptions import ChunkReuseError, InvalidRequestError
from runtime.request.spec import RequestSpec
from runtime.sampling.grammar import Grammar
from runtime.sampling.params import SamplingParams
from runtime.serve.api_error import ApiError
from runtime.serve.constraints import grammar_spec
from runtime.serve.logprobs import TokenTexts
from runtime.serve.protocol import ChatCompletionRequest, CompletionRequest
from runtime.serve.tool_parser import ToolCallParser, detect_tool_parser

if TYPE_CHECKING:
    from runtime.serve.engine_protocol import ServingEngine

__all__ = ["RequestPlan", "chat_plan", "completion_plan"]


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Everything needed to run and answer one request (read-only: outcomes are returned)."""

    kind: Literal["chat", "completion"]
    id: str
    created: int
    """Unix seconds (the ``created`` field)."""
    model: str
    prompts: list[list[int]]
    """Token ids of each prompt (one for chat; a batch on ``/v1/completions``)."""
    params: SamplingParams
    n: int
    """Choices per prompt; choice ``j`` of prompt ``i`` has ``index = i * n + j`` (OpenAI)."""
    cache_salt: str | None
    """The engine namespace derived from the API key and the client's ``cache_salt``."""
    stream: bool
    include_usage: bool
    parser: ToolCallParser | None
    """Set when the request has tools, tool_choice is not "none" and the template has a format."""
    prompt_param: str
    """Request field blamed for an over-long prompt (``messages`` or ``prompt``)."""
    token_text: TokenTexts | None = None
    """How the response writes token ids, set when the request asked for logprobs."""
    echo_texts: list[str | None] | None = None
    """Each prompt's text to return before its choices' completions (``echo``), else None."""
    is_output_dropped: bool = False
    """``max_tokens=0`` with ``echo``: one token is generated (the engine's minimum), not sent."""
    grammar: Grammar | None = None
    """The compiled constraint every choice decodes under (``response_format``, tools)."""
    chunk_reuse: ChunkReuse | None = None
    """The prompt's document spans whose KV comes from the chunk store (one prompt only)."""

    def engine_requests(self) -> list[RequestSpec]:
        """The engine's record of each prompt (``ServingEngine.submit``), prompt-major.

        Raises:
            InvalidRequestError: never for a plan built here (its fields were validated with
                the HTTP body); ``RequestSpec`` states the rule.
        """
        return [
            RequestSpec(ids, self.params, self.n, self.cache_salt, self.grammar, self.chunk_reuse)
            for ids in self.prompts
        ]


def _new_plan(
    kind: Literal["chat", "completion"],
    req: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    params: SamplingParams,
    cache_salt: str | None,
    parser: ToolCallParser | None,
    engine: ServingEngine,
) -> RequestPlan:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    tokenizer = engine.tokenizer
    return RequestPlan(
        kind=kind,
        id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=req.model,
        prompts=prompts,
        params=params,
        n=req.n,
        cache_salt=cache_salt,
        stream=req.stream,
        include_usage=req.include_usage,
        parser=parser,
        prompt_param="messages" if kind == "chat" else "prompt",
        token_text=None if params.logprobs is None else _token_texts(tokenizer),
        chunk_reuse=_chunk_reuse(req, prompts),
    )


def _token_texts(tokenizer: Any) -> TokenTexts:
    """Token texts as the response's text shows them: the echoed prompt keeps special tokens;
    the completion's text is decoded without them (the engine's detokenizer), so is each
    generated token (an end-of-text token is then ``""``)."""
    return TokenTexts(
        prompt=lambda t: str(tokenizer.decode([t])),
        output=lambda t: str(tokenizer.decode([t], skip_special_tokens=True)),
    )


def _chunk_reuse(
    req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]]
) -> ChunkReuse | None:
    """The engine's ``ChunkReuse`` of ``req.chunk_reuse`` (None when absent).

    Raises:
        ApiError: 400 naming ``chunk_reuse`` for spans that are unsorted, overlapping or past
            the prompt, or for a batch of prompts.
    """
    spec = req.chunk_reuse
    if spec is None:
        return None
    try:
        if len(prompts) != 1:
            raise ChunkReuseError("chunk_reuse applies to one prompt; send one per request")
        spans = tuple((s, e) for s, e in spec.spans)
        fraction = spec.recompute_fraction
        plan = ChunkReuse(
            spans, spec.mode, DEFAULT_RECOMPUTE_FRACTION if fraction is None else fraction
        )
        plan.check(len(prompts[0]))
    except ChunkReuseError as exc:
        raise ApiError(400, str(exc), param="chunk_reuse", code="invalid_value") from exc
    return plan


def sampling_params(
    engine: ServingEngine,
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    prompt_len: int | None,
    default_max_tokens: int,
) -> SamplingParams:
    """Sampling parameters with OpenAI defaults (temperature 1, top_p 1).

    Raises:
        ApiError: 400 when prompt + ``max_tokens`` exceed the context, or a value is invalid.
    """
    limit = engine.max_context_len
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, limit - (prompt_len or 0)))
    elif prompt_len is not None and prompt_len < limit and prompt_len + max_tokens > limit:
        # NOTE: a prompt that alone fills the context is the engine's to refuse (blamed on it).
        raise ApiError(
            400,
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {limit} tokens; lower max_tokens or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    _check_token_ids(engine, "logit_bias", list(req.logit_bias_ids()))
    _check_token_ids(engine, "stop_token_ids", req.stop_token_ids or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias_ids(),
            min_tokens=req.min_tokens or 0,
            ignore_eos=bool(req.ignore_eos),
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            logprobs=req.num_logprobs(),
            prompt_logprobs=req.num_prompt_logprobs(),
        )
    except InvalidRequestError as exc:
        # NOTE: SamplingParams' messages start with the field they refuse ("stop must be ...").
        first = str(exc).split(" ", 1)[0]
        param = first if first in type(req).model_fields else None
        if param is None and "min_tokens" in str(exc):
            param = "min_tokens"
        raise ApiError(400, str(exc), param=param, code="invalid_value") from exc


def _check_token_ids(engine: ServingEngine, param: str, ids: list[int]) -> None:
    vocab_size = engine.vocab_size  # NOTE: the engine's one vocabulary size (embedding rows)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            400,
            f"{param} has token ids {bad[:5]!r} outside the vocabulary [0, {vocab_size})",
            param=param,
            code="invalid_value",
        )


def _tool_parser(engine: ServingEngine, req: ChatCompletionRequest) -> ToolCallParser | None:
    names = {tool.function.name for tool in req.tools or []}
    if len(names) != len(req.tools or []):
        raise ApiError(400, "tool names must be unique", param="tools", code="invalid_value")
    chosen = req.named_tool_choice()  # NOTE: tool_choice without tools is refused by the model
    if chosen is not None and chosen not in names:
        raise ApiError(
            400,
            f"tool_choice names {chosen!r}, which is not in tools {sorted(names)!r}",
            param="tool_choice",
            code="invalid_value",
        )
    if not names or req.tool_choice == "none":
        return None
    return _template_parser(engine)


def _template_parser(engine: ServingEngine) -> ToolCallParser | None:
    return detect_tool_parser(getattr(engine.tokenizer, "chat_template", None))


async def _chat_grammar(engine: ServingEngine, req: ChatCompletionRequest) -> Grammar | None:
    """Compile (worker thread) the grammar of ``response_format`` / ``tool_choice``, if any.

    Raises:
        ApiError: 400 when it cannot be enforced or its schema is invalid.
    """
    spec = grammar_spec(req, has_tool_format=_template_parser(engine) is not None)
    if spec is None:
        return None
    try:
        return await run_sync(engine.compile_grammar, spec)
    except InvalidRequestError as exc:
        # NOTE: the message starts with the spec kind (``json_schema: ...``), a response_format key
        param = "response_format" if req.response_format is not None else "tools"
        message = f"response_format.{exc}" if param == "response_format" else f"tools: {exc}"
        raise ApiError(400, message, param=param, code="invalid_value") from exc


async def chat_plan(
    engine: ServingEngine,
    req: ChatCompletionRequest,
    cache_salt: str | None,
    *,
    default_max_tokens: int,
) -> RequestPlan:
    """Render the chat through the template and plan it.

    NOTE: tools stay in the prompt even with ``tool_choice="none"`` (masking, not removing,
    keeps the prefix cacheable); the tool-call grammar forbids calls there, and enforces
    "required", named choices and ``parallel_tool_calls=false`` during decoding.

    Raises:
        ApiError: 400 for messages the template rejects, prompt + ``max_tokens`` past the
            context, or bad tools (an over-long prompt is the engine's to refuse).
    """
    parser = _tool_parser(engine, req)
    grammar = await _chat_grammar(engine, req)
    messages = [message.to_template() for message in req.messages]
    render = partial(engine.render_chat, messages, tools=req.tools_for_template())
    try:
        ids = await run_sync(render)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        # NOTE: the engine's InvalidRequestError already says what failed; say it once.
        prefix = "" if isinstance(exc, InvalidRequestError) else "chat template failed: "
        raise ApiError(400, f"{prefix}{exc}", param="messages", code="invalid_messages") from exc
    params = sampling_params(
        engine,
        req,
        max_tokens=req.effective_max_tokens(),
        prompt_len=len(ids),
        default_max_tokens=default_max_tokens,
    )
    plan = _new_plan("chat", req, [ids], params, cache_salt, parser, engine)
    return replace(plan, grammar=grammar)


async def completion_plan(
    engine: ServingEngine,
    req: CompletionRequest,
    cache_salt: str | None,
    *,
    default_max_tokens: int,
) -> RequestPlan:
    """Plan a completion of one prompt or a batch; text prompts are tokenized here (worker
    thread) and measured like chat. Every prompt of a batch shares the sampling parameters.

    Raises:
        ApiError: 400 for prompt + ``max_tokens`` past the context (an empty, out-of-vocabulary
            or over-long prompt is refused by the engine when the call opens).
    """
    values = req.prompt_values()
    prompts = [
        await run_sync(engine.tokenize, value) if isinstance(value, str) else value
        for value in values
    ]
    longest = max(len(ids) for ids in prompts)
    params = sampling_params(
        engine,
        req,
        max_tokens=req.max_tokens or (1 if req.max_tokens == 0 else None),
        prompt_len=longest,
        default_max_tokens=default_max_tokens,
    )
    plan = _new_plan("completion", req, prompts, params, cache_salt, None, engine)
    if not req.echo:
        return plan
    texts = [
        await _echo_text(engine, value, ids) for value, ids in zip(values, prompts, strict=True)
    ]
    return replace(plan, is_output_dropped=req.max_tokens == 0, echo_texts=texts)


async def _echo_text(engine: ServingEngine, value: str | list[int], ids: list[int]) -> str | None:
    """The text ``echo`` returns for one prompt (None for ids the engine will refuse)."""
    if isinstance(value, str):
        return value
    if all(0 <= t < engine.vocab_size for t in ids):
        return str(await run_sync(partial(engine.tokenizer.decode, ids)))
    return None  # NOTE: the engine refuses these ids when the call opens (400)
