"""``n > 1`` and batched completion prompts through the official ``openai`` client, real engine.

The bundled ``tiny`` model is served over loopback. Choices come back in OpenAI's order
(``index = prompt * n + choice``), streamed chunks carry their choice's index, and usage counts
each prompt once (one prefill per prompt) while summing the completions.
"""

from __future__ import annotations

from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from runtime.engine import Engine
from runtime.scheduler.config import SchedulerConfig
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread
from tests.runtime.serve.conftest import Served

MESSAGES: list[Any] = [
    {"role": "system", "content": "You answer questions about the Python standard library."},
    {"role": "user", "content": "What does the json module do?"},
]


def test_chat_n_choices_share_the_prompt_in_usage(tiny_served: Served) -> None:
    engine, client = tiny_served
    single = client.chat.completions.create(
        model=engine.model_id, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=11
    )
    many = client.chat.completions.create(
        model=engine.model_id, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=11, n=3
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    # Choice 0 is seeded like the single request; the others with seed + 1, seed + 2.
    assert many.choices[0].message.content == single.choices[0].message.content
    assert single.usage is not None and many.usage is not None
    assert many.usage.prompt_tokens == single.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * 6
    assert engine.scheduler_stats().num_blocks_pinned == 0


def test_chat_n_choices_stream_with_their_index(tiny_served: Served) -> None:
    engine, client = tiny_served
    stream = client.chat.completions.create(
        model=engine.model_id,
        messages=MESSAGES,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finishes: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1}
    whole = client.chat.completions.create(
        model=engine.model_id, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=3, n=2
    )
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 10


def test_batched_completion_prompts_times_n_in_openai_order(tiny_served: Served) -> None:
    engine, client = tiny_served
    prompts = ["The json module", "A list is"]
    batch = client.completions.create(
        model=engine.model_id, prompt=prompts, max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [
        client.completions.create(model=engine.model_id, prompt=p, max_tokens=4, temperature=0)
        for p in prompts
    ]
    # index = prompt * n + choice; greedy choices of one prompt agree with its single answer.
    expected = [s.choices[0].text for s in singles for _ in range(2)]
    assert [c.text for c in batch.choices] == expected
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert batch.usage.completion_tokens == 4 * 4
    ids = [engine.tokenize(p) for p in prompts]
    by_ids = client.completions.create(
        model=engine.model_id, prompt=ids, max_tokens=4, temperature=0
    )
    assert [c.text for c in by_ids.choices] == [s.choices[0].text for s in singles]


def test_batched_completion_prompts_stream_each_index(tiny_served: Served) -> None:
    engine, client = tiny_served
    stream = client.completions.create(
        model=engine.model_id, prompt=["one", "two", "three"], max_tokens=3, stream=True
    )
    finished = sorted(
        c.index for chunk in stream for c in chunk.choices if c.finish_reason is not None
    )
    assert finished == [0, 1, 2]
    assert engine.scheduler_stats().num_running == 0


def test_n_over_the_batch_rows_is_a_400_naming_n(tiny_served: Served) -> None:
    # NOTE: n=128 passed the protocol's limit, then the engine's refusal named "messages".
    engine, client = tiny_served
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model=engine.model_id, messages=MESSAGES, n=128)
    assert caught.value.param == "n" and "max_batch_size" in caught.value.message


def test_n_over_the_batch_kv_budget_names_n_only_when_one_choice_fits() -> None:
    budget = 1 << 20  # 256 positions of the tiny model's KV (4096 bytes each)
    engine = Engine.from_pretrained(
        "tiny", kv_cache_bytes=8 << 20, scheduler=SchedulerConfig(batch_kv_bytes=budget)
    )
    with (
        ServerThread(create_app(engine)) as url,
        OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0) as client,
    ):
        chat: Any = {"model": engine.model_id, "messages": [{"role": "user", "content": "hi"}]}
        assert len(client.chat.completions.create(**chat, max_tokens=100, n=2).choices) == 2
        refusals = [
            (3, 100, "n", "lower n (at most 2 fit)"),
            (1, 300, "messages", "lower max_tokens"),
        ]
        for n, max_tokens, param, hint in refusals:
            with pytest.raises(BadRequestError) as caught:
                client.chat.completions.create(**chat, max_tokens=max_tokens, n=n)
            assert caught.value.param == param, caught.value.message
            assert f"over batch_kv_bytes={budget}; {hint}" in caught.value.message
    engine.close()
