"""Token counting: the model's own tokenizer when given, tiktoken for OpenAI models, else a label.

Order of preference: an explicit tokenizer (HF ``PreTrainedTokenizer*`` or ``tiktoken.Encoding``);
tiktoken's encoding for an OpenAI model name when that encoding loads (tiktoken downloads encodings
on first use, so offline this can fail); otherwise ``count_tokens`` raises, and ``token_count``
returns a clearly-labelled estimate. This module knows no prompts and no providers' prices.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple, Protocol

from agentcache.exceptions import BackendUnavailableError

__all__ = [
    "BYTES_PER_TOKEN_ESTIMATE",
    "TokenCount",
    "Tokenizer",
    "TokenizerUnavailableError",
    "count_tokens",
    "estimate_tokens",
    "tiktoken_encoding",
    "token_count",
    "token_ids",
]

BYTES_PER_TOKEN_ESTIMATE = 4
"""UTF-8 bytes per token of the estimate: OpenAI's rule of thumb ("1 token ~= 4 characters of
English", https://help.openai.com/en/articles/4936856). Off by 2x or more for code and non-Latin
scripts; used only where no tokenizer is available, and always labelled."""

_OPENAI_PREFIXES = ("gpt-", "o1", "o3", "o4", "chatgpt-", "text-embedding-", "davinci", "babbage")


class Tokenizer(Protocol):
    """Anything with ``encode(text) -> list[int]`` (HF tokenizers, ``tiktoken.Encoding``)."""

    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> list[int]: ...


class TokenizerUnavailableError(BackendUnavailableError):
    """No exact tokenizer is available for a model (e.g. tiktoken offline, unknown model)."""


class TokenCount(NamedTuple):
    """A token count and how it was obtained."""

    value: int
    method: Literal["tokenizer", "tiktoken", "estimate"]

    @property
    def is_estimate(self) -> bool:
        """True when no tokenizer was used (see ``BYTES_PER_TOKEN_ESTIMATE``)."""
        return self.method == "estimate"


def estimate_tokens(text: str) -> int:
    """Estimated token count: ``ceil(utf8_bytes / BYTES_PER_TOKEN_ESTIMATE)``. Never exact."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_ESTIMATE)


@functools.cache
def tiktoken_encoding(model: str) -> Any | None:
    """tiktoken's encoding for an OpenAI ``model``, or ``None`` when unknown or not loadable.

    Side effect: the first call per model may try to download the encoding file (tiktoken's own
    behaviour); failures are cached for the life of the process.
    """
    if not model.startswith(_OPENAI_PREFIXES):
        return None
    try:
        import tiktoken

        return tiktoken.encoding_for_model(model)
    except Exception:  # NOTE: tiktoken raises KeyError, OSError or requests errors when offline.
        return None


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        import tiktoken

        if isinstance(tokenizer, tiktoken.Encoding):
            return list(tokenizer.encode(text, disallowed_special=()))
    except ImportError:  # pragma: no cover - tiktoken is a core dependency
        pass
    try:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    except TypeError:
        return [int(i) for i in tokenizer.encode(text)]


def token_ids(text: str, *, model: str = "", tokenizer: Any = None) -> list[int] | None:
    """Token ids of ``text`` (no special tokens), or ``None`` when only an estimate is possible.

    Args:
        text: The text to encode.
        model: Model name; OpenAI names select a tiktoken encoding.
        tokenizer: An HF tokenizer or ``tiktoken.Encoding``; wins over ``model``.
    """
    if tokenizer is not None:
        return _encode(tokenizer, text)
    encoding = tiktoken_encoding(model) if model else None
    return None if encoding is None else _encode(encoding, text)


def token_count(text: str, *, model: str = "", tokenizer: Any = None) -> TokenCount:
    """Count tokens exactly when possible, else return a labelled estimate (never raises).

    Args:
        text: The text to count.
        model: Model name; OpenAI names select a tiktoken encoding.
        tokenizer: An HF tokenizer or ``tiktoken.Encoding``; wins over ``model``.
    """
    ids = token_ids(text, model=model, tokenizer=tokenizer)
    if ids is None:
        return TokenCount(estimate_tokens(text), "estimate")
    return TokenCount(len(ids), "tokenizer" if tokenizer is not None else "tiktoken")


def count_tokens(text: str, *, model: str = "", tokenizer: Any = None) -> int:
    """Exact token count of ``text`` with ``tokenizer``, or tiktoken for an OpenAI ``model``.

    Raises:
        TokenizerUnavailableError: no tokenizer was given and no tiktoken encoding loads for
            ``model`` (offline, or not an OpenAI model). Use ``token_count`` for a labelled
            estimate instead.
    """
    result = token_count(text, model=model, tokenizer=tokenizer)
    if result.is_estimate:
        raise TokenizerUnavailableError(
            f"no tokenizer for model {model!r}: pass tokenizer=, or use token_count() for an "
            "estimate (tiktoken encodings need a one-time download)"
        )
    return result.value
