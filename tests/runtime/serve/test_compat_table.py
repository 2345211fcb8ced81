"""The README's compatibility table, row by row, with the official ``openai`` client.

Every row of the table between ``<!-- compat-table:start -->`` and ``<!-- compat-table:end -->``
is a ``Row`` here, and ``test_readme_table_matches_the_rows`` keeps the two identical. A
"supported" row checks that the parameter is honoured (on a random-weight byte-level Llama: any
text is a valid prompt, greedy outputs are exact); a "refused" row checks for a 400 naming the
parameter; a "not served" endpoint is a 404. A row marked "ignored" (none today: keep it that way)
runs its check as a strict xfail, so the day it is fixed the run fails until the row is flipped.
"""

from __future__ import annotations

import functools
import json
import math
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from runtime.chunks.spans import ChunkReuse
from runtime.engine import Engine
from runtime.sampling.params import SamplingParams
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread

README = Path(__file__).resolve().parents[3] / "README.md"
Status = Literal["supported", "refused (400)", "not served (404)", "ignored"]
USER: Any = [{"role": "user", "content": "Name a colour."}]
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Look up the {name.split('_')[1]} of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("get_weather", "get_time")
]


@dataclass
class Ctx:
    """A served engine and clients: ``v1`` on ``/v1``, ``root`` on the server's root."""

    engine: Engine
    v1: OpenAI
    root: OpenAI
    model: str

    def chat(self, **kwargs: Any) -> Any:
        body: dict[str, Any] = {"model": self.model, "messages": USER, "max_tokens": 8}
        body.setdefault("temperature", 0)
        return self.v1.chat.completions.create(**{**body, **kwargs})

    def complete(self, **kwargs: Any) -> Any:
        body: dict[str, Any] = {"model": self.model, "prompt": "The colour is", "max_tokens": 8}
        return self.v1.completions.create(**{**body, "temperature": 0, **kwargs})

    def token_id(self, text: str) -> int:
        body = {"prompt": text, "add_special_tokens": False}
        [token] = self.root.post("/tokenize", body=body, cast_to=object)["tokens"]  # type: ignore[index]
        return int(token)

    @property
    def eos_id(self) -> int:
        return int(self.engine.tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def ctx(byte_llama_dir: Path) -> Iterator[Ctx]:
    engine = Engine.from_pretrained(str(byte_llama_dir), kv_cache_bytes=8 << 20)
    with ServerThread(create_app(engine)) as url:
        v1 = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        root = OpenAI(base_url=url, api_key="k", max_retries=0)
        yield Ctx(engine, v1, root, engine.model_id)
    engine.close()


def refused(call: Callable[[], Any], param: str) -> None:
    """``call`` must fail with a 400 whose ``param`` or message names ``param``."""
    with pytest.raises(BadRequestError) as caught:
        call()
    assert caught.value.param == param or param in caught.value.message, caught.value.message


def text_of(out: Any) -> str:
    return str(out.choices[0].message.content or "")


# --- supported today ----------------------------------------------------------------------------


def check_model(c: Ctx) -> None:
    assert c.chat().model == c.model
    with pytest.raises(NotFoundError):
        c.chat(model="gpt-4o")


def check_messages(c: Ctx) -> None:
    parts: Any = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    assert text_of(c.chat(messages=parts)) == text_of(c.chat())
    refused(lambda: c.chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content")  # fmt: skip
    refused(lambda: c.chat(messages=[{"role": "user", "content": []}]), "messages[0].content")


def check_max_tokens(c: Ctx) -> None:
    for out in (c.chat(max_tokens=3), c.complete(max_tokens=3)):
        assert out.usage.completion_tokens <= 3
        assert out.choices[0].finish_reason == "length" or out.usage.completion_tokens < 3


def check_max_completion_tokens(c: Ctx) -> None:
    out = c.chat(max_tokens=None, max_completion_tokens=2)
    assert out.usage.completion_tokens <= 2


def check_temperature(c: Ctx) -> None:
    greedy = text_of(c.chat(temperature=0, max_tokens=12))
    assert greedy == text_of(c.chat(temperature=1.0, max_tokens=12, extra_body={"top_k": 1}))
    refused(lambda: c.chat(temperature=2.5), "temperature")


def check_top_p(c: Ctx) -> None:
    # NOTE: any top token has p >= 1/vocab > 1e-3, so top_p=1e-3 keeps exactly one: greedy.
    greedy = text_of(c.chat(max_tokens=12))
    assert text_of(c.chat(temperature=1.0, top_p=1e-3, seed=5, max_tokens=12)) == greedy


def check_top_k(c: Ctx) -> None:
    greedy = text_of(c.chat(max_tokens=12))
    assert (
        text_of(c.chat(temperature=1.0, seed=9, max_tokens=12, extra_body={"top_k": 1})) == greedy
    )


def check_seed(c: Ctx) -> None:
    runs = {text_of(c.chat(temperature=1.0, seed=7, max_tokens=12)) for _ in range(2)}
    assert len(runs) == 1
    outs = {text_of(c.chat(temperature=1.0, seed=s, max_tokens=12)) for s in range(6)}
    assert len(outs) > 1  # the seed is used, not ignored


def check_stop(c: Ctx) -> None:
    greedy = text_of(c.chat(max_tokens=12))
    assert len(greedy) >= 3, "the random model ended too early for this check"
    stop = greedy[2]
    out = c.chat(max_tokens=12, stop=[stop])
    assert text_of(out) == greedy[: greedy.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def check_stream(c: Ctx) -> None:
    whole = text_of(c.chat(max_tokens=10))
    chunks = list(c.chat(max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    done = "".join(ch.choices[0].text for ch in c.complete(stream=True))
    assert done == c.complete().choices[0].text


def check_tools_auto_none(c: Ctx) -> None:
    plain = c.chat(max_tokens=1).usage.prompt_tokens
    for choice in ("auto", "none"):
        out = c.chat(max_tokens=4, tools=TOOLS, tool_choice=choice)
        assert out.usage.prompt_tokens > plain + 50  # the schemas are in the prompt
        if choice == "none":
            assert not out.choices[0].message.tool_calls
        refused(functools.partial(c.chat, tool_choice=choice), "tool_choice")  # OpenAI: needs tools


def check_response_format_text(c: Ctx) -> None:
    assert text_of(c.chat(response_format={"type": "text"})) == text_of(c.chat())


def check_cache_salt(c: Ctx) -> None:
    salt = f"tenant-{uuid.uuid4().hex}"
    first = c.chat(max_tokens=1, extra_body={"cache_salt": salt}).usage
    again = c.chat(max_tokens=1, extra_body={"cache_salt": salt}).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details.cached_tokens > 0


def check_chunk_reuse(c: Ctx) -> None:
    docs = [c.engine.tokenize(f"Document {k}: the colour of item {k} is teal.") for k in "ab"]
    q = c.engine.tokenize(" Which colour?")
    ids = docs[0] + docs[1] + q
    a, b = len(docs[0]), len(docs[0]) + len(docs[1])
    spans = [[0, a], [a, b]]
    first = c.complete(prompt=ids, max_tokens=4, extra_body={"chunk_reuse": {"spans": spans}})
    swapped = docs[1] + docs[0] + q
    body = {"chunk_reuse": {"spans": [[0, len(docs[1])], [len(docs[1]), b]]}}
    again = c.complete(prompt=swapped, max_tokens=4, extra_body=body)
    assert first.usage.model_extra["chunk_reuse"]["missed_tokens"] == b
    chunk = again.usage.model_extra["chunk_reuse"]
    assert chunk == {"mode": "exact", "reused_tokens": b, "recomputed_tokens": 0,
                     "missed_tokens": 0}  # fmt: skip
    want = c.engine.generate(
        swapped, SamplingParams(max_tokens=4, temperature=0.0),
        chunk_reuse=ChunkReuse(((0, len(docs[1])), (len(docs[1]), b))),
    )  # fmt: skip
    assert again.choices[0].text == want.text
    blend = {"chunk_reuse": {"spans": spans, "mode": "blend", "recompute_fraction": 1.0}}
    full = c.complete(prompt=ids, max_tokens=4, extra_body=blend)
    assert full.choices[0].text == c.complete(prompt=ids, max_tokens=4).choices[0].text
    assert c.complete(prompt=ids, max_tokens=1).usage.model_extra.get("chunk_reuse") is None
    chat = c.chat(max_tokens=2, extra_body={"chunk_reuse": {"spans": [[2, 9]]}})
    assert chat.usage.model_extra["chunk_reuse"]["mode"] == "exact"
    for bad in ([[0, a], [a - 1, b]], [[0, len(ids)]], [[0]]):
        body = {"chunk_reuse": {"spans": bad}}
        refused(functools.partial(c.complete, prompt=ids, extra_body=body), "chunk_reuse")
    refused(lambda: c.complete(prompt=ids, extra_body={"chunk_reuse": {"spans": spans, "x": 1}}),
            "chunk_reuse")  # fmt: skip
    # NOTE: a fraction exact mode would not use is refused, not ignored (a non-finite one:
    # tests/runtime/serve/test_protocol_limits.py, as JSON clients cannot send NaN).
    for extra in ({"recompute_fraction": 0.3}, {"mode": "exact", "recompute_fraction": 0.3}):
        with pytest.raises(BadRequestError) as caught:
            c.complete(prompt=ids, extra_body={"chunk_reuse": {"spans": spans, **extra}})
        assert "recompute_fraction applies to mode 'blend' only" in caught.value.message


# --- refused today ------------------------------------------------------------------------------


def check_n(c: Ctx) -> None:
    single = c.chat(max_tokens=4, temperature=1.0, seed=5)
    out = c.chat(n=3, max_tokens=4, temperature=1.0, seed=5)
    assert [choice.index for choice in out.choices] == [0, 1, 2]
    assert text_of(out) == text_of(single)  # choice 0 is seeded like the single request
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert 3 <= out.usage.completion_tokens <= 3 * 4  # summed over the choices


def check_chat_logprobs(c: Ctx) -> None:
    out = c.chat(logprobs=True, top_logprobs=3, max_tokens=6)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens >= 1
    for entry in entries:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= 0 and sum(math.exp(lp) for lp in tops) <= 1 + 1e-6
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy picks the top one
    assert c.chat(max_tokens=6).choices[0].logprobs is None  # only when asked


def check_completion_logprobs(c: Ctx) -> None:
    out = c.complete(logprobs=2, max_tokens=6)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens >= 1
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(tops) <= 2 and chosen == pytest.approx(max(tops.values()), abs=1e-5)


def check_echo(c: Ctx) -> None:
    prompt = "The colour is"
    out = c.complete(prompt=prompt, echo=True, logprobs=1, max_tokens=2)
    lp, usage = out.choices[0].logprobs, out.usage
    assert out.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.token_logprobs[0] is None  # the first prompt token has no context
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    scored = c.complete(prompt=prompt, echo=True, logprobs=1, max_tokens=0)  # lm-eval's request
    assert scored.choices[0].text == prompt
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1 : usage.prompt_tokens], abs=1e-4
    )


def check_suffix(c: Ctx) -> None:
    # NOTE: the message said "suffix: Input should be None", not that suffix is unsupported.
    with pytest.raises(BadRequestError) as caught:
        c.complete(suffix="!")
    assert caught.value.param == "suffix" and caught.value.code == "unsupported_parameter"
    assert "suffix='!' is not supported by this server" in caught.value.message
    assert c.complete(suffix=None).choices[0].text  # null is "off", as for the other such fields


def check_json_object(c: Ctx) -> None:
    out = c.chat(response_format={"type": "json_object"}, max_tokens=48)
    assert text_of(out).startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text_of(out)), dict)


def check_json_schema(c: Ctx) -> None:
    schema = {"name": "flag", "strict": True, "schema": FLAG_SCHEMA}
    fmt: Any = {"type": "json_schema", "json_schema": schema}
    for seed in (None, 1):
        out = c.chat(response_format=fmt, max_tokens=32, temperature=0 if seed is None else 1.0)
        value = json.loads(text_of(out))
        assert set(value) == {"ok"} and isinstance(value["ok"], bool)


def check_batch_prompts(c: Ctx) -> None:
    prompts = ["The colour is", "A colour:"]
    out = c.complete(prompt=prompts, max_tokens=3)
    assert [choice.index for choice in out.choices] == [0, 1]
    singles = [c.complete(prompt=p, max_tokens=3) for p in prompts]
    assert [choice.text for choice in out.choices] == [s.choices[0].text for s in singles]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


FLAG_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
ENUM_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            **tool["function"],
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    for tool in TOOLS
]
"""``TOOLS`` with an enum city, so a random-weight model's calls end within a few tokens."""


