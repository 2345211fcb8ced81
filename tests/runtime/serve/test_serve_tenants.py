"""Tenants cannot flush each other (issue 35 item 2), against ``agentcache serve`` processes.

With two API keys and no admin key, tenant A's cache reset took tenant B's cached prefix from 608
tokens to 0 and A's ``/metrics`` showed B's traffic; with ``--kv-disk-dir`` a reset only spilled
the blocks to disk, so the next request still hit. Now a tenant's reset drops its own namespace,
in memory and on disk; ``/metrics`` and the global reset need ``--admin-key``.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cli_process import ROOT, CliProcess, free_port

A, B, ADMIN = "tenant-key-a", "tenant-key-b", "admin-key-0"


def serve(disk_dir: Path, *extra: str) -> tuple[CliProcess, str]:
    port = free_port()
    process = CliProcess("serve", "--model", "tiny", "--port", str(port), "--api-key", A,
                         "--api-key", B, "--kv-disk-dir", str(disk_dir), *extra)  # fmt: skip
    process.wait_for("Application startup complete", stream="stderr", timeout_s=300)
    return process, f"http://127.0.0.1:{port}"


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def cached(url: str, key: str, prompt: list[int]) -> int:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    out = httpx.post(f"{url}/v1/completions", json=body, headers=auth(key), timeout=300)
    assert out.status_code == 200, out.text
    return int(out.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompts() -> tuple[list[int], list[int]]:
    """Two 620-token prompts: 38 whole 16-token blocks (608 tokens) each can serve."""
    rng = random.Random(2)
    mine = [rng.randrange(10, 4000) for _ in range(620)]
    return mine, [rng.randrange(10, 4000) for _ in range(620)]


@pytest.mark.slow  # a server process importing torch
def test_a_tenant_reset_never_touches_another_tenant_and_global_routes_need_an_admin_key(
    tmp_path: Path,
) -> None:
    mine, theirs = prompts()
    server, url = serve(tmp_path / "kv")
    with server:
        for key, prompt in ((A, mine), (B, theirs)):
            assert cached(url, key, prompt) == 0 and cached(url, key, prompt) == 608
        reset = httpx.post(f"{url}/v1/admin/cache/reset", headers=auth(A))
        assert reset.status_code == 200 and reset.json()["scope"] == "tenant"
        assert cached(url, B, theirs) == 608  # B's prefix is untouched by A's reset
        assert cached(url, A, mine) == 0  # A's is gone from memory and from the disk tier
        refused = httpx.get(f"{url}/metrics", headers=auth(A))  # it would show B's traffic
        assert refused.status_code == 403 and "--admin-key" in refused.text
        assert A not in refused.text and B not in refused.text
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert server.stop(signal.SIGTERM) == 0


@pytest.mark.slow
def test_the_admin_key_resets_every_tenant_in_memory_and_on_disk(tmp_path: Path) -> None:
    mine, theirs = prompts()
    disk_dir = tmp_path / "kv"
    server, url = serve(disk_dir, "--admin-key", ADMIN)
    with server:
        for key, prompt in ((A, mine), (B, theirs)):
            assert cached(url, key, prompt) == 0 and cached(url, key, prompt) == 608
        assert httpx.get(f"{url}/metrics", headers=auth(B)).status_code == 403
        metrics = httpx.get(f"{url}/metrics", headers=auth(ADMIN)).text
        assert "agentcache_prefix_cache_hits_total 1216.0" in metrics
        reset = httpx.post(f"{url}/reset_prefix_cache", headers=auth(ADMIN))
        assert reset.status_code == 200 and reset.json()["scope"] == "all"
        assert not [p for p in disk_dir.iterdir() if p.suffix == ".kvb"]  # disk tier emptied too
        assert cached(url, A, mine) == 0 and cached(url, B, theirs) == 0
        assert server.stop(signal.SIGTERM) == 0


def test_serve_help_says_who_may_reset_and_read_metrics() -> None:
    out = subprocess.run([sys.executable, "-m", "agentcache.cli", "serve", "--help"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout  # fmt: skip
    text = " ".join(out.split())
    assert "--admin-key" in text and "global cache reset" in text
    assert "no admin key, /metrics and the global reset are refused (403)" in text
    assert "its own namespace" in text
