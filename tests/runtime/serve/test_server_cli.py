"""``agentcache serve`` (``runtime.serve.cli.run_cli``) fails fast and clearly before serving.

A taken port is found before the model loads; a missing local model path is named as such.
Nothing here starts uvicorn: every case returns before serving.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from runtime.engine import Engine
from runtime.serve import cli as server


def serve_args(port: int, model: str = "tiny") -> argparse.Namespace:
    return argparse.Namespace(
        model=model,
        host="127.0.0.1",
        port=port,
        kv_cache_bytes=None,
        no_prefix_cache=False,
        api_key=None,
        max_request_bytes=None,
    )


def _must_not_load(*args: object, **kwargs: object) -> Engine:
    raise AssertionError("the model was loaded although the port is taken")


def test_taken_port_fails_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Engine, "from_pretrained", _must_not_load)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert server.run_cli(serve_args(port)) == 3
    out = capsys.readouterr().out
    assert f"cannot listen on 127.0.0.1:{port}" in out and "--port" in out


def test_missing_model_directory_is_exit_2_and_frees_the_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert server.run_cli(serve_args(port, model="./no/such/model-dir")) == 2
    out = capsys.readouterr().out
    assert "no such model directory './no/such/model-dir'" in out and "tiny" in out
    server.bind_socket("127.0.0.1", port).close()  # the port was given back


def test_kv_disk_flags_reach_the_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from agentcache.cli import build_parser
    from runtime.exceptions import ModelLoadError

    seen: dict[str, object] = {}

    def record(model: str, **kwargs: object) -> Engine:
        seen.update(kwargs)
        raise ModelLoadError("stop before serving")

    monkeypatch.setattr(Engine, "from_pretrained", record)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    argv = ["serve", "--port", port, "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "4096"]
    assert server.run_cli(build_parser().parse_args(argv)) == 2
    assert seen["kv_disk_dir"] == str(tmp_path) and seen["kv_disk_bytes"] == 4096
    lone = build_parser().parse_args(["serve", "--port", port, "--kv-disk-bytes", "4096"])
    assert server.run_cli(lone) == 2
    assert "--kv-disk-bytes needs --kv-disk-dir" in capsys.readouterr().out
