"""Run an ASGI app with uvicorn in a background thread on a free loopback port.

Used by the load script and the end-to-end tests; ``agentcache serve`` runs uvicorn in the
foreground instead. It knows sockets and threads, nothing about the app it serves.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

__all__ = ["ServerThread"]


class ServerThread:
    """Context manager: ``with ServerThread(app) as url: ...`` serves ``app`` at ``url``.

    Args:
        app: the ASGI app.
        host: bind address (loopback by default).
        port: 0 picks a free port.
        startup_timeout_s: how long to wait for uvicorn to start, seconds.

    Raises:
        RuntimeError: uvicorn did not start in time.
    """

    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0
    ) -> None:
        # NOTE: IPPROTO_TCP, so asyncio sets TCP_NODELAY on accepted connections (see
        # ``cli.bind_socket``).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        # NOTE: lifespan on, so an app's shutdown hooks run when the server stops (the proxy closes
        # its upstream httpx client there; with lifespan off its pooled socket outlived the
        # server and was garbage collected, with a ResourceWarning, in whatever test ran next).
        config = uvicorn.Config(
            app, log_level="warning", ws="none", lifespan="on", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self._startup_timeout_s = startup_timeout_s

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``."""
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self._server.run(sockets=[self._sock])

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self.url

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
