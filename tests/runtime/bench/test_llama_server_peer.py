"""llama-server's plumbing without llama-server: stand-in scripts start, answer ``/health`` or die,
and bad ``bench load --llama-server`` options fail before any slow work."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import httpx
import pytest

from runtime.bench.llama_server_peer import (
    LlamaServer,
    PeerError,
    check_binary,
    free_port,
    server_command,
)
from runtime.bench.load import main

# A stand-in llama-server: records its arguments; /health answers 503 twice (loading), then 200, its
# body the number of calls so far.
HEALTHY = """\
import http.server, sys
args = sys.argv[1:]
open(args[args.index("-m") + 1] + ".argv", "w").write(" ".join(args))
calls = []

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        calls.append(self.path)
        self.send_response(503 if len(calls) <= 2 else 200)
        self.end_headers()
        self.wfile.write(str(len(calls)).encode())

    def log_message(self, *a):
        pass

port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

DIES = "import sys\nprint('error: failed to open GGUF file', sys.argv[2])\nsys.exit(3)\n"


def executable(path: Path, python_source: str) -> Path:
    """``python_source`` as an executable script run by this interpreter."""
    path.write_text(f"#!{sys.executable}\n{python_source}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_the_command_line_gives_each_slot_its_context_and_the_threads() -> None:
    command = server_command(
        "/opt/llama-server", Path("/m/w1.gguf"), port=8099, num_slots=8, slot_len=1500, threads=2
    )
    assert command == [
        "/opt/llama-server", "-m", "/m/w1.gguf", "--host", "127.0.0.1", "--port", "8099",
        "-np", "8", "-c", "12000", "-t", "2", "-tb", "2", "-fa", "off",
    ]  # fmt: skip
    on = server_command("/b", Path("/m.gguf"), port=1, num_slots=2, slot_len=3, threads=1,
                        flash_attn="auto")  # fmt: skip
    assert on[-2:] == ["-fa", "auto"]


def test_check_binary_takes_an_executable_and_refuses_anything_else(tmp_path: Path) -> None:
    script = executable(tmp_path / "llama-server", DIES)
    assert check_binary(str(script)) == str(script)
    plain = tmp_path / "plain"
    plain.write_text("not executable")
    for bad in (plain, tmp_path, tmp_path / "missing"):
        with pytest.raises(ValueError, match="no executable there; build llama-server"):
            check_binary(str(bad))


def test_the_server_is_used_once_healthy_and_stopped_after(tmp_path: Path) -> None:
    gguf = tmp_path / "w1.gguf"
    port = free_port()
    command = [str(executable(tmp_path / "llama-server", HEALTHY)), "-m", str(gguf)]
    server = LlamaServer([*command, "--port", str(port)], port, startup_s=60)
    with server as url:
        assert url == f"http://127.0.0.1:{port}"
        health = httpx.get(url + "/health")
        assert (health.status_code, health.text) == (200, "4")  # the wait saw 503, 503, 200
        assert Path(str(gguf) + ".argv").read_text() == f"-m {gguf} --port {port}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)


def test_a_server_that_exits_early_says_why(tmp_path: Path) -> None:
    command = [str(executable(tmp_path / "llama-server", DIES)), "-m", "/no/w1.gguf"]
    with (
        pytest.raises(PeerError, match="(?s)exited with code 3 .*failed to open GGUF file /no/w1"),
        LlamaServer(command, free_port(), startup_s=60),
    ):
        pytest.fail("a dead server was reported healthy")


def test_a_missing_binary_cannot_start(tmp_path: Path) -> None:
    with (
        pytest.raises(PeerError, match="cannot start llama-server .*No such file"),
        LlamaServer([str(tmp_path / "missing")], free_port()),
    ):
        pytest.fail("a missing binary was reported healthy")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--llama-server", "/nonexistent"], "no executable there; build llama-server"),
        ([], "needs --llama-cpp-convert path/to/convert_hf_to_gguf.py (or --gguf)"),
        (["--gguf", "/no/such.gguf"], "--gguf '/no/such.gguf': no such file"),
        (["--url", "http://x"], "--url does not apply with --llama-server"),
        (["--model", "tiny"], "--model does not apply with --llama-server"),
        (["--plot", "x.png"], "--plot does not apply with --llama-server"),
    ],
)
def test_bad_peer_options_exit_2_in_one_line_before_any_work(
    tmp_path: Path, extra: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = executable(tmp_path / "llama-server", DIES)
    assert main(["--llama-server", str(binary), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]


@pytest.mark.parametrize("flag", [["--layers", "2"], ["--llama-server-np", "4"], ["--gguf", "x"]])
def test_peer_options_without_the_peer_are_refused(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(flag) == 2
    assert f"{flag[0]} needs --llama-server" in capsys.readouterr().err


def test_help_says_how_to_build_llama_server(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--target llama-server" in out and "vendor/llama.cpp" in out
    assert "--llama-server-np" in out and "convert_hf_to_gguf.py" in out
