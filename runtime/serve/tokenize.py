"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` answers (models: ``protocol``).

``/tokenize`` takes either ``prompt`` (text, tokenized as ``/v1/completions`` does) or
``messages`` (+ ``tools``, rendered through the chat template as ``/v1/chat/completions`` does),
so ``count`` equals the ``prompt_tokens`` the same body would be billed. Responses follow vLLM:
``{"count", "max_model_len", "tokens", "token_strs"}`` and ``{"prompt"}``. It knows the
engine's tokenizer and template, not HTTP or tenants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime.serve.api_error import ApiError
from runtime.serve.protocol import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from runtime.serve.engine_protocol import ServingEngine

__all__ = ["detokenize_body", "tokenize_body", "tokenizer_info_body"]


def tokenize_body(engine: ServingEngine, req: TokenizeRequest) -> dict[str, Any]:
    """The ``/tokenize`` answer (blocking: run it in a worker thread).

    Raises:
        ApiError: 400 when the chat template rejects the messages.
    """
    tokenizer = engine.tokenizer
    if req.prompt is not None:
        if req.add_special_tokens is False:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=False))
        else:
            ids = engine.tokenize(req.prompt)
    else:
        messages = [message.to_template() for message in req.messages or []]
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
        try:
            ids = engine.render_chat(
                messages, tools=tools, add_generation_prompt=req.add_generation_prompt
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_messages") from exc
    strs = list(tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": engine.max_context_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize_body(engine: ServingEngine, req: DetokenizeRequest) -> dict[str, Any]:
    """The ``/detokenize`` answer: ``{"prompt": text}`` (special tokens kept, as vLLM).

    Raises:
        ApiError: 400 for an id outside the vocabulary.
    """
    vocab_size = len(engine.tokenizer)
    if any(not 0 <= tok < vocab_size for tok in req.tokens):
        raise ApiError(
            400, f"token ids must be in [0, {vocab_size})", param="tokens", code="invalid_value"
        )
    return {"prompt": engine.tokenizer.decode(req.tokens)}


def tokenizer_info_body(engine: ServingEngine) -> dict[str, Any]:
    """The ``/tokenizer_info`` answer: special tokens and the chat template, as vLLM serves them.

    Clients such as lm-evaluation-harness read it (with ``/tokenize`` and ``/detokenize``) to
    tokenize through the server instead of loading the tokenizer themselves.
    """
    tokenizer = engine.tokenizer
    specials = ("eos_token", "bos_token", "pad_token", "unk_token")
    info: dict[str, Any] = {name: getattr(tokenizer, name, None) for name in specials}
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    info["model_max_length"] = engine.max_context_len
    return info
