"""Sampling parameters over HTTP with the official ``openai`` client, on the real engine.

A poisoned request (it is made to emit a token whose embedding is NaN) streams concurrently
with healthy ones: it fails alone with a clear error, the healthy streams finish with the same
text as when run alone. Penalties, ``logit_bias``, ``min_p``, ``min_tokens`` and ``ignore_eos``
give exactly what the engine gives for the same ``SamplingParams``; ``logprobs`` (chat and
completions, streamed and not) match a log-softmax of the model's own logits; parameters the
server does not honour are refused with a 400 naming them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from openai import OpenAI
from openai.types.chat import ChatCompletionTokenLogprob

from runtime import SamplingParams
from runtime.engine import Engine
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread
from tests.runtime.test_poisoned_batch import POISON, save_poisoned_model

HEALTHY = [[9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]
AVOID = {str(POISON): -100}
BODY = {"ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, OpenAI]]:
    path = save_poisoned_model(Path(tmp_path_factory.mktemp("poisoned")))
    engine = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 20, block_size=4)
    with ServerThread(create_app(engine)) as url:
        yield engine, OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
    engine.close()


def stream_text(client: OpenAI, model: str, prompt: list[int], **kwargs: Any) -> str:
    chunks = client.completions.create(model=model, prompt=prompt, stream=True, **kwargs)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_a_poisoned_stream_fails_alone_while_healthy_streams_finish_unchanged(
    served: tuple[Engine, OpenAI],
) -> None:
    engine, client = served
    model = engine.model_id
    healthy: dict[str, Any] = {
        "max_tokens": 120,
        "temperature": 0,
        "logit_bias": AVOID,
        "extra_body": BODY,
    }
    alone = [stream_text(client, model, p, **healthy) for p in HEALTHY]
    started = threading.Barrier(len(HEALTHY) + 1, timeout=60)
    got: dict[int, str] = {}

    def run_healthy(i: int) -> None:
        stream = client.completions.create(model=model, prompt=HEALTHY[i], stream=True, **healthy)
        parts = []
        for n, chunk in enumerate(stream):
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if n == 0:
                started.wait()  # NOTE: every healthy stream is running before the poison goes in
        got[i] = "".join(parts)

    threads = [threading.Thread(target=run_healthy, args=(i,)) for i in range(len(HEALTHY))]
    for t in threads:
        t.start()
    started.wait()
    with pytest.raises(openai.APIError, match="non-finite logits"):
        stream_text(
            client, model, [4, 5, 6], max_tokens=50, logit_bias={str(POISON): 100}, extra_body=BODY
        )
    with pytest.raises(openai.InternalServerError, match="generation failed: .*non-finite"):
        client.completions.create(
            model=model,
            prompt=[4, 5],
            max_tokens=50,
            logit_bias={str(POISON): 100},
            extra_body=BODY,
        )
    extreme = stream_text(  # extreme but valid values are served, not failed
        client, model, [7, 8], max_tokens=6, temperature=1e-30, top_p=1e-30, extra_body=BODY
    )
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(len(HEALTHY))] == alone
    assert len(extreme.split()) == 6
    engine.check_integrity()
    assert engine.prefix_cache.radix.num_in_use_blocks == 0


PARAMS: list[tuple[dict[str, Any], SamplingParams]] = [
    (
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
    ),
    ({"extra_body": {"repetition_penalty": 1.4}}, SamplingParams(repetition_penalty=1.4)),
    ({"logit_bias": {"40": 5, "41": -100}}, SamplingParams(logit_bias={40: 5.0, 41: -100.0})),
    (
        {"temperature": 1.2, "seed": 4, "extra_body": {"min_p": 0.3, "top_k": 5}},
        SamplingParams(temperature=1.2, seed=4, min_p=0.3, top_k=5),
    ),
]


@pytest.mark.parametrize(("kwargs", "params"), PARAMS)
def test_each_parameter_gives_what_the_engine_gives(
    served: tuple[Engine, OpenAI], kwargs: dict[str, Any], params: SamplingParams
) -> None:
    engine, client = served
    kwargs = {"temperature": 0, **kwargs}
    extra = {**BODY, **kwargs.pop("extra_body", {})}
    out = client.completions.create(
        model=engine.model_id, prompt=HEALTHY[2], max_tokens=12, extra_body=extra, **kwargs
    )
    want = engine.generate(HEALTHY[2], replace(params, max_tokens=12, ignore_eos=True))
    assert out.choices[0].text == want.text


def test_min_tokens_and_ignore_eos_over_http(served: tuple[Engine, OpenAI]) -> None:
    # NOTE: greedy: a sampled draw could pick the fixture's poison token (NaN embedding) and
    # fail the request, which is another test's subject.
    engine, client = served
    eos = {str(next(iter(engine.eos_ids))): 100}
    stopped = client.completions.create(
        model=engine.model_id, prompt=HEALTHY[0], logit_bias=eos, temperature=0
    )
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    held = client.completions.create(
        model=engine.model_id,
        prompt=HEALTHY[0],
        logit_bias=eos,
        temperature=0,
        extra_body={"min_tokens": 5},
    )
    assert held.usage is not None and held.usage.completion_tokens == 6
    ignored = client.completions.create(
        model=engine.model_id,
        prompt=HEALTHY[0],
        max_tokens=7,
        temperature=0,
        logit_bias=eos,
        extra_body={"ignore_eos": True},
    )
    assert ignored.usage is not None and ignored.usage.completion_tokens == 7
    assert ignored.choices[0].finish_reason == "length"


def model_logprobs(engine: Engine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), vocab]`` log-softmax of the model's own logits at each output position."""
    with torch.no_grad():
        logits = engine.runner.model(torch.tensor([prompt + output[:-1]])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 :].double(), dim=-1)


