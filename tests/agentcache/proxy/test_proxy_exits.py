"""How ``agentcache proxy`` ends: a taken port in one line (exit 3) before it is announced, and
Ctrl-C as a real SIGINT to a subprocess: exit 130, no traceback, the port free again."""

from __future__ import annotations

import socket

import pytest

from agentcache.cli import main as cli_main
from tests.cli_process import CliProcess, free_port

UPSTREAM = "http://127.0.0.1:1/v1"  # NOTE: never contacted: no request is sent.


def test_a_taken_port_is_one_line_and_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli_main(["proxy", "--upstream", UPSTREAM, "--port", str(port)]) == 3
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"agentcache proxy: cannot listen on 127.0.0.1:{port}"
    )
    assert "--port" in lines[0] and "Traceback" not in captured.err and captured.out == ""


@pytest.mark.slow
def test_sigint_stops_the_proxy_quietly_with_130_and_frees_the_port() -> None:
    port = free_port()
    with CliProcess("proxy", "--upstream", UPSTREAM, "--port", str(port), buffered=True) as proxy:
        proxy.wait_for("Application startup complete", stream="stderr", timeout_s=60)
        proxy.wait_for(f"agentcache proxy: http://127.0.0.1:{port} -> {UPSTREAM}", stream="stdout")
        assert proxy.interrupt() == 130, proxy.text("stderr")
    assert "Traceback" not in proxy.text("stderr")
    assert "agentcache proxy: stopped (Ctrl-C)" in proxy.text("stderr")
    socket.create_server(("127.0.0.1", port)).close()  # the port was released
