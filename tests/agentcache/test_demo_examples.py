"""End to end: `agentcache demo` on a random-weight Llama, and the examples on the fake backend."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import respx

from agentcache import demo
from agentcache._demo_report import TurnReport, print_summary, print_turn, summary_line
from agentcache.backends import ToolCall
from agentcache.backends.fake import FakeBackend
from agentcache.usage import Usage

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


def test_local_rag_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.md").write_text("The abc module provides abstract base classes.")
    backend = FakeBackend(default="From [x].")
    assert load_example("local_rag").main(backend, folder=str(tmp_path)) == ["From [x]."] * 3
    out = capsys.readouterr().out
    assert re.findall(r"retrieval cache (hit|miss)", out) == ["miss", "miss", "hit"]
    assert re.search(r"TTFT \d+\.\d ms;", out), out
    tool_results = [m for m in backend.prompts[0].to_messages() if m["role"] == "tool"]
    assert "abstract base classes" in str(tool_results[0]["content"])


def test_remote_endpoint_example_runs_the_models_tool_call(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = FakeBackend([ToolCall("c1", "python_version", "{}"), "It is now 3.x."])
    assert load_example("remote_endpoint").main(backend) == "It is now 3.x."
    assert backend.prompts[1].to_messages()[-1]["content"] == ".".join(
        map(str, sys.version_info[:3])
    )
    assert capsys.readouterr().out.splitlines()[0] == "It is now 3.x."  # streamed on one line


def test_remote_endpoint_example_reports_an_unreachable_endpoint_in_one_line(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "AGENTCACHE_BASE_URL": "http://127.0.0.1:1/v1"}
    env.pop("AGENTCACHE_MODEL", None)
    script = ROOT / "examples" / "remote_endpoint.py"
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("remote_endpoint: cannot reach http://127.0.0.1:1/v1/models")


def test_plan_reads_named_objects() -> None:
    assert demo.plan("What does functools.lru_cache do?") == [
        ("search_docs", {"query": "What does functools.lru_cache do?"}),
        ("read_doc", {"name": "functools.lru_cache"}),
    ]


def turn_report(
    *, ttft_s: float, cold_ttft_s: float | None = None, prompt: int = 100, cached: int = 0
) -> TurnReport:
    usage = Usage(prompt_tokens=prompt, cached_tokens=cached, ttft_s=ttft_s)
    return TurnReport("q", usage, 1.0, [], 0, 0, 0, 0, cold_ttft_s=cold_ttft_s)


def demo_args(tmp_path: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "model": "tiny", "base_url": None, "docs": None, "interactive": False, "max_tokens": 4,
        "cache_dir": str(tmp_path / "cache"), "question": None,
    }  # fmt: skip
    if overrides.get("base_url"):
        values["model"] = None  # NOTE: an endpoint's model comes from AGENTCACHE_MODEL or /models
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
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"agentcache demo: --max-tokens must be at least 1, got {max_tokens}"
    ]
    assert captured.out == ""


def test_demo_with_an_empty_docs_folder_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "make_backend", no_backend)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "blank.md").write_text("  \n")
    assert demo.run(demo_args(tmp_path, docs=str(docs), question=["q"])) == 2
    captured = capsys.readouterr()
    # NOTE: the skipped-files warning and the error both go to stderr, none to stdout.
    [skipped, error] = captured.err.splitlines()
    assert skipped == "skipped 1 file(s): blank.md (empty)"
    assert error.startswith("agentcache demo: no readable, non-empty .md/.txt/.py files under")
    assert captured.out == ""


def test_demo_with_a_missing_docs_folder_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "make_backend", no_backend)
    assert demo.run(demo_args(tmp_path, docs=str(tmp_path / "nope"), question=["q"])) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith("agentcache demo: ") and "does not exist" in line
    assert captured.out == ""


def test_demo_keeps_a_long_cache_path_on_the_line_of_its_label(tmp_path: Path) -> None:
    from rich.console import Console

    from agentcache.rag import TextSource

    cache_dir = tmp_path / "a-rather-long-cache-folder-name" / "agentcache"
    console = Console(record=True, width=60)
    sources = [TextSource("notes.txt", "The kettle boils at noon. " * 4)]
    demo.build_session(
        demo_args(tmp_path, cache_dir=str(cache_dir)), FakeBackend(), sources, console
    )
    [line] = console.export_text().splitlines()
    assert line.startswith("indexed 1 texts -> ") and line.endswith(f"; caches in {cache_dir}")


def test_demo_turn_line_compares_the_same_prompt_with_the_cache_off() -> None:
    from rich.console import Console

    report = turn_report(ttft_s=0.098, cold_ttft_s=0.310, prompt=2000, cached=1800)
    console = Console(record=True, width=300)
    print_turn(console, 2, report, turn_report(ttft_s=0.3, prompt=1790))
    line = console.export_text()
    assert "turn 2: 1800 of 2000 prompt tokens cached (90.0%) = turn 1's prompt (1790) + " in line
    assert "prefill computed 200 tokens; TTFT 98 ms vs 310 ms for the same prompt with the " in line
    assert "cache off (3.2x faster)" in line


def test_demo_turn_line_without_reuse_shows_no_speedup() -> None:
    from rich.console import Console

    console = Console(record=True, width=300)
    print_turn(console, 1, turn_report(ttft_s=0.3, cold_ttft_s=0.31, prompt=900, cached=0))
    line = console.export_text()
    assert "turn 1: 0 of 900 prompt tokens cached (0.0%): first turn, nothing to reuse yet" in line
    assert "TTFT 300 ms (nothing reused, so no cache-off comparison)" in line
    assert "faster" not in line and "x" not in line.split("TTFT")[1].split(")")[0]


def test_demo_table_shows_no_cache_off_figures_where_the_turn_line_has_no_comparison() -> None:
    from rich.console import Console

    console = Console(record=True, width=300)
    reports = [
        turn_report(ttft_s=0.3, cold_ttft_s=0.31, prompt=900, cached=0),  # nothing reused
        turn_report(ttft_s=0.098, cold_ttft_s=0.310, prompt=2000, cached=1800),
    ]
    print_summary(console, reports, wall_s=1.0)
    rows = {line.split()[0]: line.split() for line in console.export_text().splitlines()
            if line.strip()[:1] in {"1", "2"}}  # fmt: skip
    assert rows["1"][4:7] == ["300", "—", "—"]  # TTFT, TTFT off, speedup
    assert rows["2"][4:7] == ["98", "310", "3.2x"]


def test_demo_turn_line_explains_reuse_within_the_previous_prompt() -> None:
    from rich.console import Console

    console = Console(record=True, width=300)
    report = turn_report(ttft_s=0.1, cold_ttft_s=0.2, prompt=1000, cached=512)
    print_turn(console, 3, report, turn_report(ttft_s=0.1, prompt=520))
    assert "from turn 2's 520-token prompt (reused in whole blocks)" in console.export_text()


def test_demo_turn_line_counts_the_answer_tokens_kept_past_the_previous_prompt() -> None:
    from rich.console import Console

    # NOTE: the cache keeps whole blocks, so 2032 cached after a 2030-token prompt and a 4-token
    # answer is the prompt + 2 answer tokens, not "+ its answer".
    console = Console(record=True, width=300)
    report = turn_report(ttft_s=0.1, cold_ttft_s=0.2, prompt=2455, cached=2032)
    print_turn(console, 3, report, turn_report(ttft_s=0.1, prompt=2030))
    assert "= turn 2's prompt (2030) + 2 tokens of its answer, kept" in console.export_text()


def test_demo_summary_uses_same_prompt_ratios_of_later_turns_only() -> None:
    reports = [
        turn_report(ttft_s=0.100, cold_ttft_s=0.100),  # turn 1: nothing cached, left out
        turn_report(ttft_s=0.300, cold_ttft_s=0.600, cached=64),  # 2.0x, slower than turn 1
        turn_report(ttft_s=0.100, cold_ttft_s=0.400, cached=64),  # 4.0x
        turn_report(ttft_s=0.200, cold_ttft_s=0.600, cached=64),  # 3.0x
    ]
    assert summary_line(reports) == (
        "prefix cache: turns 2-4 reached the first token 3.0x faster (median) than the same "
        "prompts with the cache forced off"
    )


def test_demo_summary_without_cache_off_runs_claims_no_speedup() -> None:
    reports = [turn_report(ttft_s=0.5), turn_report(ttft_s=0.1)]
    assert "needs the local engine" in summary_line(reports)
    assert "faster" not in summary_line(reports)


BASE = "http://127.0.0.1:8000/v1"


@respx.mock
def test_demo_base_url_uses_the_endpoints_model_and_no_toy_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGENTCACHE_MODEL", raising=False)
    respx.get(f"{BASE}/models").mock(
        return_value=httpx.Response(200, json={"data": [{"id": "qwen2.5-7b"}]})
    )
    args = demo_args(tmp_path, base_url=BASE)
    backend = demo.make_backend(args)
    assert backend.model == "qwen2.5-7b" and not demo.is_toy(backend)
    note = demo.describe(backend, args)
    assert note == f"model: qwen2.5-7b at {BASE} (the model calls a tool first, then answers)"
    assert "tiny" not in note


def test_demo_base_url_prefers_model_option_then_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTCACHE_MODEL", "from-env")
    assert demo.make_backend(demo_args(tmp_path, base_url=BASE)).model == "from-env"
    args = demo_args(tmp_path, base_url=BASE, model="explicit")
    assert demo.make_backend(args).model == "explicit"


def test_demo_unreachable_base_url_exits_2_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AGENTCACHE_MODEL", raising=False)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The json module.")
    args = demo_args(tmp_path, base_url="http://127.0.0.1:1/v1", docs=str(docs), question=["q"])
    assert demo.run(args) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith("agentcache demo: cannot reach http://127.0.0.1:1/v1/models")
    assert "agentcache demo:" not in captured.out and "Traceback" not in captured.out


def test_demo_reports_skipped_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_bytes(b"\xff\xfe not utf-8")
    for name in ("b.md", "c.md", "d.md"):
        (docs / name).write_text("")
    (docs / "ok.md").write_text("The json module parses JSON.")
    console = Console(record=True, width=200)
    errors = Console(record=True, width=200)
    sources = demo.load_corpus(str(docs), console, errors)
    assert [s.source for s in sources] == ["ok.md"]
    assert errors.export_text().splitlines() == [
        "skipped 4 file(s): a.txt (not valid UTF-8), b.md (empty), c.md (empty) and 1 more"
    ]
    assert console.export_text() == ""  # NOTE: a warning, not part of the demo's output


@pytest.mark.slow
def test_demo_end_to_end_on_a_random_llama(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    bpe_llama_dir: Path,
) -> None:
    from agentcache.backends.local import LocalBackend

    model_dir = bpe_llama_dir
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("json", "functools", "csv"):
        (docs / f"{name}.md").write_text(f"# {name}\n\nThe {name} module. " * 40)
    from runtime import Engine

    engine = Engine.from_pretrained(str(model_dir))
    # NOTE: labelled "tiny" so the demo treats it as the toy model (deterministic planner).
    monkeypatch.setattr(demo, "make_backend", lambda args: LocalBackend("tiny", engine=engine))
    args = demo_args(tmp_path, docs=str(docs), question=list(demo.QUESTIONS))
    assert demo.run(args) == 0
    first = capsys.readouterr().out
    assert demo.TOY_NOTE.split()[0] in first
    turns = re.findall(
        r"turn (\d): (\d+) of (\d+) prompt tokens cached .*; prefill computed (\d+) tokens; "
        r"TTFT \d+ ms",
        first,
    )
    assert len(turns) == 4 and int(turns[0][1]) == 0
    for _, cached, prompt, computed in turns:
        assert int(computed) == int(prompt) - int(cached)
    assert all(int(cached) > 0 for _, cached, _, _ in turns[1:])
    assert "first turn, nothing to reuse yet" in first
    assert "retrieval cache 1 hit" in first  # question 4 repeats question 1
    assert "prefix cache: turns 2-4 reached the first token" in first
    assert demo.run(args) == 0
    second = capsys.readouterr().out
    # A second process-level run reads the persistent retrieval and tool caches.
    assert re.findall(r"retrieval cache (\d) hit / 0 miss", second) == ["1", "1", "1", "1"]
    assert "tool cache 1 hit / 0 miss" in second


def test_demo_read_doc_never_answers_from_another_corpus(tmp_path: Path) -> None:
    from rich.console import Console

    from agentcache.rag import TextSource

    args = argparse.Namespace(cache_dir=str(tmp_path / "cache"), max_tokens=8)
    answers = []
    for text in ("Corpus one says hello.", "Corpus two says goodbye."):
        sources = [TextSource("json", text), TextSource("csv", "Comma separated values.")]
        session = demo.build_session(args, FakeBackend(["ok"]), sources, Console(quiet=True))
        call = ToolCall("r1", "read_doc", '{"name": "json"}')
        answers.append(session.agent.registry.run(call).content)
    assert answers == ["Corpus one says hello.", "Corpus two says goodbye."]


@pytest.mark.slow
def test_shared_redis_workers_example_shares_one_tool_run_per_tenant(
    redis_url: str, byte_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime import Engine
    from runtime.serve.app import create_app
    from runtime.serve.server_thread import ServerThread

    engine = Engine.from_pretrained(str(byte_llama_dir), kv_cache_bytes=8 << 20)
    try:
        with ServerThread(create_app(engine)) as url:
            monkeypatch.setenv("AGENTCACHE_REDIS_URL", redis_url)
            monkeypatch.setenv("AGENTCACHE_BASE_URL", f"{url}/v1")
            monkeypatch.delenv("AGENTCACHE_MODEL", raising=False)
            lines = load_example("shared_redis_workers").main(num_workers=4)
    finally:
        engine.close()
    notes: dict[str, set[str]] = {}
    for line in lines:
        found = re.fullmatch(r"(\w+)/s\d: tool +\d+ ms \[(.+)\] cached=\d+", line)
        assert found, line
        notes.setdefault(found[1], set()).add(found[2])
    # One tool run per tenant, shared by both of its workers; never across tenants. NOTE: a run is
    # told apart by the pid that made it: the two tenants' runs start together and can end in the
    # same millisecond (their timestamps were equal in a fresh-clone CI run).
    assert sorted(notes) == ["acme", "globex"] and all(len(n) == 1 for n in notes.values())
    assert notes["acme"] != notes["globex"]


def test_demo_read_doc_finds_objects_of_dotted_modules() -> None:
    from agentcache.rag import DocumentIndex, TextSource

    sources = [
        TextSource("json", "json\n\nJSON encoder and decoder."),
        TextSource("json.decoder:JSONDecoder", "json.decoder.JSONDecoder\n\nSimple decoder."),
        TextSource("json:loads", "json.loads\n\nDeserialize s."),
    ]
    from agentcache.rag.chunking import chunk_sources

    tools = demo.DocTools(
        DocumentIndex(chunk_sources(sources)), {s.source: s.text for s in sources}
    )
    assert tools.read_doc("json.decoder.JSONDecoder").endswith("Simple decoder.")
    assert tools.read_doc("json.loads").endswith("Deserialize s.")
    assert tools.read_doc("json").endswith("JSON encoder and decoder.")
    assert tools.read_doc("json.nope") == "no docstring for 'json.nope'"


def fits_the_bundled_model(prompt: Any, max_tokens: int) -> tuple[int, int]:
    """(prompt tokens + max_tokens, context) of ``prompt`` rendered as the local backend does."""
    from transformers import AutoConfig, AutoTokenizer

    from runtime.models import resolve_model

    folder = resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        prompt.to_messages(), tools=prompt.tool_schemas() or None, add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    context = AutoConfig.from_pretrained(folder).max_position_embeddings
    return len(tokenizer.encode(text, add_special_tokens=False)) + max_tokens, context


@pytest.mark.slow
def test_the_built_in_questions_bring_their_named_objects_docstrings_and_fit_the_model(
    tmp_path: Path,
) -> None:
    from rich.console import Console

    from agentcache.rag.stdlib import stdlib_sources

    corpus = stdlib_sources()
    docstrings = {s.source: s.text for s in corpus}
    from agentcache.cli import build_parser

    max_tokens = build_parser().parse_args(["demo"]).max_tokens  # the demo's default
    answer = "the list of " * 16  # NOTE: a full-length answer kept in the history.
    backend = FakeBackend(model="tiny", tool_call_format="hermes", default=answer)
    args = demo_args(tmp_path, max_tokens=max_tokens)
    session = demo.build_session(args, backend, corpus, Console(quiet=True))
    for question in demo.QUESTIONS:
        named = re.findall(r"\b([a-z_]\w*(?:\.[A-Za-z_]\w*)+)", question)
        assert len(named) == 1, f"a built-in question names one stdlib object: {question!r}"
        module, _, attr = named[0].rpartition(".")
        source = f"{module}:{attr}"
        assert source in docstrings, f"{source} has no docstring in the demo's corpus"
        report = demo.ask(session, question, lambda text: None)
        # NOTE: the search's own results hold the object's chunk (not only read_doc's answer).
        assert source in report.sources, (question, report.sources)
        found = next(c for c in session.tools.retrieved if c.source == source)
        assert found.text.startswith(named[0])
        messages = backend.prompts[-1].to_messages()
        results = [str(m["content"]) for m in messages[-3:] if m["role"] == "tool"]
        assert any(found.text in content for content in results)  # searched
        assert docstrings[source] in results  # read in full
    used, context = fits_the_bundled_model(backend.prompts[-1], max_tokens)
    assert used <= context, f"turn {len(demo.QUESTIONS)} needs {used} of {context} tokens"
