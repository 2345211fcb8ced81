"""Ctrl-C stops ``agentcache serve`` quietly: a real SIGINT to a serving subprocess exits 130."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_sigint_while_serving_exits_130_without_a_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    command = [sys.executable, "-m", "agentcache.cli", "serve", "--model", "tiny", "--port", port]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert process.stderr is not None
    started = threading.Event()
    seen: list[str] = []

    def watch() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            seen.append(line)
            if "Application startup complete" in line:
                started.set()
        started.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "".join(seen)
        process.send_signal(signal.SIGINT)
        stdout, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    reader.join(10)
    assert process.returncode == 130, "".join(seen)
    assert "Traceback" not in "".join(seen)
    assert "agentcache serve: stopped (Ctrl-C)" in stdout
