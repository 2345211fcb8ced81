"""OpenAI ``logprobs`` objects from the engine's ``TokenLogprob`` records (chat and completions).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``; completions (the
legacy shape lm-evaluation-harness reads): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``. Values are of the raw model distribution, as the engine reports them. Each
token is written as the response's text writes it, so the tokens spell that text: echoed prompt
tokens with their special tokens (the echoed prompt keeps them), generated ones without (the
completion's text skips them, so an end-of-text token is ``""``; vLLM's detokenizer writes
logprob tokens with the request's ``skip_special_tokens`` too). Generated tokens cover exactly
the text returned: those of a stop string that cut it are left out (``cover_text``,
``HeldTokens``). It knows the wire shapes and token-to-text functions; it never sees tensors or
the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from runtime.outputs import TokenLogprob

__all__ = [
    "MIN_LOGPROB",
    "CompletionLogprobs",
    "HeldTokens",
    "LoggedToken",
    "TokenText",
    "TokenTexts",
    "chat_logprobs",
    "cover_text",
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
    written: str | None = None
    """How the response writes this token when not as ``text(token_id)``: the part of it before
    a stop string that cut it (``cover_text``); None otherwise."""

    def shown(self) -> str:
        """This token as the response writes it."""
        return self.text(self.token_id) if self.written is None else self.written


def cover_text(tokens: Sequence[LoggedToken], text: str) -> list[LoggedToken]:
    """The generated ``tokens`` that write ``text`` (a choice's returned text), in order.

    NOTE: a stop string cuts the text where it starts, but the tokens that wrote it were
    generated (and usage counts them): tokens wholly past the cut are left out, and a token that
    straddles it (part content, part stop string) is kept, written as its part before the cut,
    so the tokens still spell the text; its logprob and alternatives stay the whole token's
    (alternatives written whole). Where the tokens' texts do not start with ``text`` (a
    character split over tokens writes each part as U+FFFD) the cut cannot be placed: all kept.
    """
    shown = [token.shown() for token in tokens]
    joined = "".join(shown)
    if len(joined) <= len(text) or not joined.startswith(text):
        return list(tokens)
    out: list[LoggedToken] = []
    start = 0
    for token, written in zip(tokens, shown, strict=True):
        if start >= len(text):
            break
        end = start + len(written)
        out.append(token if end <= len(text) else token._replace(written=text[start:]))
        start = end
    return out


class HeldTokens:
    """A streamed choice's generated tokens, each released once all the text it writes is final.

    The engine holds back text that may still become a stop string; a token waits for its whole
    text, so no token is sent that writes text a stop string then cuts. ``finish`` releases the
    rest through ``cover_text``: the streamed tokens are those of the non-streamed response.
    """

    def __init__(self) -> None:
        self._held: list[tuple[LoggedToken, str]] = []
        """Tokens not yet released, with the text each writes."""
        self._released_len = 0
        """Characters of the choice's text written by the tokens released so far."""
        self._is_misaligned = False
        """True once a token's text differed from the choice's text: ``cover_text`` then keeps
        every token, so each is released at once."""

    def add(self, tokens: Sequence[LoggedToken]) -> None:
        """Hold newly generated tokens (in order)."""
        self._held += [(token, token.shown()) for token in tokens]

    def release(self, text: str) -> list[LoggedToken]:
        """The held tokens that write the next part of ``text`` (the choice's final text so far;
        a token that writes nothing only once text follows it, as ``cover_text`` keeps it)."""
        count, start = 0, self._released_len
        for _, written in self._held:
            end = start + len(written)
            if not self._is_misaligned and (start >= len(text) or end > len(text)):
                break
            self._is_misaligned = self._is_misaligned or not text.startswith(written, start)
            count, start = count + 1, end
        out, self._held = self._held[:count], self._held[count:]
        self._released_len = start
        return [token for token, _ in out]

    def finish(self, text: str) -> list[LoggedToken]:
        """Every held token that writes the choice's whole final ``text`` (``cover_text``)."""
        held, self._held = [token for token, _ in self._held], []
        if self._is_misaligned:
            return held
        return cover_text(held, text[self._released_len :])


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
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
        item = _chat_entry(token.shown(), entry.logprob)
        item["top_logprobs"] = [_chat_entry(text(t), lp) for t, lp in entry.top]
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
        texts = [token.shown() for token in tokens]
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