COLOUR_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string"},
        "rgb": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["colour", "rgb"],
    "additionalProperties": False,
}


# --- ignored today: what they must do -------------------------------------------------------------


def check_penalties(c: Ctx) -> None:
    base = text_of(c.chat(max_tokens=24))
    assert len(set(base)) < len(base), "the greedy baseline should repeat itself"
    for field in ("frequency_penalty", "presence_penalty"):
        for api in (c.chat, c.complete):
            plain = api(max_tokens=24)
            penalised = api(max_tokens=24, **{field: 2.0})
            assert _text(penalised) != _text(plain), field
    refused(lambda: c.chat(presence_penalty=2.5), "presence_penalty")


def check_repetition_penalty(c: Ctx) -> None:
    base = text_of(c.chat(max_tokens=24))
    out = c.chat(max_tokens=24, extra_body={"repetition_penalty": 10.0})
    assert text_of(out) != base
    # NOTE: issue 35: a value whose scaled logits left float32's range was a 500 (an error event
    # mid-stream); every accepted value is served, an extreme one as its limit.
    want = text_of(c.chat(max_tokens=12, extra_body={"repetition_penalty": 1e-20}))
    for tiny in (1e-39, 5e-324):
        assert text_of(c.chat(max_tokens=12, extra_body={"repetition_penalty": tiny})) == want
        stream = c.complete(max_tokens=12, stream=True, extra_body={"repetition_penalty": tiny})
        assert [chunk.choices[0].finish_reason for chunk in stream][-1] is not None
    refused(lambda: c.chat(extra_body={"repetition_penalty": 10.5}), "repetition_penalty")


