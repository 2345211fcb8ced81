"""Detokenizer: text equals a whole-output decode, multi-byte characters split across tokens,
stop strings across token boundaries, special tokens, and a bounded decode window per token."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.request.detokenizer import Detokenizer, id_decoder
from tests.conftest import make_byte_tokenizer, make_tokenizer

TEXT = "Plain ASCII, then é, ü, 日本語 and an emoji 🎉 split over bytes.\n  Two  spaces."


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each ``decode`` call got."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


def run(detok: Detokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for token in ids:
        deltas.append(detok.push(token))
        if detok.is_stopped:
            break
    return [*deltas, detok.flush()]


@pytest.fixture(scope="module")
def byte_tok() -> Any:
    return make_byte_tokenizer()


def test_byte_tokens_of_multibyte_characters_never_show_half_a_character(byte_tok: Any) -> None:
    ids = byte_tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # some characters really span several tokens
    detok = Detokenizer(byte_tok, [])
    deltas = run(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == byte_tok.decode(ids) == TEXT
    # The 4-byte emoji arrives whole, in one delta.
    assert any("🎉" in d for d in deltas)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (["日本"], "Plain ASCII, then é, ü, "),
        (["emoji 🎉"], "Plain ASCII, then é, ü, 日本語 and an "),
    ],
)
def test_a_stop_string_spanning_tokens_cuts_the_text_before_it(
    byte_tok: Any, stop: list[str], expected: str
) -> None:
    detok = Detokenizer(byte_tok, stop)
    deltas = run(detok, byte_tok.encode(TEXT, add_special_tokens=False))
    assert detok.is_stopped and "".join(deltas) == detok.text == expected


def test_a_possible_stop_prefix_is_held_back_then_released(byte_tok: Any) -> None:
    detok = Detokenizer(byte_tok, ["spaces.!"])
    deltas = run(detok, byte_tok.encode(TEXT, add_special_tokens=False))
    assert not detok.is_stopped and "".join(deltas) == TEXT
    assert deltas[-1] == "spaces."  # held while it could still become "spaces.!"; flushed


def test_special_tokens_are_dropped_from_the_text() -> None:
    tok = make_tokenizer()
    ids = tok.encode("w1 <|im_start|> w2 <|im_end|> w3", add_special_tokens=False)
    detok = Detokenizer(tok, [])
    assert "".join(run(detok, ids)) == tok.decode(ids, skip_special_tokens=True) == "w1 w2 w3"


def test_each_push_decodes_a_bounded_window_not_the_whole_output(byte_tok: Any) -> None:
    counting = CountingTokenizer(byte_tok)
    ids = byte_tok.encode(TEXT * 20, add_special_tokens=False)
    detok = Detokenizer(counting, ["never appears"])
    assert "".join(run(detok, ids)) == TEXT * 20
    assert len(ids) > 1000 and max(counting.sizes) <= 8


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_id_decoder_gives_the_tokenizers_own_strings(byte_tok: Any, clean_up: bool) -> None:
    # NOTE: the fast path (the Rust backend called directly) only where transformers adds
    # nothing: without clean_up_tokenization_spaces; with it, the tokenizer's own decode.
    words = make_tokenizer()
    words.clean_up_tokenization_spaces = clean_up
    for tok in (byte_tok, words):
        decode = id_decoder(tok)
        is_direct = getattr(decode, "func", None) == tok.backend_tokenizer.decode
        assert is_direct == (not tok.clean_up_tokenization_spaces)
    text = TEXT + " <|im_start|> , w1 . w2 <|im_end|> ' w3 ?"
    for tok in (byte_tok, words):
        ids = tok.encode(text, add_special_tokens=False)
        decode = id_decoder(tok)
        for start in range(0, len(ids), 3):
            for end in (start + 1, start + 4, len(ids)):
                want = tok.decode(ids[start:end], skip_special_tokens=True)
                assert decode(ids[start:end]) == want


def test_a_tokenizer_that_is_not_transformers_is_called_as_given(byte_tok: Any) -> None:
    counting = CountingTokenizer(byte_tok)
    assert id_decoder(counting)([72, 73]) == byte_tok.decode([72, 73]) and counting.sizes == [2]
