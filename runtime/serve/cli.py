"""``agentcache serve``: bind the port, load the engine, serve the app with uvicorn until stopped.

The only place that loads a model for serving; the app itself takes any ``ServingEngine``.
NOTE: the app, its protocol and its auth import torch (seconds; ~15 s on a busy machine), so they
are imported only after every option (model name, key files, port) has been checked.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.exceptions import ModelLoadError, one_line
from runtime.model.names import check_model_name
from runtime.serve.flags import engine_config

if TYPE_CHECKING:
    from uvicorn import Server

    from runtime.serve.engine_protocol import ServingEngine

__all__ = ["api_keys", "bind_hint", "bind_socket", "make_server", "read_key_file", "run_cli"]


def bind_hint(exc: OSError) -> str:
    """What to change after ``bind_socket`` (or the proxy's bind) raised ``exc``: the port when
    it is taken (``EADDRINUSE``), else the host (not local, or it does not resolve)."""
    if exc.errno == errno.EADDRINUSE:
        return "stop the process using it or pick another --port"
    return "give --host a local address (such as 127.0.0.1, or 0.0.0.0 for every interface)"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (what uvicorn would open), bound now.

    Its ``proto`` is ``IPPROTO_TCP``: accepted connections inherit it, and asyncio turns Nagle's
    algorithm off (``TCP_NODELAY``) only on sockets that say so. With ``proto`` 0 every request
    after the first on a keep-alive connection sent its stream's first chunk about 40 ms late
    (the client's delayed ACK) and the rest in one burst (uvicorn issue #3149; measured here:
    headers at 12 ms, every chunk at 52-56 ms).

    Raises:
        OSError: the address is taken, not local, or not allowed.
    """
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # NOTE: as uvicorn does; on Linux this still refuses a port another socket listens on.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def read_key_file(path: str | Path) -> list[str]:
    """API keys from a file: one per line; blank lines and lines starting with ``#`` skipped.

    Raises:
        OSError: the file cannot be read.
        ValueError: an empty path, a file that is not UTF-8 text, no key in the file, or a line
            with whitespace inside a key (the message names the file and gives the line number,
            never the line).
    """
    if not str(path):
        raise ValueError("--api-key-file is empty: give the path of a file with one key per line")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        where = f"{str(path)!r} is not UTF-8 text (byte {exc.start})"
        raise ValueError(f"{where}: one key per line") from None
    keys: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(c.isspace() for c in key):
            raise ValueError(f"{str(path)!r} line {number}: a key must not contain whitespace")
        keys.append(key)
    if not keys:
        raise ValueError(f"{str(path)!r} holds no API key (one key per line)")
    return keys


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of ``--api-key`` (repeatable) and ``--api-key-file`` (one per line), deduplicated.

    Raises:
        OSError: a key file cannot be read.
        ValueError: a key file holds no key, or a key is empty or contains whitespace (the
            message names the file and line or the flag's position, never a key).
    """
    keys: list[str] = []
    given = getattr(args, "api_key", None) or []
    for i, key in enumerate([given] if isinstance(given, str) else given, 1):
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"--api-key #{i} is empty or contains whitespace")
        keys.append(key)
    for path in getattr(args, "api_key_file", None) or []:
        keys.extend(read_key_file(path))
    for flag in ("admin_key", "metrics_key"):
        value = getattr(args, flag, None)
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ValueError(f"--{flag.replace('_', '-')} is empty or contains whitespace")
    return list(dict.fromkeys(keys))


class _Terminated(Exception):
    """SIGTERM arrived (a service manager stopping the server): unwind, closing the engine."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def run_cli(args: argparse.Namespace) -> int:
    """``agentcache serve``: bind the port, load the engine and serve until interrupted.

    The port is bound before the model loads, so a taken port fails in milliseconds.

    Returns:
        0 after a clean shutdown, 2 when the model name is unknown (said before torch loads,
        with the bundled models listed), the model cannot be loaded or an API key option is
        bad (unreadable or empty key file), 3 when the address cannot be bound (port in use, or
        a host that is not local), 130 after Ctrl-C (SIGINT) at any point: the engine and the
        socket are released and no traceback is printed. SIGTERM stops it the same way
        (uvicorn's graceful shutdown, then the engine closes, writing the disk tier's queued
        blocks for at most ``--kv-disk-flush-seconds``) and returns 0.
    """
    # NOTE: uvicorn shuts down gracefully on SIGTERM or SIGINT, then re-raises the signal under
    # the handler it found; with SIGTERM's default one the process would die before
    # ``engine.close`` ran. A background job of a non-interactive shell starts with SIGINT
    # ignored: uvicorn stopped on it all the same, then the re-raise did nothing (exit 0, no
    # line), so Ctrl-C's handler is installed whatever the process inherited.
    previous = previous_int = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _serve(args)
    except KeyboardInterrupt:
        print("agentcache serve: stopped (Ctrl-C)", file=sys.stderr)
        return 130
    except _Terminated:
        print("agentcache serve: stopped (SIGTERM)", file=sys.stderr)
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)


def _error(message: str) -> None:
    """A failure to start, one line on stderr (announcements go to stdout)."""
    print(f"agentcache serve: {message}", file=sys.stderr)


def _unusable_dir(folder: str) -> str | None:
    """Why ``folder`` cannot hold the disk tier (created here if missing), or None. Checked
    before the port is bound and the model loads, so a typo costs no load."""
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {folder!r}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{folder!r} is not writable"
    return None


def _runs(engine: ServingEngine) -> str:
    """``" (float32, compact forward, native decode attention)"``: what a local ``Engine`` runs
    (``" (float32, q4_1 weights, float16 KV cache, compact ..."`` where the KV cache's element
    type is not the model's), ending ``", oneDNN products"`` where its fp32 products run there
    (``fp32_products``; "" for other engines)."""
    runner, path = getattr(engine, "runner", None), getattr(engine, "forward_path", None)
    if runner is None or path is None:
        return ""
    kernel = ", native decode attention" if runner.decode_attention == "native" else ""
    compact = getattr(runner, "compact", None)
    label = compact.products_label if compact is not None else ""
    products = f", {label}" if label else ""
    kv_dtype = getattr(runner, "kv_dtype", runner.dtype)
    kv = "" if kv_dtype == runner.dtype else f", {str(kv_dtype).removeprefix('torch.')} KV cache"
    return (
        f" ({str(runner.dtype).removeprefix('torch.')}{_weights(runner)}{kv}, {path} forward"
        f"{kernel}{products})"
    )


def _weights(runner: Any) -> str:
    """``", bfloat16 weights"``, ``", float32-packed weights"``, ``", q4_1 weights"``, or why the
    packed copies are unused (``", float32-packed weights unused (transformers forward)"``,
    ``", q4_1 weights (blocks unread: scalar kernels)"``); "" for float32."""
    weights = getattr(runner, "weights", "float32")
    if weights == "bfloat16":
        return ", bfloat16 weights"
    if weights not in ("float32-packed", "q8_0", "q4_1"):
        return ""
    compact = getattr(runner, "compact", None)
    if compact is not None and compact.packed_products:
        return f", {weights} weights"
    why = ("transformers forward" if compact is None
           else "no native kernels" if compact.native is None else "scalar kernels")  # fmt: skip
    if weights != "float32-packed":  # NOTE: still a quantized model, computed in fp32 products
        return f", {weights} weights (blocks unread: {why})"
    return f", float32-packed weights unused ({why})"


def _serve(args: argparse.Namespace) -> int:
    try:
        check_model_name(args.model)  # NOTE: before torch is imported (seconds) or a hub lookup.
    except ModelLoadError as exc:
        _error(str(exc))
        return 2
    try:
        config = engine_config(args)  # NOTE: every engine option checked before torch loads.
    except ValueError as exc:
        _error(str(exc))
        return 2
    disk_dir = config.kv_disk_dir
    if disk_dir is not None and (problem := _unusable_dir(disk_dir)) is not None:
        _error(f"--kv-disk-dir: {problem}")
        return 2
    try:
        keys = api_keys(args)
    except (OSError, ValueError) as exc:
        _error(f"bad API key option: {exc}")
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        _error(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; {bind_hint(exc)}")
        return 3
    with sock:
        from runtime.engine import Engine  # NOTE: imports torch (seconds).

        try:
            engine = Engine.from_pretrained(args.model, config)
        except ModelLoadError as exc:  # NOTE: its message names the model and the cause
            _error(one_line(exc))
            return 2
        except OSError as exc:
            _error(f"cannot start {args.model!r}: {one_line(exc)}")
            return 2
        try:
            # NOTE: uvicorn shuts down gracefully on SIGINT, then re-raises the signal, which
            # arrives here as KeyboardInterrupt (run_cli turns it into exit status 130).
            make_server(args, engine, keys).run(sockets=[sock])
        finally:
            engine.close()
    return 0


def make_server(args: argparse.Namespace, engine: ServingEngine, keys: list[str]) -> Server:
    """The uvicorn server ``agentcache serve`` runs (logging at info), announced on stdout.

    NOTE: the announcement says how many keys are required, never which: keys must not reach
    stdout or logs (uvicorn's access log has no headers).
    """
    import uvicorn

    from runtime.serve.app import DEFAULT_MAX_REQUEST_BYTES, create_app

    max_bytes = getattr(args, "max_request_bytes", None) or DEFAULT_MAX_REQUEST_BYTES
    app = create_app(
        engine,
        api_key=keys,
        admin_key=getattr(args, "admin_key", None),
        metrics_key=getattr(args, "metrics_key", None),
        cors_origins=getattr(args, "cors_origin", None) or (),
        max_request_bytes=max_bytes,
    )
    # NOTE: flushed: a pipe or a log file would hold the address until the buffer filled
    print(f"agentcache serve: {engine.model_id!r} on http://{args.host}:{args.port}{_runs(engine)}",
          flush=True)  # fmt: skip
    if keys:
        print(f"agentcache serve: {len(keys)} API key(s) required", flush=True)
    return uvicorn.Server(uvicorn.Config(app, log_level="info"))
