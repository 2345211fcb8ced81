"""Incremental detokenizer with stop strings: turns token ids into final text deltas.

Text that might still become part of a stop string (or an unfinished UTF-8 character) is held
back until it is safe. It knows nothing about the model or the cache.
"""

from __future__ import annotations

from typing import Any

from runtime.holdback import held_back_len

__all__ = ["Detokenizer"]


class Detokenizer:
    """Accumulates generated ids; ``push`` returns the newly final text."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self._text = ""
        self._emitted = 0
        self.is_stopped = False
        """True once a stop string appeared; the text is cut before it."""

    @property
    def text(self) -> str:
        """All text so far (cut at a stop string once one appeared)."""
        return self._text

    def push(self, token_id: int) -> str:
        """Add one token id; return text that became final (possibly empty)."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        self._text = text
        cut = self._find_stop(text)
        if cut is not None:
            self._text, self.is_stopped = text[:cut], True
            return self._take(cut)
        return self._take(len(text) - held_back_len(text, self._stop))

    def flush(self) -> str:
        """Release held-back text at the end of generation."""
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta, self._emitted = self._text[self._emitted : end], end
        return delta

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