def check_logit_bias(c: Ctx) -> None:
    x = c.token_id("x")
    out = c.chat(max_tokens=6, logit_bias={str(x): 100})
    assert text_of(out) == "x" * out.usage.completion_tokens == "x" * 6
    assert c.complete(max_tokens=4, logit_bias={str(x): 100}).choices[0].text == "xxxx"
    refused(lambda: c.chat(logit_bias={"99999999": 1}), "logit_bias")


def check_min_p(c: Ctx) -> None:
    # NOTE: min_p=1 keeps only tokens as likely as the top one: sampling becomes greedy.
    greedy = text_of(c.chat(max_tokens=12))
    out = c.chat(temperature=1.0, seed=4, max_tokens=12, extra_body={"min_p": 1.0})
    assert text_of(out) == greedy


def eos_forced(c: Ctx) -> None:
    """Precondition of the EOS rows: ``logit_bias`` on EOS ends a reply at once."""
    out = c.chat(max_tokens=5, logit_bias={str(c.eos_id): 100})
    assert out.usage.completion_tokens <= 1 and out.choices[0].finish_reason == "stop"


def check_min_tokens(c: Ctx) -> None:
    eos_forced(c)
    body = {"min_tokens": 5}
    out = c.chat(max_tokens=10, logit_bias={str(c.eos_id): 100}, extra_body=body)
    assert out.usage.completion_tokens >= 5


