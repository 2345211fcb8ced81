"""``agentcache proxy``: check the options, then serve the proxy app with uvicorn until stopped.

Exit codes: 2 for a bad option (one line on stderr before anything starts), 3 when the address
cannot be bound (found before the proxy is announced), 130 after Ctrl-C (SIGINT): uvicorn shuts
down gracefully, the port is released and no traceback is printed. On SIGTERM uvicorn shuts down
the same way and re-raises the signal, which ends the process (143 in a shell); 0 only if the
server returns by itself.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from urllib.parse import urlsplit

from agentcache.proxy.rewrite import RewriteOptions

__all__ = ["run_proxy", "show_proxy_log"]


def _fail(message: str, *, status: int = 2) -> int:
    print(f"agentcache proxy: {message}", file=sys.stderr)
    return status


def _ttl(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return -1.0
    return value if value > 0 else -1.0


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound now (``SO_REUSEADDR``, as uvicorn binds).

    Its ``proto`` is ``IPPROTO_TCP`` so that asyncio sets ``TCP_NODELAY`` on the connections it
    accepts; with ``proto`` 0 (what ``socket.create_server`` leaves) a keep-alive client's
    streamed chunks waited on its delayed ACK, about 40 ms (uvicorn issue #3149).

    Raises:
        OSError: the address is taken, not local, or the host does not resolve.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.create_server((host, port), family=family, backlog=2048)
    return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())


def show_proxy_log() -> None:
    """Print the ``agentcache.proxy`` logger's records (prefix breaks at INFO) to stderr.

    NOTE: uvicorn's logging config covers only its own loggers; without this the INFO lines
    that name each prefix break (``SessionTracker``) would fall through to Python's last-resort
    handler, which drops everything below WARNING.
    """
    log = logging.getLogger("agentcache.proxy")
    if not any(getattr(h, "_agentcache_proxy", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     agentcache proxy: %(message)s"))
        handler._agentcache_proxy = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def run_proxy(args: argparse.Namespace) -> int:
    """Run the proxy; returns the exit code (see the module docstring)."""
    try:
        return _proxy(args)
    except KeyboardInterrupt:
        print("agentcache proxy: stopped (Ctrl-C)", file=sys.stderr)
        return 130


def _redacted(url: str) -> str:
    """``url`` with any ``user:password@`` shown as ``***@``: it may hold a key, and the
    announcement and error lines end up in logs."""
    head, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if sep and "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{head}{sep}{netloc}{slash}{path}" if sep else url


def _upstream_problem(url: str) -> str | None:
    """Why ``url`` is not an http(s) URL with a host (and a valid port, if any), or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - NOTE: raises ValueError for a port that is not 0..65535
    except ValueError as exc:
        return f"--upstream is not a valid URL ({exc}), got {_redacted(url)!r}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--upstream must be an http(s) URL, got {_redacted(url)!r}"
    return None


def _proxy(args: argparse.Namespace) -> int:
    if (problem := _upstream_problem(args.upstream)) is not None:
        return _fail(problem)
    port = int(args.port)  # NOTE: the parser's port_number checked it
    ttl = _ttl(args.response_cache_ttl)
    if ttl is not None and ttl < 0:
        return _fail(f"--response-cache-ttl must be seconds > 0, got {args.response_cache_ttl!r}")
    try:
        import uvicorn

        from agentcache.proxy.app import create_proxy_app
        from agentcache.proxy.response_cache import ResponseCache
        from runtime.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES
    except ImportError as exc:
        return _fail(f"{exc}; install the proxy extra: pip install 'agentcache[proxy]'")
    cache = None
    if ttl is not None:
        from agentcache.cache import DiskStore, MemoryStore
        from agentcache.exceptions import CacheError

        try:
            store = DiskStore(args.response_cache_dir) if args.response_cache_dir else MemoryStore()
        except CacheError as exc:
            return _fail(f"--response-cache-dir: {exc}")
        cache = ResponseCache(store, ttl_s=ttl)
    options = RewriteOptions(
        sort_tools=not args.keep_tool_order,
        plan_breakpoints=not args.no_breakpoints,
        set_prompt_cache_key=not args.no_prompt_cache_key,
    )
    app = create_proxy_app(
        args.upstream,
        options=options,
        response_cache=cache,
        providers=args.provider,
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
    )
    try:
        sock = _listen(args.host, port)
    except OSError as exc:
        from runtime.serve.cli import bind_hint

        return _fail(
            f"cannot listen on {args.host}:{port}: {exc.strerror or exc}; {bind_hint(exc)}",
            status=3,
        )
    with sock:
        upstream = _redacted(args.upstream)
        print(f"agentcache proxy: http://{args.host}:{port} -> {upstream}", flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
        show_proxy_log()
        # NOTE: uvicorn shuts down gracefully on SIGINT, then re-raises the signal, which
        # arrives in run_proxy as KeyboardInterrupt (exit status 130), the socket closed.
        server.run(sockets=[sock])
    return 0