def token_id(engine: Engine, text: str) -> int:
    return int(engine.tokenizer.convert_tokens_to_ids(text.strip()))


def shown(engine: Engine, token: int) -> str:
    """A generated token as the completion's text writes it (special tokens as "")."""
    return str(engine.tokenizer.decode([token], skip_special_tokens=True))


def no_special_tokens(engine: Engine) -> dict[str, int]:
    """``logit_bias`` that keeps special tokens from being picked (their text is "", so the
    tests could not tell which one it was; reported logprobs stay the raw model's)."""
    return {str(t): -100 for t in engine.tokenizer.all_special_ids}


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_match_the_models_log_softmax(
    served: tuple[Engine, OpenAI], stream: bool
) -> None:
    engine, client = served
    kwargs: dict[str, Any] = {"model": engine.model_id, "prompt": HEALTHY[1], "max_tokens": 6}
    kwargs.update(logprobs=3, temperature=0.8, seed=1, presence_penalty=1.0, extra_body=BODY)
    kwargs.update(logit_bias=no_special_tokens(engine))
    if stream:
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for chunk in client.completions.create(stream=True, **kwargs):
            lp = chunk.choices[0].logprobs if chunk.choices else None
            if lp is not None:
                tokens += lp.tokens or []
                values += lp.token_logprobs or []
                tops += lp.top_logprobs or []
                offsets += lp.text_offset or []
    else:
        out = client.completions.create(**kwargs)
        lp = out.choices[0].logprobs
        assert lp is not None
        tokens, values = lp.tokens or [], lp.token_logprobs or []
        tops, offsets = lp.top_logprobs or [], lp.text_offset or []
    ids = [token_id(engine, t) for t in tokens]
    assert len(ids) == 6
    ref = model_logprobs(engine, HEALTHY[1], ids)
    for step, tok in enumerate(ids):
        assert values[step] == pytest.approx(ref[step, tok].item(), abs=1e-4)
        want = torch.topk(ref[step], 3)
        want_top: dict[str, float] = {}  # keyed by text, the likelier kept (OpenAI's shape)
        for t, v in zip(want.indices.tolist(), want.values.tolist(), strict=True):
            want_top.setdefault(shown(engine, t), v)
        assert tops[step] == pytest.approx(want_top, abs=1e-4)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_the_models_log_softmax(
    served: tuple[Engine, OpenAI], stream: bool
) -> None:
    engine, client = served
    messages: list[Any] = [{"role": "user", "content": "w3 w4 w5"}]
    kwargs: dict[str, Any] = {"model": engine.model_id, "messages": messages, "max_tokens": 5}
    kwargs.update(logprobs=True, top_logprobs=2, temperature=0, extra_body=BODY)
    kwargs.update(logit_bias=no_special_tokens(engine))
    if stream:
        content: list[ChatCompletionTokenLogprob] = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content or []
    else:
        out = client.chat.completions.create(**kwargs)
        assert out.choices[0].logprobs is not None
        content = out.choices[0].logprobs.content or []
    ids = [token_id(engine, c.token) for c in content]
    prompt = engine.render_chat(messages)
    ref = model_logprobs(engine, prompt, ids)
    assert len(ids) == 5
    for step, entry in enumerate(content):
        assert entry.logprob == pytest.approx(ref[step, ids[step]].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        want = torch.topk(ref[step], 2)
        assert [t.token for t in entry.top_logprobs] == [
            shown(engine, t) for t in want.indices.tolist()
        ]
        want_values = want.values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want_values, abs=1e-4)


