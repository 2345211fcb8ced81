"""OpenAI ``logprobs`` objects from the engine's ``TokenLogprob`` records (chat and completions).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``; completions (the
legacy shape lm-evaluation-harness reads): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``. Values are of the raw model distribution, as the engine reports them. It knows
the wire shapes and a token-to-text function; it never sees tensors or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runtime.outputs import TokenLogprob

__all__ = ["MIN_LOGPROB", "CompletionLogprobs", "TokenText", "chat_logprobs"]

MIN_LOGPROB = -9999.0
"""Stand-in for ``-inf`` (JSON has no infinity); the value OpenAI and vLLM send."""

TokenText = Callable[[int], str]
"""Text of one token id (special tokens included), as the tokenizer decodes it alone."""


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _chat_entry(token_id: int, logprob: float, text: TokenText) -> dict[str, Any]:
    token = text(token_id)
    return {
        "token": token,
        "logprob": _finite(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion (or chunk) for ``entries``."""
    content = []
    for entry in entries:
        item = _chat_entry(entry.token_id, entry.logprob, text)
        item["top_logprobs"] = [_chat_entry(t, lp, text) for t, lp in entry.top]
        content.append(item)
    return {"content": content}


class CompletionLogprobs:
    """The legacy completions shape, built chunk by chunk so ``text_offset`` keeps counting.

    Args:
        text: token id -> text.
        offset: ``text_offset`` of the first token (0 for the first chunk of a choice).
    """

    def __init__(self, text: TokenText, offset: int = 0) -> None:
        self._text = text
        self._offset = offset

    def build(self, entries: Sequence[TokenLogprob | None], ids: Sequence[int]) -> dict[str, Any]:
        """The object for tokens ``ids`` (``entries[i]`` None: no logprob, the first prompt
        token under ``echo``), advancing the offset past them."""
        tokens = [self._text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
            "top_logprobs": [None if e is None else self._top(e) for e in entries],
            "text_offset": offsets,
        }

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        # NOTE: keyed by token text (OpenAI's shape); two ids with one text keep the likelier.
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:
            top.setdefault(self._text(token_id), _finite(logprob))
        return top
