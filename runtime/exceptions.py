"""Exception tree of the local runtime (package ``runtime``); it never imports agentcache.

RuntimeEngineError
├── InvalidRequestError (ValueError)   bad prompt or sampling params; engine keeps serving
│   ├── PromptTooLongError             prompt + max_tokens exceed the model's context
│   ├── TooManyChoicesError            the n choices of a request can never run together
│   └── ChunkReuseError                bad chunk spans, or a model that cannot reuse chunk KV
├── SamplingError                      one request's logits could not be sampled; it ends alone
├── ModelLoadError                     a model, tokenizer or chat template could not be loaded
└── EngineBusyError                    the request queue is full; retry later
"""

from __future__ import annotations

__all__ = [
    "ChunkReuseError",
    "EngineBusyError",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptTooLongError",
    "RuntimeEngineError",
    "SamplingError",
    "TooManyChoicesError",
    "one_line",
]


class RuntimeEngineError(Exception):
    """Root of every error raised on purpose by the runtime."""


class InvalidRequestError(RuntimeEngineError, ValueError):
    """A request's prompt or sampling parameters are invalid."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context window."""


class TooManyChoicesError(InvalidRequestError):
    """A request's ``n`` choices, decoded together, can never run at once: more than the rows
    decoded at once, or KV rows over the batch's budget where one choice alone fits."""


class ChunkReuseError(InvalidRequestError):
    """A request's chunk reuse cannot be honoured: its spans do not fit the prompt, or the model's
    position scheme cannot move stored keys (the message names the reason)."""


class SamplingError(RuntimeEngineError):
    """One request's logits could not be sampled (non-finite logits, every token masked, or a
    logits processor failed); that request ends with this error, the batch goes on."""


class ModelLoadError(RuntimeEngineError):
    """A model, tokenizer or chat template could not be loaded."""


class EngineBusyError(RuntimeEngineError):
    """The engine's bounded request queue is full."""


def one_line(exc: BaseException) -> str:
    """``exc``'s message with its line breaks and runs of spaces folded, for a one-line report
    (transformers' loading messages span several lines), or its type's name when it has none."""
    return " ".join(str(exc).split()) or type(exc).__name__
