"""OpenAI ``logprobs`` objects from the engine's ``TokenLogprob`` records (chat and completions).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``; completions (the
legacy shape lm-evaluation-harness reads): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``. Values are of the raw model distribution, as the engine reports them. Each
token is written as the response's text writes it, so the tokens spell that text: echoed prompt
tokens with their special tokens (the echoed prompt keeps them), generated ones without (the
completion's text skips them, so an end-of-text token is ``""``; vLLM's detokenizer writes
logprob tokens with the request's ``skip_special_tokens`` too). It knows the wire shapes and
token-to-text functions; it never sees tensors or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from runtime.outputs import TokenLogprob

__all__ = [
    "MIN_LOGPROB",
    "CompletionLogprobs",
    "LoggedToken",
    "TokenText",
    "TokenTexts",
    "chat_logprobs",
]

MIN_LOGPROB = -9999.0
"""Stand-in for ``-inf`` (JSON has no infinity); the value OpenAI and vLLM send."""

TokenText = Callable[[int], str]
"""Text of one token id, as the tokenizer decodes it alone."""


class TokenTexts(NamedTuple):
    """How a response writes token ids: its prompt's (``echo``) and its generated ones."""

    prompt: TokenText
    """Special tokens included, as the echoed prompt shows them."""
    output: TokenText
    """Special tokens as ``""``, as the completion's text (decoded without them) shows them."""


class LoggedToken(NamedTuple):
    """One token of a ``logprobs`` object."""

    entry: TokenLogprob | None
    """Its logprob and alternatives; None only for the first prompt token under ``echo``."""
    token_id: int
    text: TokenText
    """How the response writes this token and its alternatives."""


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _chat_entry(token_id: int, logprob: float, text: TokenText) -> dict[str, Any]:
    token = text(token_id)
    return {
        "token": token,
        "logprob": _finite(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(tokens: Sequence[LoggedToken]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion (or chunk) for ``tokens`` (those without an
    entry are left out)."""
    content = []
    for token in tokens:
        entry, text = token.entry, token.text
        if entry is None:
            continue
        item = _chat_entry(entry.token_id, entry.logprob, text)
        item["top_logprobs"] = [_chat_entry(t, lp, text) for t, lp in entry.top]
        content.append(item)
    return {"content": content}


class CompletionLogprobs:
    """The legacy completions shape, built chunk by chunk so ``text_offset`` keeps counting.

    Args:
        offset: ``text_offset`` of the first token (0 for the first chunk of a choice).
    """

    def __init__(self, offset: int = 0) -> None:
        self._offset = offset

    def build(self, tokens: Sequence[LoggedToken]) -> dict[str, Any]:
        """The object for ``tokens`` (an entry None: no logprob, the first prompt token under
        ``echo``), advancing the offset past them."""
        texts = [token.text(token.token_id) for token in tokens]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        entries = [token.entry for token in tokens]
        return {
            "tokens": texts,
            "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
            "top_logprobs": [None if t.entry is None else _top(t.entry, t.text) for t in tokens],
            "text_offset": offsets,
        }


def _top(entry: TokenLogprob, text: TokenText) -> dict[str, float]:
    # NOTE: keyed by token text (OpenAI's shape); two ids with one text keep the likelier.
    top: dict[str, float] = {}
    for token_id, logprob in entry.top:
        top.setdefault(text(token_id), _finite(logprob))
    return top
