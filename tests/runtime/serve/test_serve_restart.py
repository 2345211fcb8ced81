"""A clean restart stays warm: ``serve --kv-disk-dir`` writes cached blocks through to disk, and a
SIGTERM flushes what is queued, so the restarted server serves the same prompt from disk.

Issue 35 item 1: with blocks written only when evicted, a 2284-token prompt sent twice, SIGTERM
and a restart on the same directory found ``cached_tokens`` 0 and an empty directory.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cli_process import CliProcess, free_port

PROMPT_LEN = 2284


def serve(disk_dir: Path, *extra: str) -> tuple[CliProcess, str]:
    """``agentcache serve --model tiny --kv-disk-dir disk_dir``, started and ready; its URL."""
    port = free_port()
    process = CliProcess("serve", "--model", "tiny", "--port", str(port),
                         "--kv-disk-dir", str(disk_dir), *extra)  # fmt: skip
    process.wait_for("Application startup complete", stream="stderr", timeout_s=300)
    return process, f"http://127.0.0.1:{port}"


def complete(url: str, prompt: list[int]) -> tuple[str, int]:
    """Greedy ``/v1/completions`` of a token-id prompt: (text, cached_tokens)."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                            "temperature": 0}  # fmt: skip
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def block_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.suffix == ".kvb"]


@pytest.mark.slow  # two server processes, each importing torch
def test_a_sigterm_restart_serves_the_same_prompt_from_disk(tmp_path: Path) -> None:
    disk_dir = tmp_path / "kv"
    rng = random.Random(35)
    prompt = [rng.randrange(10, 4000) for _ in range(PROMPT_LEN)]
    first, url = serve(disk_dir)
    with first:
        cold_text, cold_cached = complete(url, prompt)
        warm_text, warm_cached = complete(url, prompt)
        assert cold_cached == 0 and warm_cached >= PROMPT_LEN - 16 and warm_text == cold_text
        assert first.stop(signal.SIGTERM) == 0, first.text("stderr")
    assert "Traceback" not in first.text("stderr")
    assert len(block_files(disk_dir)) >= PROMPT_LEN // 16 - 1  # every whole block is on disk
    second, url = serve(disk_dir)
    with second:
        text, cached = complete(url, prompt)
        metrics = httpx.get(f"{url}/metrics").text
    assert cached >= 0.9 * PROMPT_LEN, f"only {cached} of {PROMPT_LEN} prompt tokens cached"
    assert cached == PROMPT_LEN // 16 * 16  # every whole block (2272 tokens; 16-token blocks)
    assert text == cold_text  # the blocks from disk give the cold run's answer
    assert f'agentcache_prefix_cache_tier_hits_total{{tier="disk"}} {float(cached)}' in metrics


@pytest.mark.slow
def test_the_evict_policy_keeps_the_old_behaviour(tmp_path: Path) -> None:
    """``--kv-disk-policy evict`` writes nothing while memory holds everything (the choice is
    honoured, and the write-through test above would fail under it)."""
    disk_dir = tmp_path / "kv"
    prompt = list(range(10, 10 + 200))
    first, url = serve(disk_dir, "--kv-disk-policy", "evict")
    with first:
        complete(url, prompt)
        assert first.stop(signal.SIGTERM) == 0, first.text("stderr")
    assert block_files(disk_dir) == []
