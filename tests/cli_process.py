"""Run the ``agentcache`` command in a subprocess and stop it with a real signal.

Shared by the Ctrl-C tests of ``demo``, ``serve`` and ``proxy``: start the CLI offline with this
checkout on the path, drain both output streams in threads (a prompt without a newline counts),
wait for a marker, send SIGINT, collect the status and everything printed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Literal

__all__ = ["CliProcess", "free_port"]

ROOT = Path(__file__).resolve().parents[1]

# NOTE: a process started in the background by a non-interactive shell (`cmd &`, as a CI runner may
# start the suite) inherits SIGINT *ignored*, and so would every CLI child: uvicorn still shuts down
# on it but exits 0, the demo's prompt never sees it. The child resets SIGINT to the default before
# exec'ing the CLI (a default disposition survives exec; Python then installs its Ctrl-C handler),
# so these tests check the CLI as a terminal user runs it, however the suite was started.
_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'agentcache.cli', *sys.argv[1:]])"
)
_WITH_IGNORED_SIGINT = _WITH_DEFAULT_SIGINT.replace("SIG_DFL", "SIG_IGN")
"""As a background job of a non-interactive shell (``cmd &`` in a script) starts."""


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class CliProcess:
    """``python -m agentcache.cli ARGV`` offline (``HF_HUB_OFFLINE=1``, no endpoint env)."""

    def __init__(
        self,
        *argv: str,
        cwd: Path | None = None,
        buffered: bool = False,
        sigint_ignored: bool = False,
    ) -> None:
        """``buffered``: drop ``PYTHONUNBUFFERED`` from the child's environment, so its stdout
        (a pipe) is block-buffered as under a service manager: a line shows only if flushed.
        ``sigint_ignored``: start the CLI with SIGINT ignored, as a background job."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        env.pop("AGENTCACHE_BASE_URL", None)
        if buffered:
            env.pop("PYTHONUNBUFFERED", None)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WITH_IGNORED_SIGINT if sigint_ignored else _WITH_DEFAULT_SIGINT]
            + list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        self._seen: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._changed = threading.Condition()
        self._num_open = 2
        self._readers = [
            threading.Thread(target=self._drain, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.process.stdout), ("stderr", self.process.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _drain(self, name: str, stream: IO[str] | None) -> None:
        assert stream is not None
        while (char := stream.read(1)) != "":
            with self._changed:
                self._seen[name].append(char)
                self._changed.notify_all()
        with self._changed:
            self._num_open -= 1
            self._changed.notify_all()  # NOTE: both streams closed ends a wait too.

    def text(self, stream: Literal["stdout", "stderr"]) -> str:
        """Everything the process wrote to ``stream`` so far."""
        with self._changed:
            return "".join(self._seen[stream])

    def wait_for(
        self, text: str, *, stream: Literal["stdout", "stderr"] = "stdout", timeout_s: float = 120
    ) -> str:
        """Block until ``text`` appears on ``stream`` (or the process ends); return the stream."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: text in "".join(self._seen[stream]) or self._num_open == 0,
                timeout=timeout_s,
            )
        seen = self.text(stream)
        assert found and text in seen, f"{stream}: {seen!r}\nother: {self.text('stderr')!r}"
        return seen

    def interrupt(self) -> int:
        """Send SIGINT (Ctrl-C), wait for the exit (kill after 60 s); the exit status.

        NOTE: stdin stays open until the child has exited: a loaded child could read an early
        EOF as Ctrl-D (the demo's prompt then ends with 0) before it handles the SIGINT.
        """
        self.process.send_signal(signal.SIGINT)
        try:
            status = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.close()  # NOTE: kills and closes the pipes, so no warning leaks into later tests.
            raise
        self.close()
        return status

    def stop(self, sig: signal.Signals = signal.SIGTERM, *, timeout_s: float = 60) -> int:
        """Send ``sig`` (SIGTERM: what a service manager sends), wait for the exit (kill after
        ``timeout_s``); the exit status. Pipes stay open: ``text`` still reads the output."""
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            raise

    def close(self) -> None:
        """Kill the process if it still runs; close its pipes once the readers are done."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        for reader in self._readers:
            reader.join(10)
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> CliProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