def check_ignore_eos(c: Ctx) -> None:
    eos_forced(c)
    body = {"ignore_eos": True}
    out = c.chat(max_tokens=5, logit_bias={str(c.eos_id): 100}, extra_body=body)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def _text(out: Any) -> str:
    choice = out.choices[0]
    return str(choice.message.content if hasattr(choice, "message") else choice.text)


def check_best_of(c: Ctx) -> None:
    refused(lambda: c.complete(best_of=2), "best_of")


def check_tool_choice_required(c: Ctx) -> None:
    out = c.chat(max_tokens=96, tools=ENUM_TOOLS, tool_choice="required")
    calls = out.choices[0].message.tool_calls or []
    assert out.choices[0].message.content is None  # tool calls only
    assert calls and {tc.function.name for tc in calls} <= {"get_weather", "get_time"}
    assert all(json.loads(tc.function.arguments)["city"] in ("Paris", "Rome") for tc in calls)


def check_tool_choice_named(c: Ctx) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    calls = c.chat(max_tokens=96, tools=ENUM_TOOLS, tool_choice=named).choices[0].message
    assert [tc.function.name for tc in calls.tool_calls or []] == ["get_time"]
    assert calls.content is None  # the call only


def check_parallel_tool_calls(c: Ctx) -> None:
    kwargs: Any = {"tools": ENUM_TOOLS, "tool_choice": "required", "max_tokens": 96}
    out = c.chat(parallel_tool_calls=False, **kwargs)
    assert len(out.choices[0].message.tool_calls or []) == 1
    refused(lambda: c.chat(parallel_tool_calls=False), "parallel_tool_calls")


