"""Every way `agentcache demo` ends early: one line, the right status, nothing slow started.

Bad options exit 2 before the corpus or a model loads; Ctrl-C exits 130 without a traceback,
checked both in-process and with a real SIGINT sent to a subprocess.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from rich.console import Console

from agentcache import demo
from agentcache.backends.fake import FakeBackend, FakeTurn
from agentcache.backends.local import MARKUP_STOPS
from agentcache.backends.openai import OpenAIBackend
from agentcache.exceptions import BackendHTTPError
from tests.cli_process import CliProcess

BASE = "http://127.0.0.1:8000/v1"


def demo_args(tmp_path: Path, **overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "model": None, "base_url": None, "docs": None, "interactive": False, "max_tokens": 4,
        "cache_dir": str(tmp_path / "cache"), "question": None,
    }  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def docs_folder(tmp_path: Path) -> str:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.md").write_text("# Logs\n\nRotate the logs with logrotate every week.\n")
    return str(docs)


@pytest.fixture
def nothing_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the demo reads a corpus or builds a backend."""

    def refuse(*args: Any) -> Any:
        raise AssertionError("bad options must be rejected before slow work starts")

    monkeypatch.setattr(demo, "load_corpus", refuse)
    monkeypatch.setattr(demo, "make_backend", refuse)
    monkeypatch.delenv("AGENTCACHE_BASE_URL", raising=False)


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line, read from stderr (nothing of it on stdout)."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentcache demo: "), captured.err
    assert "agentcache demo:" not in captured.out, captured.out
    assert "Traceback" not in captured.out + captured.err
    return lines[0]


@pytest.mark.usefixtures("nothing_slow")
def test_cache_dir_under_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert demo.run(demo_args(tmp_path, cache_dir=str(blocker / "cache"))) == 2
    assert f"{str(blocker)!r} is a file" in one_line(capsys)


@pytest.mark.usefixtures("nothing_slow")
def test_model_name_typo_lists_the_bundled_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.run(demo_args(tmp_path, model="tinyy")) == 2
    line = one_line(capsys)
    assert "unknown model 'tinyy': did you mean 'tiny'? bundled models: tiny" in line


@pytest.mark.usefixtures("nothing_slow")
def test_docs_without_questions_off_a_terminal_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.run(demo_args(tmp_path, docs=docs_folder(tmp_path))) == 2
    assert "--question TEXT (repeatable) or --interactive" in one_line(capsys)


@pytest.mark.usefixtures("nothing_slow")
def test_empty_question_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.run(demo_args(tmp_path, question=["  "])) == 2
    assert "--question needs a non-empty text" in one_line(capsys)


@respx.mock
def test_agentcache_base_url_is_the_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTCACHE_BASE_URL", BASE)
    monkeypatch.delenv("AGENTCACHE_MODEL", raising=False)
    respx.get(f"{BASE}/models").mock(return_value=httpx.Response(200, json={"data": [{"id": "m"}]}))
    backend = demo.make_backend(demo_args(tmp_path))
    assert isinstance(backend, OpenAIBackend) and backend.base_url == BASE
    assert demo.describe(backend, demo_args(tmp_path)).startswith(f"model: m at {BASE}")


@respx.mock
def test_a_401_says_which_key_to_set_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AGENTCACHE_MODEL", raising=False)
    respx.get(f"{BASE}/models").mock(
        return_value=httpx.Response(401, json={"error": {"message": "invalid or missing API key"}})
    )
    args = demo_args(tmp_path, base_url=BASE, docs=docs_folder(tmp_path), question=["q"])
    assert demo.run(args) == 2
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert "HTTP 401" in err and "set AGENTCACHE_API_KEY (or OPENAI_API_KEY)" in err
    assert err.count("\n") == 1 and "agentcache demo:" not in out
    assert "Traceback" not in out + err
    # NOTE: an endpoint loads no torch, and naming a model does not cure a refused key.
    assert f"connecting to {BASE}..." in out and "loading torch" not in out
    assert "pass a model name" not in out + err


