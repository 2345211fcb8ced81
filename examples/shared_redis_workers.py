"""Agent workers in several processes sharing one Redis result cache and one OpenAI-compatible
endpoint (`agentcache serve` here, vLLM or SGLang in production).

Run: AGENTCACHE_REDIS_URL=redis://127.0.0.1:6379/0 AGENTCACHE_BASE_URL=http://127.0.0.1:8000/v1 \
     python examples/shared_redis_workers.py
The slow tool runs once per tenant across all workers (the others wait for it, then hit); every
request carries its tenant's `cache_salt` and a stable `x-session-id` for a prefix-aware router.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from agentcache import env
from agentcache.backends import EngineHints, GenerationOptions, create_backend
from agentcache.cache import ToolCache, cache_scope, create_store

TENANTS = ("acme", "globex")
HINTS = EngineHints(cache_salt=True, session_header="x-session-id")


def release_notes(product: str) -> str:
    """A slow tool (an API call, a database query) whose result every worker of a tenant shares."""
    time.sleep(0.5)
    return f"{product} 2.1 notes, fetched by pid {os.getpid()} at {time.time():.3f}"


def worker(tenant: str, session: str) -> str:
    """One worker process: a tenant-scoped cached tool, then one model call with its result."""
    tool = ToolCache(create_store("redis")).wrap(release_notes, version="1", scope="tenant")
    backend = create_backend(env.base_url() or "", model=env.default_model(), engine_hints=HINTS)
    with cache_scope(tenant=tenant, session=session):
        start = time.perf_counter()
        notes = tool("agentcache")
        tool_ms = (time.perf_counter() - start) * 1e3
        messages = [{"role": "system", "content": "Summarize the notes in one line."},
                    {"role": "user", "content": notes}]  # fmt: skip
        reply = backend.complete(messages, GenerationOptions(max_tokens=8))
    usage = reply.usage
    return f"{tenant}/{session}: tool {tool_ms:4.0f} ms [{notes}] cached={usage.cached_tokens}"


def main(num_workers: int = 4) -> list[str]:
    """Start ``num_workers`` worker processes (tenants alternate); print and return their lines."""
    if env.redis_url() is None or env.base_url() is None:
        raise SystemExit("set AGENTCACHE_REDIS_URL and AGENTCACHE_BASE_URL")
    command = [sys.executable, __file__, "--worker"]
    procs = [
        subprocess.Popen([*command, TENANTS[i % 2], f"s{i}"], stdout=subprocess.PIPE, text=True)
        for i in range(num_workers)
    ]
    lines = [proc.communicate(timeout=300)[0].strip() for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit("a worker failed (see its error above)")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(worker(sys.argv[2], sys.argv[3]))
    else:
        main()