# --- endpoints ------------------------------------------------------------------------------------


def check_models(c: Ctx) -> None:
    assert [m.id for m in c.v1.models.list()] == [c.model]
    assert c.v1.models.retrieve(c.model).id == c.model
    with pytest.raises(NotFoundError):
        c.v1.models.retrieve("gpt-4o")


def check_tokenize(c: Ctx) -> None:
    body = {"model": c.model, "messages": USER}
    counted: Any = c.root.post("/tokenize", body=body, cast_to=object)
    assert counted["count"] == c.chat(max_tokens=1).usage.prompt_tokens
    text: Any = c.root.post("/detokenize", body={"tokens": counted["tokens"]}, cast_to=object)
    assert "Name a colour." in text["prompt"]
    info: Any = c.root.get("/tokenizer_info", cast_to=object)
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 1024


def check_reset(c: Ctx) -> None:
    for path in ("/reset_prefix_cache", "/v1/admin/cache/reset"):
        c.chat(max_tokens=1)
        assert c.chat(max_tokens=1).usage.prompt_tokens_details.cached_tokens > 0
        answer: Any = c.root.post(path, cast_to=object)
        assert answer["status"] == "ok"
        assert c.chat(max_tokens=1).usage.prompt_tokens_details.cached_tokens == 0


def check_openapi_metrics_health(c: Ctx) -> None:
    schema: Any = c.root.get("/openapi.json", cast_to=object)
    assert "/v1/chat/completions" in schema["paths"]
    metrics = c.root.get("/metrics", cast_to=httpx.Response)
    assert "agentcache_prefill_tokens_computed_total" in metrics.text
    assert c.root.get("/health", cast_to=object)["status"] == "ok"  # type: ignore[index]


def check_not_served(c: Ctx) -> None:
    with pytest.raises(NotFoundError):
        c.v1.embeddings.create(model=c.model, input="x")
    with pytest.raises(NotFoundError):
        c.v1.responses.create(model=c.model, input="x")


@dataclass(frozen=True)
class Row:
    """One row of the README table: ``name | api | status`` and the check that backs it."""

    name: str
    api: str
    status: Status
    check: Callable[[Ctx], None]


