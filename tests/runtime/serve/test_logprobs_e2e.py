"""Logprob tokens spell the text they come with, on the bundled ``tiny`` model over HTTP.

Issue 35: with ``echo``, the tokens of ``logprobs`` ended in the ``<|endoftext|>`` /
``<|im_end|>`` token that ended the completion, which the returned text (decoded without special
tokens) lacks. Generated tokens are now written as that text writes them (an end token is "",
vLLM's rule: its detokenizer writes logprob tokens with the request's ``skip_special_tokens``),
echoed prompt tokens as the echoed prompt writes them (special tokens kept).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import pytest

from tests.runtime.serve.conftest import Served

PROMPT = "hello world"
"""A prompt ``tiny`` answers in a few tokens, ending with an end-of-text token (greedy)."""


def check_spelled(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert "".join(tokens) == text
    assert offsets == [0, *accumulate(len(t) for t in tokens)][: len(tokens)]


@pytest.mark.parametrize("echo", [True, False])
def test_completion_logprob_tokens_spell_the_text(tiny_served: Served, echo: bool) -> None:
    engine, client = tiny_served
    out = client.completions.create(
        model=engine.model_id, prompt=PROMPT, echo=echo, logprobs=2, max_tokens=40, temperature=0
    )
    choice, usage = out.choices[0], out.usage
    assert choice.finish_reason == "stop" and usage is not None  # no stop strings: an end token
    assert choice.logprobs is not None
    tokens = choice.logprobs.tokens or []
    assert len(tokens) == usage.completion_tokens + (usage.prompt_tokens if echo else 0)
    assert tokens[-1] == ""  # the end token is counted and has a logprob, but no text
    check_spelled(choice.text, tokens, choice.logprobs.text_offset or [])
    # greedy: each generated token is its position's likeliest, under the same text
    tops = (choice.logprobs.top_logprobs or [])[-usage.completion_tokens :]
    generated = tokens[-usage.completion_tokens :]
    assert all(max(top, key=top.__getitem__) == t for t, top in zip(generated, tops, strict=True))


def test_streamed_completion_logprob_tokens_spell_the_streamed_text(tiny_served: Served) -> None:
    engine, client = tiny_served
    text, tokens, offsets = "", list[str](), list[int]()
    for chunk in client.completions.create(
        model=engine.model_id,
        prompt=PROMPT,
        echo=True,
        logprobs=1,
        max_tokens=40,
        stream=True,
        temperature=0,
    ):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                offsets += choice.logprobs.text_offset or []
    assert text.startswith(PROMPT) and tokens[-1] == ""
    check_spelled(text, tokens, offsets)


def test_echoed_special_tokens_stay_in_text_and_tokens(tiny_served: Served) -> None:
    engine, client = tiny_served
    ids: list[Any] = [*engine.tokenize("hello"), engine.tokenizer.eos_token_id]
    out = client.completions.create(
        model=engine.model_id, prompt=ids, echo=True, logprobs=1, max_tokens=0
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and engine.tokenizer.eos_token in choice.text
    check_spelled(choice.text, choice.logprobs.tokens or [], choice.logprobs.text_offset or [])


def test_chat_logprob_tokens_spell_the_content(tiny_served: Served) -> None:
    engine, client = tiny_served
    out = client.chat.completions.create(
        model=engine.model_id,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=1,
        max_tokens=40,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.logprobs is not None
    content = choice.logprobs.content or []
    assert content[-1].token == "" and content[-1].bytes == []
    assert "".join(entry.token for entry in content) == choice.message.content
