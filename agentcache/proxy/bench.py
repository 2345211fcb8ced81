"""``agentcache bench proxy``: a careless app's prefix-cache hit rate direct vs through the proxy.

The app (the official ``openai`` client) shuffles its tool order and JSON key order on every
call, as apps that build tool lists from dicts or sets do. Upstream is our own server on the
bundled model, in this process on a loopback port. Also: the proxy's added latency (p50 of a
non-streamed request) and time to the first streamed byte, direct vs proxied, alternating runs.
A script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import httpx

__all__ = ["SYSTEM", "main", "shuffled_tools"]

SYSTEM = "You answer questions about the Python standard library. Be brief and exact. " * 6


def shuffled_tools(rng: random.Random) -> list[dict[str, Any]]:
    """Four tools in a random order, each schema with randomly ordered keys (a careless app)."""
    tools = []
    for name in ("search_docs", "read_file", "list_modules", "get_signature"):
        props = {"query": {"type": "string", "description": "what to look for"},
                 "limit": {"type": "integer", "description": "how many"}}  # fmt: skip
        schema = {"type": "object", "properties": props, "required": ["query"]}
        fn: dict[str, Any] = {"name": name, "description": f"{name}.", "parameters": schema}
        keys = list(fn)
        rng.shuffle(keys)
        tools.append({"type": "function", "function": {k: fn[k] for k in keys}})
    rng.shuffle(tools)
    return tools


def _body(i: int, rng: random.Random, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"What does module number {i} do?"}],
        "tools": shuffled_tools(rng), "max_tokens": 1, "temperature": 0,
    }  # fmt: skip


def hit_rate(base_url: str, api_key: str, calls: int, model: str) -> float:
    """Cached / prompt tokens over ``calls`` requests of the shuffling app (official client)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key)
    rng = random.Random(7)
    prompt = cached = 0
    for i in range(calls):
        out = client.chat.completions.create(**_body(i, rng, model))
        usage = out.usage
        assert usage is not None
        prompt += usage.prompt_tokens
        details = usage.prompt_tokens_details
        cached += (details.cached_tokens or 0) if details else 0
    return cached / prompt if prompt else 0.0


def _timed_post(client: httpx.Client, url: str, body: dict[str, Any], *, stream: bool) -> float:
    """Seconds to the whole answer, or to the first streamed byte."""
    t0 = time.perf_counter()
    if not stream:
        client.post(url, json=body).raise_for_status()
        return time.perf_counter() - t0
    with client.stream("POST", url, json={**body, "stream": True}) as answer:
        answer.raise_for_status()
        raw = answer.iter_raw()
        next(raw)
        elapsed = time.perf_counter() - t0
        for _ in raw:
            pass
    return elapsed


def overhead(direct: str, proxied: str, repeats: int, model: str) -> dict[str, float]:
    """p50 seconds per non-streamed request and to the first streamed byte, both routes."""
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    times: dict[str, list[float]] = {
        k: [] for k in ("direct", "proxy", "direct_ttfb", "proxy_ttfb")
    }
    with httpx.Client(timeout=60) as client:
        for _ in range(repeats):  # NOTE: alternate A/B so load swings hit both routes alike.
            times["direct"].append(_timed_post(client, direct, body, stream=False))
            times["proxy"].append(_timed_post(client, proxied, body, stream=False))
            times["direct_ttfb"].append(_timed_post(client, direct, body, stream=True))
            times["proxy_ttfb"].append(_timed_post(client, proxied, body, stream=True))
    return {f"{k}_p50_s": statistics.median(v) for k, v in times.items()}


def main(argv: list[str]) -> int:
    """Run the benchmark; prints one figure per line (and JSON with ``--json``)."""
    p = argparse.ArgumentParser(prog="agentcache bench proxy", description=__doc__)
    p.add_argument("--model", default="tiny", help="bundled model name or local path")
    p.add_argument("--calls", type=int, default=12, help="app calls per route (>= 2)")
    p.add_argument("--repeats", type=int, default=20, help="latency samples per route (>= 1)")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = p.parse_args(argv)
    if args.calls < 2 or args.repeats < 1:
        p.error("--calls must be at least 2 and --repeats at least 1")
    from agentcache.proxy.app import create_proxy_app
    from runtime.engine import Engine
    from runtime.serve.app import create_app
    from runtime.serve.server_thread import ServerThread

    engine = Engine.from_pretrained(args.model)
    try:
        with (
            ServerThread(create_app(engine)) as server,
            ServerThread(create_proxy_app(f"{server}/v1")) as proxy,
        ):
            model = engine.model_id
            result: dict[str, Any] = {
                "direct_hit_rate": hit_rate(f"{server}/v1", "direct", args.calls, model),
                "proxy_hit_rate": hit_rate(f"{proxy}/v1", "proxied", args.calls, model),
            }
            route = "/v1/chat/completions"
            result.update(overhead(server + route, proxy + route, args.repeats, model))
    finally:
        engine.close()
    result["hit_rate_ratio"] = result["proxy_hit_rate"] / max(result["direct_hit_rate"], 1e-9)
    result["added_latency_p50_s"] = result["proxy_p50_s"] - result["direct_p50_s"]
    result["added_ttfb_p50_s"] = result["proxy_ttfb_p50_s"] - result["direct_ttfb_p50_s"]
    for key, value in result.items():
        print(f"{key:24s} {value:.4f}")
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0
