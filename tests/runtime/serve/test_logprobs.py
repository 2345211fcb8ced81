"""``cover_text`` and ``HeldTokens``: logprob tokens cover exactly a choice's returned text.

Token ids are indexes into ``PIECES`` (the text each writes); entries carry the id as their
logprob, so a kept token is easy to tell apart.
"""

from __future__ import annotations

import pytest

from runtime.outputs import TokenLogprob
from runtime.serve.logprobs import HeldTokens, LoggedToken, chat_logprobs, cover_text

PIECES = ["Hel", "lo", " wor", "ld", "", "\ufffd", "##", "END"]


def tokens(*ids: int) -> list[LoggedToken]:
    return [LoggedToken(TokenLogprob(i, -i, ((i, -i),)), i, PIECES.__getitem__) for i in ids]


def shown(logged: list[LoggedToken]) -> list[str]:
    return [token.shown() for token in logged]


def streamed(logged: list[LoggedToken], deltas: list[str], text: str) -> list[LoggedToken]:
    """Tokens released as a stream would: one token per delta of final text, then ``finish``."""
    held, out, released = HeldTokens(), list[LoggedToken](), ""
    for token, delta in zip(logged, deltas, strict=True):
        held.add([token])
        released += delta
        out += held.release(released)
    return out + held.finish(text)


@pytest.mark.parametrize(
    ("ids", "text", "want", "deltas"),
    [
        # no stop string: every token, the end token ("") included
        ((0, 1, 4), "Hello", ["Hel", "lo", ""], ["Hel", "lo", ""]),
        # stop "lo": the cut falls between tokens, the stop's token is left out
        ((0, 1), "Hel", ["Hel"], ["Hel", ""]),
        # stop "o wor": "lo" straddles the cut (written "l"), " wor" is all stop string
        ((0, 1, 2), "Hell", ["Hel", "l"], ["Hel", "l", ""]),
        # stop "Hel" at the very start: nothing returned, no token
        ((0,), "", [], [""]),
        # an end token after the cut (a stop string, then EOS in the same step) is left out
        ((0, 1, 4), "Hel", ["Hel"], ["Hel", "", ""]),
        # a character split over two tokens (U+FFFD each): the cut cannot be placed, all kept
        ((5, 5, 6), "\u00e9", ["\ufffd", "\ufffd", "##"], ["", "\u00e9", ""]),
    ],
)
def test_tokens_cover_the_text_streamed_or_not(
    ids: tuple[int, ...], text: str, want: list[str], deltas: list[str]
) -> None:
    logged = tokens(*ids)
    assert shown(cover_text(logged, text)) == want
    assert shown(streamed(logged, deltas, text)) == want


def test_a_straddling_token_keeps_its_own_logprob_and_whole_alternatives() -> None:
    [head, straddler] = cover_text(tokens(0, 1, 2), "Hell")
    assert straddler.written == "l" and straddler.entry == tokens(1)[0].entry
    [_, entry] = chat_logprobs([head, straddler])["content"]
    assert entry["token"] == "l" and entry["bytes"] == [ord("l")]
    assert entry["logprob"] == -1.0 and entry["top_logprobs"][0]["token"] == "lo"


def test_a_token_is_streamed_only_once_its_whole_text_is_final() -> None:
    # stop "lo w": "Hel" goes out at once, but "lo" waits while "lo" may still start the stop
    held = HeldTokens()
    held.add(tokens(0))
    assert shown(held.release("Hel")) == ["Hel"]
    held.add(tokens(1))
    assert held.release("Hel") == []  # the engine held "lo" back
    held.add(tokens(2))
    assert shown(held.finish("Hel")) == []  # the stop matched: "lo" and " wor" are cut