ROWS = [
    Row("`model`", "chat, completions", "supported", check_model),
    Row("`messages` (text, text parts)", "chat", "supported", check_messages),
    Row("`max_tokens`", "chat, completions", "supported", check_max_tokens),
    Row("`max_completion_tokens`", "chat", "supported", check_max_completion_tokens),
    Row("`temperature`", "chat, completions", "supported", check_temperature),
    Row("`top_p`", "chat, completions", "supported", check_top_p),
    Row("`top_k` (vLLM)", "chat, completions", "supported", check_top_k),
    Row("`seed`", "chat, completions", "supported", check_seed),
    Row("`stop`", "chat, completions", "supported", check_stop),
    Row("`stream`, `stream_options.include_usage`", "chat, completions", "supported", check_stream),
    Row("`tools`, `tool_choice` auto / none", "chat", "supported", check_tools_auto_none),
    Row("`response_format` text", "chat", "supported", check_response_format_text),
    Row("`cache_salt` (vLLM)", "chat, completions", "supported", check_cache_salt),
    Row("`n` > 1", "chat, completions", "supported", check_n),
    Row("`logprobs`, `top_logprobs`", "chat", "supported", check_chat_logprobs),
    Row("`logprobs`", "completions", "supported", check_completion_logprobs),
    Row("`echo`", "completions", "supported", check_echo),
    Row("`suffix`", "completions", "refused (400)", check_suffix),
    Row("`response_format` json_object", "chat", "supported", check_json_object),
    Row("`response_format` json_schema", "chat", "supported", check_json_schema),
    Row("batched `prompt` (list of prompts)", "completions", "supported", check_batch_prompts),
    Row(
        "`presence_penalty`, `frequency_penalty`", "chat, completions", "supported", check_penalties
    ),
    Row("`repetition_penalty` (vLLM)", "chat, completions", "supported", check_repetition_penalty),
    Row("`logit_bias`", "chat, completions", "supported", check_logit_bias),
    Row("`min_p` (vLLM)", "chat, completions", "supported", check_min_p),
    Row("`min_tokens` (vLLM)", "chat, completions", "supported", check_min_tokens),
    Row("`ignore_eos` (vLLM)", "chat, completions", "supported", check_ignore_eos),
    Row("`best_of`", "completions", "refused (400)", check_best_of),
    Row("`tool_choice` required", "chat", "supported", check_tool_choice_required),
    Row("`tool_choice` named function", "chat", "supported", check_tool_choice_named),
    Row("`parallel_tool_calls`", "chat", "supported", check_parallel_tool_calls),
    Row("`GET /v1/models`, `GET /v1/models/{id}`", "endpoint", "supported", check_models),
    Row(
        "`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (vLLM)",
        "endpoint",
        "supported",
        check_tokenize,
    ),
    Row(
        "`POST /reset_prefix_cache`, `POST /v1/admin/cache/reset`",
        "endpoint",
        "supported",
        check_reset,
    ),  # fmt: skip
    Row(
        "`GET /openapi.json`, `/metrics`, `/health`",
        "endpoint",
        "supported",
        check_openapi_metrics_health,
    ),  # fmt: skip
    Row("`/v1/embeddings`, `/v1/responses`", "endpoint", "not served (404)", check_not_served),
    Row("`chunk_reuse` (extension)", "chat, completions", "supported", check_chunk_reuse),
]


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            row,
            id=row.name.replace("`", ""),
            marks=[pytest.mark.xfail(strict=True, reason="ignored on main")]
            if row.status == "ignored"
            else [],
        )
        for row in ROWS
    ],
)
def test_row(ctx: Ctx, row: Row) -> None:
    row.check(ctx)


def readme_rows() -> list[tuple[str, str, str]]:
    text = README.read_text(encoding="utf-8")
    table = text.split("<!-- compat-table:start -->")[1].split("<!-- compat-table:end -->")[0]
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows.append((cells[0], cells[1], re.sub(r"\*", "", cells[2])))
    return rows


def test_readme_table_matches_the_rows() -> None:
    assert readme_rows() == [(row.name, row.api, row.status) for row in ROWS]
