"""``agentcache serve`` (``runtime.serve.cli.run_cli``): fails fast, clearly, never logs keys.

A taken port is found before the model loads; a missing local model path is named as such; bad
key options are named without echoing a key. One test serves the bundled model exactly as the
command does (in a thread) and checks that no key appears in its stdout or logs.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentcache.cli import build_parser
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.serve import cli as server
from tests.cli_process import ROOT


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
    captured = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port}" in captured.err and "--port" in captured.err
    assert captured.out == ""  # NOTE: failures go to stderr, announcements to stdout


def test_missing_model_directory_is_exit_2_and_frees_the_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert server.run_cli(serve_args(port, model="./no/such/model-dir")) == 2
    err = capsys.readouterr().err
    assert "no such model directory './no/such/model-dir'" in err and "tiny" in err
    server.bind_socket("127.0.0.1", port).close()  # the port was given back


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("tinyy", "unknown model 'tinyy': did you mean 'tiny'? bundled models: tiny; named"),
        (
            "llama",
            "unknown model 'llama': bundled models: tiny; named models (pulled on first "
            "use): smollm2-135m; or give a local folder, a .gguf file or a hub",
        ),
    ],
)
def test_a_model_name_typo_is_one_line_before_torch_or_the_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], model: str, says: str
) -> None:
    # NOTE: a None entry makes `import runtime.engine` (torch) fail: the check must come first.
    monkeypatch.setitem(sys.modules, "runtime.engine", None)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]  # a taken port would be exit 3: the name is checked first
        assert server.run_cli(serve_args(port, model=model)) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"agentcache serve: {says}"), lines


def test_kv_disk_and_budget_flags_reach_the_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--kv-disk-*, --kv-cache-bytes, --chunk-cache-bytes, --dtype, --weights, --eviction and
    the scheduler limits become the engine's ``EngineConfig`` (the dataclass's defaults when not
    given); --weights bfloat16 with a 16-bit --dtype is refused before the model loads."""
    from agentcache.cli import build_parser
    from runtime.exceptions import ModelLoadError

    seen: list[EngineConfig] = []

    def record(model: str, config: EngineConfig) -> Engine:
        seen.append(config)
        raise ModelLoadError("stop before serving")

    monkeypatch.setattr(Engine, "from_pretrained", record)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    argv = ["serve", "--port", port, "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "4096",
            "--kv-cache-bytes", "1234567", "--chunk-cache-bytes", "7654321",
            "--dtype", "bfloat16", "--kv-disk-policy", "evict",
            "--kv-disk-flush-seconds", "2.5", "--eviction", "lru",
            "--max-batch-size", "3", "--prefill-chunk-tokens", "64"]  # fmt: skip
    assert server.run_cli(build_parser().parse_args(argv)) == 2
    [config] = seen
    assert config.kv_disk_dir == str(tmp_path) and config.kv_disk_bytes == 4096
    assert config.kv_disk_policy == "evict" and config.kv_disk_flush_s == 2.5
    assert (config.kv_cache_bytes, config.chunk_cache_bytes) == (1234567, 7654321)
    assert config.dtype == "bfloat16" and config.eviction == "lru"
    assert (config.scheduler.max_batch_size, config.scheduler.prefill_chunk_tokens) == (3, 64)
    seen.clear()
    assert server.run_cli(build_parser().parse_args(["serve", "--port", port])) == 2
    assert seen == [EngineConfig()]  # NOTE: nothing given: the dataclass's defaults
    lone = build_parser().parse_args(["serve", "--port", port, "--kv-disk-bytes", "4096"])
    assert server.run_cli(lone) == 2
    assert "--kv-disk-bytes needs --kv-disk-dir" in capsys.readouterr().err
    lone = build_parser().parse_args(["serve", "--port", port, "--kv-disk-policy", "evict"])
    assert server.run_cli(lone) == 2
    assert "--kv-disk-policy needs --kv-disk-dir" in capsys.readouterr().err
    for weights in ("bfloat16", "float32-packed"):
        seen.clear()
        assert server.run_cli(build_parser().parse_args(["serve", "--port", port, "--weights",
                                                         weights])) == 2  # fmt: skip
        assert seen[0].weights == weights and seen[0].dtype == "float32"
        seen.clear()
        both = ["serve", "--port", port, "--weights", weights, "--dtype", "float16"]
        assert server.run_cli(build_parser().parse_args(both)) == 2
        assert not seen  # NOTE: refused before the model loads
        assert f"--weights {weights} needs --dtype float32, not float16" in capsys.readouterr().err
    bad = ["serve", "--port", port, "--max-wait-s", "0"]
    assert server.run_cli(build_parser().parse_args(bad)) == 2
    assert "max_wait_s must be > 0" in capsys.readouterr().err and not seen


