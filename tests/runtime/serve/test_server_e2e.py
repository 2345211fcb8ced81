"""The server on the real engine over loopback HTTP: the official openai client, cache on/off
agreement, 100 clients that hang up mid-stream, faults, and 429 when the queue is full.

The model is a random-weight 2-layer Llama saved with a byte-level tokenizer (every byte is a
token, so any text works) and a ChatML template that lists tools; nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from runtime.engine import Engine
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread
from tests.runtime.serve.server_fakes import ScriptedEngine

SYSTEM = "You are a terse assistant. " * 12  # ~320 byte tokens shared by every request


@pytest.fixture(scope="module")
def model_dir(byte_llama_dir: Path) -> Path:
    return byte_llama_dir


def make_engine(model_dir: Path, *, prefix_cache: bool = True) -> Engine:
    return Engine.from_pretrained(str(model_dir), kv_cache_bytes=8 << 20, prefix_cache=prefix_cache)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[Engine, str]]:
    engine = make_engine(model_dir)
    with ServerThread(create_app(engine)) as url:
        yield engine, url


def pinned_blocks(engine: Engine) -> int:
    return int(engine.prefix_cache.radix.num_in_use_blocks)


def chat(user: str) -> list[Any]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_openai_client_chat_stream_and_completions(served: tuple[Engine, str]) -> None:
    engine, url = served
    client = OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
    assert [m.id for m in client.models.list()] == [engine.model_id]
    first = client.chat.completions.create(
        model=engine.model_id, messages=chat("first"), max_tokens=8, temperature=0
    )
    assert first.choices[0].finish_reason in {"stop", "length"}
    assert first.usage is not None and first.usage.completion_tokens >= 1
    # A second request sharing the long system prompt reuses its blocks.
    second = client.chat.completions.create(
        model=engine.model_id, messages=chat("second"), max_tokens=8, temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= len(SYSTEM) // 2
    stream = client.chat.completions.create(
        model=engine.model_id,
        messages=chat("first"),
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > len(SYSTEM)
    done = client.completions.create(model=engine.model_id, prompt=SYSTEM, max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens >= 1
    assert pinned_blocks(engine) == 0
    engine.check_integrity()


def test_outputs_agree_with_and_without_prefix_cache(model_dir: Path) -> None:
    texts: dict[bool, list[str]] = {}
    cached: dict[bool, int] = {}
    for prefix_cache in (True, False):
        engine = make_engine(model_dir, prefix_cache=prefix_cache)
        with ServerThread(create_app(engine)) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
            outs = [
                client.chat.completions.create(
                    model=engine.model_id, messages=chat(q), max_tokens=12, temperature=0
                )
                for q in ("alpha", "beta", "alpha")
            ]
        texts[prefix_cache] = [o.choices[0].message.content or "" for o in outs]
        details = [o.usage.prompt_tokens_details for o in outs if o.usage]
        cached[prefix_cache] = sum(d.cached_tokens or 0 for d in details if d)
    assert texts[True] == texts[False]
    assert cached[True] > 0 and cached[False] == 0


async def _hang_up_after_first_token(client: httpx.AsyncClient, model: str, i: int) -> bool:
    body = {"model": model, "messages": chat(f"client {i}"), "max_tokens": 200, "stream": True}
    body["temperature"] = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                return True  # leaving the block closes the connection mid-stream
    return False


def test_100_clients_hanging_up_mid_stream_leave_no_pinned_blocks(
    served: tuple[Engine, str],
) -> None:
    engine, url = served

    async def run() -> list[bool]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
            jobs = [_hang_up_after_first_token(client, engine.model_id, i) for i in range(100)]
            return await asyncio.gather(*jobs)

    assert all(asyncio.run(run()))
    server = httpx.get(f"{url}/health").json()
    deadline = time.monotonic() + 60
    while (server["running"] or server["waiting"] or pinned_blocks(engine)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
        server = httpx.get(f"{url}/health").json()
    assert (server["running"], server["waiting"], pinned_blocks(engine)) == (0, 0, 0)
    engine.check_integrity()
    metrics = httpx.get(f"{url}/metrics").text
    [cancelled] = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('agentcache_request_outcomes_total{outcome="cancelled"}')
    ]
    assert cancelled >= 90  # greedy on random weights: EOS within 200 tokens is rare
    ok = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": engine.model_id, "messages": chat("after"), "max_tokens": 4},
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"messages": chat("x" * 2000)}, 400, "context_length_exceeded"),
        ({"messages": chat("x"), "max_tokens": 0}, 400, "invalid_value"),
        ({"messages": chat("x"), "max_tokens": 5000}, 400, "context_length_exceeded"),
        ({"messages": chat("x"), "tools": [{"type": "function", "function": {}}]}, 400, None),
        ({"messages": chat("x"), "model": "gpt-4o"}, 404, "model_not_found"),
    ],
)
def test_faults_on_the_real_engine_are_4xx_and_the_server_stays_up(
    served: tuple[Engine, str], body: dict[str, Any], status: int, code: str | None
) -> None:
    engine, url = served
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": engine.model_id, **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    raw = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ', timeout=10)
    assert raw.status_code == 400
    ok = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": engine.model_id, "messages": chat("ok"), "max_tokens": 2},
    )
    assert ok.status_code == 200 and pinned_blocks(engine) == 0


def test_tools_render_through_the_template(served: tuple[Engine, str]) -> None:
    engine, url = served
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    base = {"model": engine.model_id, "messages": chat("x"), "max_tokens": 1}
    plain = httpx.post(f"{url}/v1/chat/completions", json=base).json()
    with_tools = httpx.post(f"{url}/v1/chat/completions", json={**base, "tools": [tool]}).json()
    extra = len(json.dumps(tool["function"]))  # the template writes the schema into the prompt
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + extra // 2


def test_a_full_engine_queue_answers_429_and_recovers() -> None:
    engine = ScriptedEngine(["tok"] * 50, step_s=0.02, max_open=1)
    body = {"model": engine.model_id, "messages": [{"role": "user", "content": "x"}]}
    with ServerThread(create_app(engine)) as url:
        holder = threading.Thread(
            target=lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        )
        holder.start()
        deadline = time.monotonic() + 10
        while engine.num_open == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        busy = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        holder.join()
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "server_busy"
        assert busy.headers["Retry-After"] == "1"  # whole seconds; it had none
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
        assert 'outcome="rejected"} 1.0' in httpx.get(f"{url}/metrics").text


def test_metrics_say_which_tier_served_the_prompt(model_dir: Path, tmp_path: Path) -> None:
    engine = Engine.from_pretrained(str(model_dir), kv_cache_bytes=8 << 20,
                                    kv_disk_dir=tmp_path, kv_disk_bytes=8 << 20)  # fmt: skip
    with ServerThread(create_app(engine)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)

        def cached_tokens() -> int:
            out = client.chat.completions.create(
                model=engine.model_id, messages=chat("disk"), max_tokens=2, temperature=0
            )
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            return out.usage.prompt_tokens_details.cached_tokens or 0

        assert cached_tokens() == 0
        engine.flush_cache()
        engine.drain_disk()
        from_disk = cached_tokens()  # cached_tokens counts blocks loaded back from disk too
        assert from_disk >= len(SYSTEM) // 2
        metrics = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("agentcache_")
        }
    assert metrics['agentcache_prefix_cache_tier_hits_total{tier="disk"}'] == from_disk
    assert metrics['agentcache_prefix_cache_tier_hits_total{tier="memory"}'] == 0
    assert 0 < metrics["agentcache_kv_disk_bytes_used"] <= 8 << 20
    assert metrics["agentcache_kv_disk_loads_total"] >= from_disk // 16
    engine.check_integrity()
    engine.close()


def test_tokenize_counts_what_a_chat_is_billed_and_reset_empties_the_cache(
    served: tuple[Engine, str],
) -> None:
    engine, url = served
    messages = chat("count me")
    tokens = httpx.post(f"{url}/tokenize", json={"model": engine.model_id, "messages": messages})
    body = {"model": engine.model_id, "messages": messages, "max_tokens": 1}
    usage = httpx.post(f"{url}/v1/chat/completions", json=body).json()["usage"]
    assert tokens.json()["count"] == usage["prompt_tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens.json()["tokens"]}).json()
    assert text["prompt"].endswith("user\ncount me<|im_end|><|im_start|>assistant")
    freed = httpx.post(f"{url}/v1/admin/cache/reset").json()["num_blocks_freed"]
    assert freed > 0 and engine.cache_stats().num_blocks_used == 0
    again = httpx.post(f"{url}/v1/chat/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == 0
    engine.check_integrity()


def _metric(text: str, name: str) -> float:
    [value] = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} ")]
    return value


def test_a_hung_up_stream_counts_its_prompt_and_its_work_as_the_cache_counts_its_query(
    model_dir: Path,
) -> None:
    engine = make_engine(model_dir)
    with ServerThread(create_app(engine)) as url:

        async def run() -> list[bool]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                # One after the other: the second hits the first's cached system prompt.
                return [
                    await _hang_up_after_first_token(client, engine.model_id, i) for i in (1, 2)
                ]

        assert all(asyncio.run(run()))
        deadline = time.monotonic() + 60
        text = httpx.get(f"{url}/metrics").text
        while time.monotonic() < deadline and (
            'agentcache_request_outcomes_total{outcome="cancelled"} 2.0' not in text
        ):
            time.sleep(0.05)
            text = httpx.get(f"{url}/metrics").text
    hits = _metric(text, "agentcache_prefix_cache_hits_total")
    assert hits > 0
    assert _metric(text, "agentcache_cached_tokens_total") == hits
    queried = _metric(text, "agentcache_prefix_cache_queries_total")
    assert _metric(text, "agentcache_prompt_tokens_total") == queried > 2 * len(SYSTEM)
    # Work done is work done: the hung-up requests' prefill and tokens count too.
    assert _metric(text, "agentcache_prefill_tokens_computed_total") == queried - hits
    assert _metric(text, "agentcache_generation_tokens_total") >= 2


def test_an_unsupported_json_schema_is_a_400_naming_it_without_xgrammar_internals(
    served: tuple[Engine, str],
) -> None:
    engine, url = served
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    body = {"model": engine.model_id, "messages": chat("x"), "response_format": fmt}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["message"] == 'response_format.json_schema: unsupported type "wat"'
    assert error["param"] == "response_format"


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {series (with labels): value}, our series only."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith("agentcache_")
    }


def test_metrics_report_the_chunk_store(model_dir: Path, served: tuple[Engine, str]) -> None:
    # A chunk store of exactly two blocks: each document fits one block, so a third evicts.
    block_bytes = served[0].chunk_store.pool.block_bytes
    engine = Engine.from_pretrained(str(model_dir), kv_cache_bytes=8 << 20,
                                    chunk_cache_bytes=2 * block_bytes)  # fmt: skip
    block_size = engine.chunk_store.pool.block_size
    docs = {k: engine.tokenize(f"doc {k}: teal.")[-block_size:] for k in "abc"}
    question = engine.tokenize(" Which colour?")
    with ServerThread(create_app(engine)) as url:
        before = scrape(url)
        assert before["agentcache_chunk_store_hits_total"] == 0
        assert before["agentcache_chunk_store_bytes_total"] == 2 * block_bytes
        usages = []
        for order, mode in (("ab", "exact"), ("ba", "exact"), ("ca", "blend")):
            first, second = docs[order[0]], docs[order[1]]
            body = {
                "model": engine.model_id, "prompt": first + second + question, "max_tokens": 1,
                "temperature": 0,
                "chunk_reuse": {"spans": [[0, len(first)], [len(first), len(first) + len(second)]],
                                "mode": mode,
                                **({"recompute_fraction": 0.0} if mode == "blend" else {})},
            }  # fmt: skip
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            usages.append(answer.json()["usage"]["chunk_reuse"])
        after = scrape(url)
    # ab: two misses (stored); ba: two hits; ca: c misses and evicts one of a, b.
    assert usages[0]["missed_tokens"] == len(docs["a"]) + len(docs["b"])
    assert usages[1]["reused_tokens"] == len(docs["a"]) + len(docs["b"])
    assert after["agentcache_chunk_store_hits_total"] >= 2
    assert (
        after["agentcache_chunk_store_hits_total"] + after["agentcache_chunk_store_misses_total"]
        == 6
    )  # one lookup per span
    assert after["agentcache_chunk_store_evictions_total"] >= 1
    assert after["agentcache_chunk_store_disk_hits_total"] == 0  # no --kv-disk-dir here
    assert after["agentcache_chunk_store_entries"] == 2
    assert after["agentcache_chunk_store_bytes_used"] == 2 * block_bytes
    for mode, used in (("exact", usages[:2]), ("blend", usages[2:])):
        for kind in ("reused", "recomputed", "missed"):
            series = f'agentcache_chunk_reuse_tokens_total{{kind="{kind}",mode="{mode}"}}'
            assert after[series] == sum(u[f"{kind}_tokens"] for u in used), series
    engine.check_integrity()
    engine.close()
