"""Soak: random SIGTERM and SIGKILL restarts of ``agentcache serve`` during traffic (write-through).

Bounded in count (``ROUNDS`` restarts) and in time (no new round after ``BUDGET_S``; nothing
here asserts a duration). Every answer served must equal the cache-off answer; after the last
restart an in-process engine on the same directory checks both tiers (index = files, budget,
pool + tree) and serves every prompt from them with the cache-off answers; the server's own
``/metrics`` shows no block left pinned once traffic stops.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from runtime.engine import Engine
from runtime.sampling.params import SamplingParams
from tests.cli_process import CliProcess, free_port

ROUNDS, BUDGET_S, MAX_TOKENS = 5, 240.0, 6
POOL_BYTES, DISK_BYTES = 1 << 20, 16 << 20  # 16 and ~250 blocks of the tiny model's 64 KiB


def soak_prompts() -> list[list[int]]:
    """3 shared 200-token heads x 4 tails of 40-120 tokens (hits across requests and restarts);
    more than the pool holds, so blocks are evicted and loaded back as well as written through."""
    rng = random.Random(35)
    heads = [[rng.randrange(10, 4000) for _ in range(200)] for _ in range(3)]
    return [h + [rng.randrange(10, 4000) for _ in range(rng.randrange(40, 120))]
            for h in heads for _ in range(4)]  # fmt: skip


def serve(disk_dir: Path) -> tuple[CliProcess, str]:
    port = free_port()
    process = CliProcess("serve", "--model", "tiny", "--port", str(port), "--kv-disk-dir",
                         str(disk_dir), "--kv-disk-bytes", str(DISK_BYTES), "--kv-cache-bytes",
                         str(POOL_BYTES))  # fmt: skip
    process.wait_for("Application startup complete", stream="stderr", timeout_s=300)
    return process, f"http://127.0.0.1:{port}"


def complete(url: str, prompt: list[int]) -> str | None:
    """The greedy answer, or None when the server went away mid-request."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    try:
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    except httpx.TransportError:
        return None
    assert out.status_code == 200, out.text
    return str(out.json()["choices"][0]["text"])


def traffic(url: str, prompts: list[list[int]], refs: list[str], seed: int,
            stop: threading.Event, served: list[int], wrong: list[int]) -> None:  # fmt: skip
    rng = random.Random(seed)
    while not stop.is_set():
        i = rng.randrange(len(prompts))
        got = complete(url, prompts[i])
        if got is None:
            return
        served.append(i)
        if got != refs[i]:
            wrong.append(i)


@pytest.mark.slow  # several server processes, each importing torch
def test_random_sigterm_and_sigkill_restarts_never_serve_a_wrong_answer(tmp_path: Path) -> None:
    prompts, disk_dir = soak_prompts(), tmp_path / "kv"
    reference = Engine.from_pretrained("tiny", prefix_cache=False)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    refs = [reference.generate(p, greedy).text for p in prompts]
    reference.close()
    rng, start = random.Random(7), time.monotonic()
    served: list[int] = []
    wrong: list[int] = []
    signals: list[signal.Signals] = []
    for round_ in range(ROUNDS):
        if time.monotonic() - start > BUDGET_S:
            break
        server, url = serve(disk_dir)
        with server:
            stop = threading.Event()
            clients = [threading.Thread(target=traffic, args=(url, prompts, refs, 10 * round_ + k,
                                                              stop, served, wrong))
                       for k in range(3)]  # fmt: skip
            for client in clients:
                client.start()
            time.sleep(rng.uniform(1.0, 4.0))  # NOTE: when to strike, not an assertion
            sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
            signals.append(sig)
            status = server.stop(sig)
            stop.set()
            for client in clients:
                client.join(150)
            assert status == (0 if sig == signal.SIGTERM else -signal.SIGKILL), server.text(
                "stderr"
            )
    assert len(signals) >= 2 and len(served) >= len(signals), (signals, len(served))
    assert wrong == [], f"{len(wrong)} wrong answers of {len(served)}"
    final, url = serve(disk_dir)
    with final:
        assert [complete(url, p) for p in prompts] == refs
        metrics = httpx.get(f"{url}/metrics").text
        assert "agentcache_kv_cache_blocks_pinned 0.0" in metrics
        assert final.stop(signal.SIGTERM) == 0
    engine = Engine.from_pretrained("tiny", kv_cache_bytes=POOL_BYTES, kv_disk_dir=disk_dir,
                                    kv_disk_bytes=DISK_BYTES)  # fmt: skip
    engine.check_integrity()  # disk index = files, budget; pool + tree
    assert engine.prefix_cache.disk is not None and engine.prefix_cache.disk.num_blocks > 0
    assert [engine.generate(p, greedy).text for p in prompts] == refs
    stats = engine.cache_stats()
    assert stats.disk_hit_tokens > 0 and stats.num_blocks_pinned == 0
    engine.check_integrity()
    engine.close()