@pytest.mark.parametrize(
    ("param", "kwargs"),
    [
        ("best_of", {"best_of": 2}),
        ("use_beam_search", {"extra_body": {"use_beam_search": True}}),
        ("prompt_logprobs", {"extra_body": {"prompt_logprobs": 1}}),
        ("logit_bias", {"logit_bias": {"100000": 1}}),
        ("logit_bias", {"logit_bias": {"5": 101}}),
        ("logit_bias", {"logit_bias": {"\u00b2": 1}}),  # superscript two: isdigit, not int
        ("logit_bias", {"logit_bias": {"\u0663": 1}}),  # Arabic-Indic three: not a token id
        ("min_tokens", {"extra_body": {"min_tokens": 40}}),
        ("presence_penalty", {"presence_penalty": 2.5}),
    ],
)
def test_unhonoured_or_invalid_parameters_are_a_400_naming_them(
    served: tuple[Engine, OpenAI], param: str, kwargs: dict[str, Any]
) -> None:
    engine, client = served
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=engine.model_id, prompt=[5, 6], max_tokens=8, **kwargs)
    body: Any = err.value.body
    assert body["param"].startswith(param), body


def test_best_of_equal_to_n_is_accepted(served: tuple[Engine, OpenAI]) -> None:
    # NOTE: greedy: a sampled draw can pick the fixture's poison token (NaN embedding) and fail
    # the request with a 500 (seen once in a full-suite run), which is another test's subject.
    engine, client = served
    out = client.completions.create(
        model=engine.model_id, prompt=[5, 6], max_tokens=2, best_of=1, temperature=0
    )
    assert out.choices[0].finish_reason in {"stop", "length"}


def test_lm_eval_loglikelihood_payload(served: tuple[Engine, OpenAI]) -> None:
    """What lm-evaluation-harness ``local-completions`` sends for loglikelihood, parsed its way:
    ``sum(token_logprobs[ctxlen:-1])`` and ``is_greedy`` from ``top_logprobs``."""
    engine, client = served
    context, continuation = [9, 10, 11, 12], [13, 14, 15]
    client.completions.create(model=engine.model_id, prompt=context + continuation, max_tokens=1)
    out = client.completions.create(
        model=engine.model_id,
        prompt=[context + continuation],
        max_tokens=1,
        temperature=0,
        logprobs=1,
        echo=True,
        seed=1234,
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and out.usage is not None
    values = choice.logprobs.token_logprobs or []
    tops = choice.logprobs.top_logprobs or []
    assert len(values) == len(context + continuation) + 1 and values[0] is None
    ctxlen = len(context)
    with torch.no_grad():
        logits = engine.runner.model(torch.tensor([context + continuation])).logits[0]
    ref = torch.log_softmax(logits.double(), dim=-1)
    want = sum(ref[ctxlen - 1 + i, tok].item() for i, tok in enumerate(continuation))
    assert sum(values[ctxlen:-1]) == pytest.approx(want, abs=1e-4)
    is_greedy = all(
        v == max(t.values()) for v, t in zip(values[ctxlen:-1], tops[ctxlen:-1], strict=True)
    )
    want_greedy = all(
        int(ref[ctxlen - 1 + i].argmax()) == tok for i, tok in enumerate(continuation)
    )
    assert is_greedy == want_greedy
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # scored, so not served from cache
    prompt_text = engine.tokenizer.decode(context + continuation)
    assert (choice.text or "").startswith(prompt_text)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_scores_the_prompt_only(
    served: tuple[Engine, OpenAI], stream: bool
) -> None:
    engine, client = served
    kwargs: dict[str, Any] = {"model": engine.model_id, "prompt": "w5 w6 w7", "max_tokens": 0}
    kwargs.update(echo=True, logprobs=0)
    if stream:
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        values = [
            v
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for v in c.choices[0].logprobs.token_logprobs or []
        ]
        usage = chunks[-1].usage
    else:
        out = client.completions.create(**kwargs)
        text, usage = out.choices[0].text, out.usage
        assert out.choices[0].logprobs is not None
        values = out.choices[0].logprobs.token_logprobs or []
    ids = engine.tokenize("w5 w6 w7")
    assert text == "w5 w6 w7" and len(values) == len(ids) and values[0] is None
    assert usage is not None and usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=engine.model_id, prompt="w5", max_tokens=0)


def test_echo_without_logprobs_streams_the_prompt_first(served: tuple[Engine, OpenAI]) -> None:
    engine, client = served
    plain = client.completions.create(
        model=engine.model_id, prompt=HEALTHY[0], max_tokens=4, temperature=0, extra_body=BODY
    )
    chunks = list(
        client.completions.create(
            model=engine.model_id,
            prompt=HEALTHY[0],
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
            extra_body=BODY,
        )
    )
    prompt_text = engine.tokenizer.decode(HEALTHY[0])
    assert chunks[0].choices[0].text == prompt_text
    assert "".join(c.choices[0].text for c in chunks) == prompt_text + plain.choices[0].text
