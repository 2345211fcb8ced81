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


Logged = list[tuple[str, float]]
"""A choice's logprob tokens as ``(token, logprob)``."""


def ask(served: Served, kind: str, *, stream: bool, **kwargs: Any) -> tuple[str, Logged]:
    """The text and logprob tokens of a greedy choice (streamed: joined over its chunks)."""
    engine, client = served
    body: dict[str, Any] = {"model": engine.model_id, "max_tokens": 40, "temperature": 0}
    body.update(kwargs, stream=stream)
    text, logged, offsets = "", Logged(), list[int]()
    if kind == "chat":
        messages: Any = [{"role": "user", "content": "hi"}]
        out: Any = client.chat.completions.create(messages=messages, logprobs=True, **body)
    else:
        out = client.completions.create(prompt=PROMPT, logprobs=1, **body)
    for chunk in out if stream else [out]:
        choice = chunk.choices[0]
        assert choice.finish_reason in (None, "stop")
        if kind == "completion":
            text += choice.text
            if choice.logprobs is not None:
                lp = choice.logprobs
                offsets += lp.text_offset or []
                logged += list(zip(lp.tokens or [], lp.token_logprobs or [], strict=True))
            continue
        text += (choice.delta.content if stream else choice.message.content) or ""
        entries = [] if choice.logprobs is None else choice.logprobs.content or []
        logged += [(entry.token, entry.logprob) for entry in entries]
    if kind == "completion":
        check_spelled(text, [token for token, _ in logged], offsets)
    return text, logged


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("is_inside", [False, True], ids=["on-boundary", "inside-token"])
def test_logprob_tokens_end_where_a_stop_string_cuts_the_text(
    tiny_served: Served, kind: str, stream: bool, is_inside: bool
) -> None:
    # Issue: the tokens of the matched stop string were still in logprobs, so the tokens spelt
    # the text plus the stop string. The stop is a generated token's whole text, or its text
    # past its first character: that token then straddles the cut and is written as that
    # first character, with its own logprob.
    full_text, full = ask(tiny_served, kind, stream=False)
    offsets = list(accumulate((len(token) for token, _ in full), initial=0))
    index, stop = next(
        (i, token[is_inside:])
        for i, (token, _) in enumerate(full)
        if i > 0 and len(token) > 1 and full_text.find(token[is_inside:]) == offsets[i] + is_inside
    )
    text, logged = ask(tiny_served, kind, stream=stream, stop=[stop])
    assert text == full_text[: offsets[index] + is_inside]
    want = full[:index] + ([(full[index][0][:1], full[index][1])] if is_inside else [])
    assert [token for token, _ in logged] == [token for token, _ in want]
    assert [lp for _, lp in logged] == pytest.approx([lp for _, lp in want], abs=1e-5)
    assert "".join(token for token, _ in logged) == text
