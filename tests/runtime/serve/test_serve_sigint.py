"""Ctrl-C stops ``agentcache serve`` quietly: a real SIGINT to a serving subprocess exits 130."""

from __future__ import annotations

import pytest

from runtime.serve.cli import bind_socket
from tests.cli_process import CliProcess, free_port


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_sigint_while_serving_exits_130_without_a_traceback(background: bool) -> None:
    """``background``: started with SIGINT ignored (``serve &`` in a script); Ctrl-C still
    stops it the same way."""
    port = free_port()
    argv = ("serve", "--model", "tiny", "--port", str(port))
    with CliProcess(*argv, buffered=True, sigint_ignored=background) as serve:
        serve.wait_for("Application startup complete", stream="stderr")
        # NOTE: stdout is a pipe here: the announcement is there only if serve flushed it
        serve.wait_for(f"agentcache serve: 'tiny' on http://127.0.0.1:{port}", timeout_s=10)
        assert serve.interrupt() == 130, serve.text("stderr")
    assert "Traceback" not in serve.text("stderr")
    assert "agentcache serve: stopped (Ctrl-C)" in serve.text("stderr")
    bind_socket("127.0.0.1", port).close()  # the port was released