def test_api_keys_from_repeated_flags_and_files(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# team keys\nfile-one\n\n  file-two  \nflag-one\n")
    args = argparse.Namespace(api_key=["flag-one", "flag-two"], api_key_file=[str(keys_file)])
    assert server.api_keys(args) == ["flag-one", "flag-two", "file-one", "file-two"]
    assert server.api_keys(argparse.Namespace(api_key="solo")) == ["solo"]


@pytest.mark.parametrize(
    ("content", "flags", "message"),
    [
        ("# only a comment\n", {}, "holds no API key"),
        ("good\nhas space-secret inside\n", {}, "line 2"),
        ("good\n", {"api_key": [""]}, "--api-key #1"),
        ("good\n", {"metrics_key": "a b"}, "--metrics-key"),
    ],
)
def test_bad_key_options_are_exit_2_without_echoing_keys(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    flags: dict[str, Any],
    message: str,
) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(content)
    args = serve_args(0)
    args.api_key_file = [str(keys_file)]
    for name, value in flags.items():
        setattr(args, name, value)
    assert server.run_cli(args) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "secret" not in captured.err and "good" not in captured.err
    assert "secret" not in captured.out and "good" not in captured.out


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        ("missing", "No such file or directory"),
        ("folder", "Is a directory"),
        ("empty", "holds no API key"),
        ("malformed", "line 2: a key must not contain whitespace"),
        ("binary", "keys.txt' is not UTF-8 text (byte 0)"),
        ("empty path", "--api-key-file is empty"),
    ],
)
def test_a_bad_key_file_is_one_line_and_exit_2_without_torch(
    tmp_path: Path, setup: str, says: str
) -> None:
    keys_file = tmp_path / "keys.txt"
    if setup == "folder":
        keys_file.mkdir()
    elif setup == "binary":
        keys_file.write_bytes(b"\xff\xfesecret\n")
    elif setup not in ("missing", "empty path"):
        keys_file.write_text({"empty": "# none\n", "malformed": "ok\nsecret with-space\n"}[setup])
    arg = "" if setup == "empty path" else str(keys_file)
    # NOTE: a None entry in sys.modules makes `import torch` fail, as if it were not installed:
    # the key file must be checked before torch loads (seconds; ~15 s on a busy machine).
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "from agentcache.cli import main\n"
        f"sys.exit(main(['serve', '--api-key-file', {arg!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentcache serve: bad API key option: ")
    assert says in lines[0] and "secret" not in lines[0], lines


def test_served_keys_never_reach_stdout_or_logs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("file-key-7f3a9\n")
    secrets = ["flag-key-1c2d", "flag-key-9e8f", "file-key-7f3a9", "metrics-key-55aa"]
    argv = ["serve", "--api-key", secrets[0], "--api-key", secrets[1]]
    argv += ["--api-key-file", str(keys_file), "--metrics-key", secrets[3]]
    args = build_parser().parse_args(argv)
    engine = Engine.from_pretrained("tiny")
    # NOTE: what ``run_cli`` serves, on a free port and in a thread (no signal handlers there).
    uv = server.make_server(args, engine, server.api_keys(args))
    sock = server.bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        while not uv.started and thread.is_alive():
            time.sleep(0.01)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # NOTE: httpx's default 5 s read timeout failed this once on a host loaded by other jobs
        client = httpx.Client(base_url=url, timeout=120)
        for key in secrets[:3]:
            ok = client.post("/v1/chat/completions", json=body, headers=_bearer(key))
            assert ok.status_code == 200, ok.text
        wrong = client.post("/v1/chat/completions", json=body, headers=_bearer("wrong-9x"))
        assert wrong.status_code == 401 and "wrong-9x" not in wrong.text
        assert client.get("/metrics", headers=_bearer(secrets[3])).status_code == 200
        assert client.get("/metrics", headers=_bearer(secrets[0])).status_code == 403
        client.close()
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()
        engine.close()
    out, err = capfd.readouterr()
    assert "3 API key(s) required" in out and "POST /v1/chat/completions" in out + err
    assert "'tiny' on http://" in out  # and what runs:
    assert "(float32, compact forward, native decode attention" in out  # then oneDNN, if chosen
    for secret in [*secrets, "wrong-9x"]:
        assert secret not in out + err


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_an_unusable_kv_disk_dir_is_named_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(Engine, "from_pretrained", _must_not_load)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for folder in (a_file, a_file / "below"):
        argv = ["serve", "--port", "1", "--kv-disk-dir", str(folder)]  # NOTE: never bound
        assert server.run_cli(build_parser().parse_args(argv)) == 2
        captured = capsys.readouterr()
        [line] = captured.err.splitlines()
        assert line.startswith(f"agentcache serve: --kv-disk-dir: cannot create '{folder}'")
        assert captured.out == ""


def test_a_damaged_weights_file_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tiny = ROOT / "runtime" / "models" / "tiny"
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        (tmp_path / name).write_bytes((tiny / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"garbage\n")  # safetensors raises its own type
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert server.run_cli(serve_args(port, model=str(tmp_path))) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith(f"agentcache serve: cannot load model '{tmp_path}': ")
    assert "safetensors" in lines[-1].lower() or "header" in lines[-1], lines
    assert "Traceback" not in "\n".join(lines)


def test_a_host_that_is_not_local_is_exit_3_with_a_host_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Engine, "from_pretrained", _must_not_load)
    args = serve_args(18998)
    args.host = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this machine
    assert server.run_cli(args) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("agentcache serve: cannot listen on 192.0.2.1:18998: ")
    assert line.endswith(
        "give --host a local address (such as 127.0.0.1, or 0.0.0.0 for every interface)"
    )
