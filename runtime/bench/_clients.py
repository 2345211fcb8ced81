"""The client side of ``bench load``: streaming requests from concurrent clients, one phase's
figures (throughput, TTFT and inter-token latency percentiles, hit rate), the shared system prompt.

Chat bodies go to ``/v1/chat/completions``, others to ``/v1/completions``; it reads the stream and
the usage chunk, and knows nothing of which server answers (ours, llama-server, any other).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = [
    "BadURL",
    "PhaseReport",
    "PhaseRunner",
    "RequestResult",
    "client_phases",
    "format_ms",
    "phase_report",
    "remote_model",
    "run_phase",
    "system_prompt",
]

_WORDS = "cache prefix token block radix tenant stream decode prefill schema agent tool".split()


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One streamed request: seconds to its first text, usage token counts, error if it failed."""

    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None
    itl_s: tuple[float, ...] = ()
    """Gaps between consecutive content chunks of the stream (inter-token latency)."""


@dataclass(frozen=True, slots=True)
class PhaseReport:
    """Figures of one phase (a concurrency level, or its one-by-one baseline)."""

    name: str
    concurrency: int
    num_requests: int
    num_errors: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    """Prompt tokens of the requests that succeeded, from their usage."""
    cached_tokens: int
    """Of those, the tokens the prefix cache served (usage's ``cached_tokens``)."""
    tokens_per_s: float
    """Generated tokens per wall-clock second over the whole phase."""
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p99_s: float | None
    """99th percentile of every stream's gaps between content chunks (seconds)."""
    hit_rate: float
    """Cached prompt tokens / prompt tokens, from the responses' usage."""
    first_error: str | None
    """The first failed request's error, if any."""


def system_prompt(num_words: int) -> str:
    """The shared system prompt of every request: ``num_words`` words after a fixed opening."""
    words = (_WORDS[i % len(_WORDS)] for i in range(num_words))
    return "You are a helpful assistant. Reference notes: " + " ".join(words) + "."


def _text(choice: dict[str, Any]) -> str | None:
    """A stream chunk's new text: ``/v1/completions`` sends ``text``, chat a ``delta``."""
    if "text" in choice:
        return str(choice["text"])
    return (choice.get("delta") or {}).get("content")


async def _one(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    """One streaming request: chat when ``body`` has ``messages``, else ``/v1/completions``."""
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    arrivals: list[float] = []
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(None, 0, 0, 0, f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(ttft, 0, 0, 0, str(chunk["error"].get("message")))
                choices = chunk.get("choices") or []
                if choices and _text(choices[0]):
                    arrivals.append(time.perf_counter())
                    ttft = arrivals[0] - start
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        return RequestResult(ttft, 0, 0, 0, f"{type(exc).__name__}: {exc}")
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        ttft,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens", 0)),
        int(usage.get("completion_tokens", 0)),
        None if usage else "no usage chunk",
        tuple(b - a for a, b in zip(arrivals, arrivals[1:], strict=False)),
    )


def run_phase(
    url: str, bodies: list[dict[str, Any]], concurrency: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` from ``concurrency`` streaming clients; ``(results, wall seconds)``."""
    return asyncio.run(_phase(url, bodies, concurrency, timeout_s))


PhaseRunner = Callable[[str, list[dict[str, Any]], int, float], tuple[list[RequestResult], float]]
"""``(url, bodies, concurrency, timeout seconds) -> (results, wall seconds)``: one phase."""


async def _phase(
    url: str, bodies: list[dict[str, Any]], concurrency: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[RequestResult] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            results.append(await _one(client, queue.get_nowait()))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def phase_report(
    name: str, concurrency: int, results: list[RequestResult], wall_s: float
) -> PhaseReport:
    """The figures of one phase from its results and wall-clock seconds."""
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in results)
    out = sum(r.completion_tokens for r in results)
    return PhaseReport(
        name=name,
        concurrency=concurrency,
        num_requests=len(results),
        num_errors=sum(r.error is not None for r in results),
        wall_s=round(wall_s, 4),
        output_tokens=out,
        prompt_tokens=prompt,
        cached_tokens=sum(r.cached_tokens for r in results),
        tokens_per_s=round(out / wall_s, 2) if wall_s > 0 else 0.0,
        ttft_p50_s=_percentile(ttfts, 50),
        ttft_p99_s=_percentile(ttfts, 99),
        itl_p99_s=_percentile([gap for r in results for gap in r.itl_s], 99),
        hit_rate=round(sum(r.cached_tokens for r in results) / prompt, 4) if prompt else 0.0,
        first_error=next((r.error for r in results if r.error is not None), None),
    )


@contextlib.contextmanager
def client_phases(*, in_process: bool) -> Iterator[PhaseRunner]:
    """A ``run_phase`` whose clients run in one spawned process (kept for the whole block), or
    in this process when ``in_process`` (then they share its GIL with an in-process server)."""
    if in_process:
        yield run_phase
        return
    context = multiprocessing.get_context("spawn")  # NOTE: never fork a process running torch
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:

        def remote(*phase: Any) -> tuple[list[RequestResult], float]:
            return pool.submit(run_phase, *phase).result()

        yield remote


def format_ms(value: float | None) -> str:
    """Seconds as milliseconds with one decimal; ``-`` for None."""
    return "-" if value is None else f"{value * 1e3:.1f}"


class BadURL(Exception):
    """``--url`` does not lead to an OpenAI-compatible server."""


def remote_model(url: str) -> str:
    """The first model ``GET /v1/models`` lists.

    Raises:
        BadURL: Nothing listens there, or it does not answer like an OpenAI-compatible server.
    """
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            response = client.get("/v1/models")
        if response.status_code != 200:
            raise BadURL(
                f"{url}/v1/models answered HTTP {response.status_code}; is --url a server root?"
            )
        return str(response.json()["data"][0]["id"])
    except httpx.HTTPError as exc:
        raise BadURL(f"cannot reach {url}: {exc}; start `agentcache serve` or fix --url") from exc
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BadURL(f"{url}/v1/models did not list any model") from exc
