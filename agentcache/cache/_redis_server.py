"""A throwaway ``redis-server`` on a free loopback port, for tests and ``agentcache bench cache``.

No persistence (``--save ''``, no AOF), data in a temporary folder, stopped on exit. Knows nothing
about the caches; production deployments run their own Redis.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

import redis

__all__ = ["LocalRedisServer", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` on ``PATH``, or ``None`` if it is not installed."""
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedisServer:
    """``with LocalRedisServer() as url: ...``: a private Redis at ``redis://127.0.0.1:PORT/0``.

    ``stop()`` and ``start()`` may be called again to simulate an outage; the port is kept.

    Args:
        port: TCP port on 127.0.0.1; 0 picks a free one.
        startup_timeout_s: How long ``start`` waits for PING, seconds.

    Raises:
        FileNotFoundError: ``redis-server`` is not installed (from the constructor).
        RuntimeError: the server did not answer PING in time (from ``start``).
    """

    def __init__(self, *, port: int = 0, startup_timeout_s: float = 10.0) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError(
                "redis-server is not on PATH (Debian: apt-get install redis-server)"
            )
        self._binary = binary
        self.port = port or _free_port()
        self._startup_timeout_s = startup_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="agentcache-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        args = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self._dir.name, "--logfile", ""]
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self._startup_timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s); data is lost."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> str:
        self.start()
        return self.url

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._dir.cleanup()