def run_with_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, turn: FakeTurn) -> int:
    backend = FakeBackend([turn], model="tiny", tool_call_format="hermes")
    monkeypatch.setattr(demo, "make_backend", lambda args: backend)
    args = demo_args(tmp_path, docs=docs_folder(tmp_path), question=["How to rotate logs?"])
    return demo.run(args)


def test_a_configuration_error_found_in_a_turn_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = BackendHTTPError("x answered HTTP 403: no", status_code=403, body="no")
    assert run_with_turn(tmp_path, monkeypatch, refused) == 2
    assert "the endpoint refused the API key" in one_line(capsys)


def test_a_failing_turn_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = BackendHTTPError("x answered HTTP 500: boom", status_code=500, body="boom")
    assert run_with_turn(tmp_path, monkeypatch, broken) == 1
    assert "HTTP 500: boom" in one_line(capsys)


def test_ctrl_c_in_a_turn_exits_130_and_closes_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    closed: list[bool] = []
    monkeypatch.setattr(FakeBackend, "close", lambda self: closed.append(True))
    assert run_with_turn(tmp_path, monkeypatch, KeyboardInterrupt()) == 130
    captured = capsys.readouterr()
    # NOTE: the "interrupted" line ends the transcript on stdout (the answer may be mid-line).
    assert "interrupted" in captured.out and "Traceback" not in captured.out + captured.err
    assert closed == [True]


# ----------------------------------------------------------------------------- real SIGINT


def start_demo(tmp_path: Path, *options: str) -> CliProcess:
    cache = str(tmp_path / "cache")
    argv = ["demo", "--model", "tiny", "--docs", docs_folder(tmp_path), "--cache-dir", cache,
            *options]  # fmt: skip
    return CliProcess(*argv, cwd=tmp_path)


@pytest.mark.slow
def test_sigint_at_the_interactive_prompt_exits_130_quietly(tmp_path: Path) -> None:
    with start_demo(tmp_path, "--interactive") as process:
        seen = process.wait_for("Ctrl-C stops)> ")
        assert "Ctrl-D ends" in seen
        assert process.interrupt() == 130, process.text("stderr")
        assert "Traceback" not in process.text("stderr")


@pytest.mark.slow
def test_sigint_during_a_turn_exits_130_quietly(tmp_path: Path) -> None:
    questions = [part for _ in range(30) for part in ("--question", "How to rotate the logs?")]
    with start_demo(tmp_path, "--max-tokens", "64", *questions) as process:
        process.wait_for("Q: How to rotate")
        assert process.interrupt() == 130, process.text("stderr")
        assert "Traceback" not in process.text("stderr")


def test_the_default_model_behind_a_server_answers_from_retrieved_sources(tmp_path: Path) -> None:
    """``smollm2-135m`` behind ``agentcache serve`` is the same 135M model as on the local engine:
    it retrieves first and stops at the document markup; another remote model calls tools."""
    ours = OpenAIBackend(demo.DEFAULT_MODEL, base_url=BASE)
    assert demo.retrieves_first(ours)
    assert demo._stops(ours) == ("\n\n", *MARKUP_STOPS)
    assert "sources retrieved before each question" in demo.describe(ours, demo_args(tmp_path))
    other = OpenAIBackend("gpt-4o-mini", base_url=BASE)
    assert not demo.retrieves_first(other) and demo._stops(other) == ()
    assert "calls a tool first" in demo.describe(other, demo_args(tmp_path))


def test_an_answer_starts_on_its_label_line() -> None:
    """Leading whitespace of a streamed answer is not printed; the rest is, as it came."""
    out = io.StringIO()
    written: list[str] = []
    write = demo._answer_writer(Console(file=out, width=80), written)
    for delta in ("\n", " \n The", " answer\n\nends."):
        write(delta)
    assert out.getvalue() == "The answer\n\nends."
    assert "".join(written) == "\n \n The answer\n\nends."
