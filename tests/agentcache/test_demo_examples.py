"""End to end: `agentcache demo` on a random-weight Llama, and the examples on the fake backend."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from agentcache import demo
from agentcache.backends import ToolCall
from agentcache.backends.fake import FakeBackend

ROOT = Path(__file__).resolve().parents[2]


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_with_tools_example(capsys: pytest.CaptureFixture[str]) -> None:
    answers = load_example("agent_with_tools").main(FakeBackend(default="Seven words."))
    assert answers == ["Seven words.", "Seven words."]
    assert "tool cache hits=1" in capsys.readouterr().out


def test_local_rag_example(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("The abc module provides abstract base classes.")
    backend = FakeBackend(default="From [x].")
    assert load_example("local_rag").main(backend, folder=str(tmp_path)) == ["From [x]."] * 2
    tool_results = [m for m in backend.prompts[0].to_messages() if m["role"] == "tool"]
    assert "abstract base classes" in str(tool_results[0]["content"])


def test_remote_endpoint_example_runs_the_models_tool_call() -> None:
    backend = FakeBackend([ToolCall("c1", "python_version", "{}"), "It is 3.x."])
    assert load_example("remote_endpoint").main(backend) == "It is 3.x."
    assert backend.prompts[1].to_messages()[-1]["content"] == ".".join(
        map(str, sys.version_info[:3])
    )


def test_plan_reads_named_objects() -> None:
    assert demo.plan("What does functools.lru_cache do?") == [
        ("search_docs", {"query": "What does functools.lru_cache do?"}),
        ("read_doc", {"name": "functools.lru_cache"}),
    ]


def demo_args(tmp_path: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "model": None, "base_url": None, "docs": None, "interactive": False, "max_tokens": 4,
        "cache_dir": str(tmp_path / "cache"),
    }  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def no_backend(args: Any) -> Any:
    raise AssertionError("bad options must be rejected before a model is loaded")


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_demo_rejects_max_tokens_below_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    max_tokens: int,
) -> None:  # fmt: skip
    monkeypatch.setattr(demo, "make_backend", no_backend)
    assert demo.run(demo_args(tmp_path, max_tokens=max_tokens)) == 2
    out = capsys.readouterr().out
    assert f"--max-tokens must be at least 1, got {max_tokens}" in out
    assert "Traceback" not in out


def test_demo_with_an_empty_docs_folder_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "make_backend", no_backend)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "blank.md").write_text("  \n")
    assert demo.run(demo_args(tmp_path, docs=str(docs))) == 2
    out = capsys.readouterr().out
    assert "skipped 1 file(s): blank.md (empty)" in out
    assert "no readable, non-empty .md/.txt/.py files under" in out


def test_demo_with_a_missing_docs_folder_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "make_backend", no_backend)
    assert demo.run(demo_args(tmp_path, docs=str(tmp_path / "nope"))) == 2
    assert "does not exist" in capsys.readouterr().out


def test_demo_reports_skipped_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_bytes(b"\xff\xfe not utf-8")
    for name in ("b.md", "c.md", "d.md"):
        (docs / name).write_text("")
    (docs / "ok.md").write_text("The json module parses JSON.")
    console = Console(record=True, width=200)
    sources = demo.load_corpus(str(docs), console)
    assert [s.source for s in sources] == ["ok.md"]
    text = console.export_text()
    assert (
        "skipped 4 file(s): a.txt (not valid UTF-8), b.md (empty), c.md (empty) and 1 more" in text
    )


@pytest.mark.slow
def test_demo_end_to_end_on_a_random_llama(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    from agentcache.backends.local import LocalBackend
    from tests.agentcache._tiny_llama import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "model", seed=3)
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("json", "functools", "csv"):
        (docs / f"{name}.md").write_text(f"# {name}\n\nThe {name} module. " * 40)
    monkeypatch.setattr(demo, "make_backend", lambda args: LocalBackend(str(model_dir)))
    args: Any = argparse.Namespace(
        model="tiny", base_url=None, docs=str(docs), interactive=False, max_tokens=4,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert demo.run(args) == 0
    first = capsys.readouterr().out
    turns = re.findall(r"turn (\d): prompt (\d+) tok, cached (\d+)", first)
    assert len(turns) == 4 and int(turns[0][2]) == 0
    assert all(int(cached) > 0 for _, _, cached in turns[1:])
    assert "retrieval cache 1 hit" in first  # question 4 repeats question 1
    assert demo.run(args) == 0
    second = capsys.readouterr().out
    # A second process-level run reads the persistent retrieval and tool caches.
    assert re.findall(r"retrieval cache (\d) hit/0 miss", second) == ["1", "1", "1", "1"]
    assert "tool cache 1 hit/0 miss" in second
