"""``agentcache proxy``: check the options, then serve the proxy app with uvicorn until stopped.

Exit codes: 0 after a clean stop, 2 for a bad option (said in one line before anything starts),
3 when the address cannot be bound.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from agentcache.proxy.rewrite import RewriteOptions

__all__ = ["run_proxy"]


def _fail(message: str) -> int:
    print(f"agentcache proxy: {message}")
    return 2


def _port(text: str) -> int | None:
    return int(text) if text.isdigit() and 1 <= int(text) <= 65535 else None


def _ttl(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return -1.0
    return value if value > 0 else -1.0


def run_proxy(args: argparse.Namespace) -> int:
    """Run the proxy; returns the exit code (see the module docstring)."""
    upstream = urlsplit(args.upstream)
    if upstream.scheme not in ("http", "https") or not upstream.netloc:
        return _fail(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    port = _port(str(args.port))
    if port is None:
        return _fail(f"--port must be a whole number from 1 to 65535, got {args.port!r}")
    ttl = _ttl(args.response_cache_ttl)
    if ttl is not None and ttl < 0:
        return _fail(f"--response-cache-ttl must be seconds > 0, got {args.response_cache_ttl!r}")
    try:
        import uvicorn

        from agentcache.proxy.app import create_proxy_app
        from agentcache.proxy.response_cache import ResponseCache
    except ImportError as exc:
        return _fail(f"{exc}; install the proxy extra: pip install 'agentcache[proxy]'")
    cache = None
    if ttl is not None:
        from agentcache.cache import DiskStore, MemoryStore

        store = DiskStore(args.response_cache_dir) if args.response_cache_dir else MemoryStore()
        cache = ResponseCache(store, ttl_s=ttl)
    options = RewriteOptions(
        sort_tools=not args.keep_tool_order,
        plan_breakpoints=not args.no_breakpoints,
        set_prompt_cache_key=not args.no_prompt_cache_key,
    )
    app = create_proxy_app(
        args.upstream, options=options, response_cache=cache, providers=args.provider
    )
    print(f"agentcache proxy: http://{args.host}:{port} -> {args.upstream}")
    try:
        uvicorn.run(app, host=args.host, port=port, log_level="info")
    except OSError as exc:
        print(f"agentcache proxy: cannot listen on {args.host}:{port}: {exc.strerror or exc}")
        return 3
    return 0
