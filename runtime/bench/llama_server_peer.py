"""llama.cpp's ``llama-server`` binary as a peer in ``bench load``: the options that ask for it,
its command line, a start on a free loopback port, the wait for ``/health``, the stop.

It knows the binary's flags and its ``/health`` route, not the workload or this engine. The binary
is never a test dependency (tests start stand-in scripts); how to build it is ``BUILD_HELP``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from runtime.serve.argtypes import positive_int

__all__ = [
    "BUILD_HELP",
    "DEFAULT_FLASH_ATTN",
    "DEFAULT_LAYERS",
    "DEFAULT_NUM_SLOTS",
    "LlamaServer",
    "PeerError",
    "add_peer_options",
    "check_binary",
    "free_port",
    "server_command",
]

BUILD_HELP = """\
llama-server peer (optional, never a test dependency): build llama.cpp's server from the source the
llama-cpp-python sdist vendors. `pip download llama-cpp-python==VERSION --no-deps --no-binary :all:
-d SDIST` and unpack it; then `cmake -S SDIST/llama_cpp_python-VERSION/vendor/llama.cpp -B BUILD
-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF
-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
-DBUILD_SHARED_LIBS=OFF` (CPU only, no network at build time) and `nice -n 19 cmake --build BUILD
--target llama-server -j1` (27 min at -j1 under nice 19 on a busy 2-core machine). Pass
--llama-server BUILD/bin/llama-server and --llama-cpp-convert with the same sdist's
vendor/llama.cpp/convert_hf_to_gguf.py (or --gguf with a GGUF of the same W1 weights). Both
engines use --threads; llama.cpp's worker threads spin at each barrier, so on cores other work
shares they lose more than torch's (see `bench prefix --help`): give the load average with
any figure."""

_HOST = "127.0.0.1"

DEFAULT_NUM_SLOTS = 8
"""llama-server's ``-np`` in ``bench load`` unless ``--llama-server-np`` says otherwise (issue 19
compares with ``-np 8``)."""

DEFAULT_FLASH_ATTN = "off"
"""llama-server's ``-fa`` in ``bench load``: its ``auto`` turned flash attention on for CPU, and
with 8 slots of 1,300 cached tokens each a round of 8 x 16 tokens took 10.5-11.6 s against
2.5 s with ``off`` (W1 f32, 2 threads, quiet machine, llama.cpp 0c1e570): the peer runs at its
best."""

DEFAULT_LAYERS = 30
"""W1's decoder layers unless ``--layers`` says otherwise, as ``bench prefix`` runs it."""


class PeerError(RuntimeError):
    """The peer could not be prepared or started (its output's tail is in the message)."""


def add_peer_options(p: argparse.ArgumentParser) -> None:
    """``bench load``'s ``--llama-server`` and the options only it reads (``load_peer.peer_problem``
    checks them)."""
    g = p.add_argument_group("llama-server peer (building it: see the end of this help)")
    g.add_argument(
        "--llama-server",
        metavar="BINARY",
        default=None,
        help="instead of the levels above: the W1 model on this server and on llama.cpp's "
        "llama-server (that binary, f32 GGUF, -np slots, --threads each), the same token-id "
        "/v1/completions workload on both, rounds alternating; tok/s ratio min/median/max",
    )
    g.add_argument(
        "--llama-server-np",
        type=positive_int,
        default=None,
        help=f"llama-server slots, its -np (default {DEFAULT_NUM_SLOTS})",
    )
    g.add_argument(
        "--llama-cpp-convert",
        metavar="convert_hf_to_gguf.py",
        default=None,
        help="llama.cpp's converter, to write the W1 weights as an f32 GGUF (as bench prefix)",
    )
    g.add_argument(
        "--llama-server-flash-attn",
        choices=("off", "on", "auto"),
        default=None,
        help=f"llama-server's -fa (default {DEFAULT_FLASH_ATTN}: with 'auto' it picked flash "
        "attention on this CPU and -np 8 on a warm 1338-token prefix ran 4.5x slower, 11 vs 51 "
        "tok/s)",
    )
    g.add_argument("--gguf", default=None, help="use this GGUF of the W1 weights instead")
    g.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help=f"W1 decoder layers (default {DEFAULT_LAYERS})",
    )


def check_binary(spec: str) -> str:
    """The executable ``--llama-server`` names.

    Raises:
        ValueError: no executable file there (the message says how to build one).
    """
    path = Path(spec).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(
            f"--llama-server {spec!r}: no executable there; build llama-server "
            "(`agentcache bench load --help` says how)"
        )
    return str(path)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it later)."""
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def server_command(
    binary: str,
    gguf: Path,
    *,
    port: int,
    num_slots: int,
    slot_len: int,
    threads: int,
    flash_attn: str = DEFAULT_FLASH_ATTN,
) -> list[str]:
    """llama-server's command line: ``num_slots`` slots (``-np``) of ``slot_len`` tokens each.

    ``-c`` is the whole context, which llama-server splits evenly between the slots when ``-np``
    is given (its unified KV buffer is on only for an automatic slot count). ``-t`` / ``-tb``
    set the decode and prompt threads alike; ``-fa`` is ``flash_attn`` (``DEFAULT_FLASH_ATTN``
    says why off); the rest (KV type f16, prompt cache, continuous batching) are llama-server's
    defaults.
    """
    return [
        binary, "-m", str(gguf), "--host", _HOST, "--port", str(port),
        "-np", str(num_slots), "-c", str(num_slots * slot_len),
        "-t", str(threads), "-tb", str(threads), "-fa", flash_attn,
    ]  # fmt: skip


class LlamaServer:
    """A llama-server child process: ``with LlamaServer(command, port) as url:`` starts it,
    waits until ``GET /health`` answers 200, and stops it when the block ends.

    Its output goes to a temporary file, so a chatty server never blocks on a full pipe; the
    file's tail is in any error.

    Raises:
        PeerError: (on entry) the command cannot start, exits before it is healthy, or is
            not healthy within ``startup_s`` seconds.
    """

    def __init__(self, command: list[str], port: int, *, startup_s: float = 300.0) -> None:
        self.command = command
        self.url = f"http://{_HOST}:{port}"
        self.startup_s = startup_s
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> str:
        try:
            self._proc = subprocess.Popen(
                self.command, stdout=self._log, stderr=subprocess.STDOUT, text=True
            )
        except OSError as exc:
            self._log.close()
            raise PeerError(f"cannot start llama-server {self.command[0]!r}: {exc}") from exc
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        """Poll ``/health`` every 0.2 s until 200 (503 while the model loads)."""
        assert self._proc is not None, "start the process first"
        deadline = time.monotonic() + self.startup_s
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise PeerError(
                        f"llama-server exited with code {self._proc.returncode} before it was "
                        f"ready:\n{self.log_tail()}"
                    )
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # NOTE: not listening yet
                time.sleep(0.2)
        raise PeerError(
            f"llama-server was not healthy within {self.startup_s:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, num_lines: int = 12) -> str:
        """The last ``num_lines`` lines the server printed (stdout and stderr)."""
        if self._log.closed:
            return ""
        self._log.seek(0)
        return "\n".join(self._log.read().splitlines()[-num_lines:])

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after 10 s); safe to call twice."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
