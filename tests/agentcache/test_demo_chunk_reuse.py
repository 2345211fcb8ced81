"""``agentcache demo --chunk-reuse {exact,blend}``: options, turn line, summary, one real run.

Chunk reuse is opt-in and local only: an endpoint with the flag exits 2 in one line before any
corpus, torch or model loads. Chunk-reused tokens are shown apart from prefix-cached ones, with
the mode's label (blend is approximate; exact differs from a full prefill on a model not trained
with block attention).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentcache import demo
from agentcache._demo_report import (
    CHUNK_LABELS,
    TurnReport,
    chunk_line,
    print_summary,
    print_turn,
    summary_line,
)
from agentcache.usage import Usage

BASE = "http://127.0.0.1:8000/v1"


def demo_args(tmp_path: Path, **overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "model": None, "base_url": None, "docs": None, "interactive": False, "max_tokens": 4,
        "cache_dir": str(tmp_path / "cache"), "question": None, "chunk_reuse": None,
    }  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def chunk_report(
    *, prompt: int, cached: int, reused: int | None, mode: str | None = "blend",
    ttft_s: float = 0.2, cold_ttft_s: float | None = 0.3,
) -> TurnReport:  # fmt: skip
    usage = Usage(
        prompt_tokens=prompt, cached_tokens=cached, ttft_s=ttft_s,
        chunk_reused_tokens=reused, chunk_reuse_mode=mode if reused is not None else None,
    )  # fmt: skip
    return TurnReport("q", usage, 1.0, [], 0, 0, 0, 0, cold_ttft_s=cold_ttft_s)


def refuse(*args: Any) -> Any:
    raise AssertionError("bad options must be rejected before slow work starts")


# --- options -------------------------------------------------------------------------------------


@pytest.mark.parametrize("via_env", [False, True])
def test_chunk_reuse_with_an_endpoint_exits_2_in_one_line_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    via_env: bool,
) -> None:  # fmt: skip
    monkeypatch.setattr(demo, "load_corpus", refuse)
    monkeypatch.setattr(demo, "make_backend", refuse)
    if via_env:
        monkeypatch.setenv("AGENTCACHE_BASE_URL", BASE)
        args = demo_args(tmp_path, chunk_reuse="blend")
    else:
        monkeypatch.delenv("AGENTCACHE_BASE_URL", raising=False)
        args = demo_args(tmp_path, chunk_reuse="blend", base_url=BASE)
    assert demo.run(args) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"agentcache demo: --chunk-reuse blend needs the local engine, but the demo would use "
        f"the endpoint {BASE!r}: drop --chunk-reuse, or drop --base-url and unset "
        "AGENTCACHE_BASE_URL"
    ]
    assert captured.out == ""


def run_cli(
    tmp_path: Path, *argv: str, base_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``agentcache demo ARGV`` in a child where torch and transformers cannot be imported."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "from agentcache.cli import main\n"
        f"sys.exit(main(['demo', *{list(argv)!r}]))\n"
    )
    env = {**os.environ, "AGENTCACHE_CACHE_DIR": str(tmp_path)}
    env.pop("AGENTCACHE_BASE_URL", None)
    if base_url is not None:
        env["AGENTCACHE_BASE_URL"] = base_url
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_cli_chunk_reuse_with_agentcache_base_url_exits_2_without_torch(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "--chunk-reuse", "exact", base_url=BASE)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "--chunk-reuse exact needs the local engine" in lines[0], lines
    assert lines[0].startswith("agentcache demo: ") and done.stdout == ""


def test_cli_unknown_chunk_reuse_mode_exits_2_in_one_line_naming_the_modes(tmp_path: Path) -> None:
    # As the demo's other options (--max-tokens 0, --model): one line, no argparse usage block.
    done = run_cli(tmp_path, "--chunk-reuse", "blned")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "agentcache demo: --chunk-reuse must be exact or blend, got 'blned'"
    ]
    assert done.stdout == ""  # NOTE: and so no usage block, no traceback


def test_cli_without_the_flag_leaves_chunk_reuse_off() -> None:
    from agentcache.cli import build_parser

    assert build_parser().parse_args(["demo"]).chunk_reuse is None
    parsed = build_parser().parse_args(["demo", "--chunk-reuse", "blend"])
    assert parsed.chunk_reuse == "blend"


# --- turn line and summary -----------------------------------------------------------------------


def test_turn_line_shows_chunk_reused_tokens_apart_from_cached_ones_with_the_mode() -> None:
    console = Console(record=True, width=400)
    report = chunk_report(prompt=2000, cached=96, reused=339, ttft_s=0.2, cold_ttft_s=0.5)
    print_turn(console, 2, report, chunk_report(prompt=1600, cached=0, reused=0))
    line = console.export_text()
    assert "turn 2: 96 of 2000 prompt tokens cached (4.8%), from turn 1's 1600-token prompt" in line
    assert f"chunk store reused 339 document tokens ({CHUNK_LABELS['blend']})" in line
    assert "approximate" in CHUNK_LABELS["blend"]
    assert "prefill computed 1565 tokens" in line  # 2000 - 96 cached - 339 reused
    assert "(2.5x faster)" in line


def test_exact_label_says_answers_differ_from_a_full_prefill() -> None:
    console = Console(record=True, width=400)
    print_turn(console, 1, chunk_report(prompt=900, cached=0, reused=0, mode="exact"))
    line = console.export_text()
    assert (
        "chunk store reused 0 document tokens (exact block mask: answers differ from a full "
        in line
    )
    assert "; each document computed alone and stored for later turns" in line
    assert line.count("first turn") == 1  # NOTE: said once, in the cached part


def test_a_slower_turn_says_slower_not_a_fraction_faster() -> None:
    console = Console(record=True, width=400)
    report = chunk_report(prompt=2000, cached=96, reused=339, ttft_s=0.7, cold_ttft_s=0.5)
    print_turn(console, 2, report)
    line = console.export_text()
    assert "(1.4x slower)" in line and "faster" not in line
    reports = [chunk_report(prompt=900, cached=0, reused=0), report]
    assert summary_line(reports) == (
        "prefix cache + chunk store (blend): turn 2 reached the first token 1.4x slower (median) "
        "than the same prompts with the cache forced off"
    )


def test_summary_totals_chunk_reused_tokens_and_the_table_has_a_chunk_column() -> None:
    reports = [
        chunk_report(prompt=900, cached=0, reused=0),
        chunk_report(prompt=1000, cached=96, reused=339),
        chunk_report(prompt=1200, cached=96, reused=300),
    ]
    assert chunk_line(reports) == (
        f"chunk store: 639 document tokens reused over 3 turn(s) ({CHUNK_LABELS['blend']}), "
        "apart from 192 prefix-cached, of 3100 prompt tokens in all"
    )
    console = Console(record=True, width=80)
    print_summary(console, reports, wall_s=1.0)
    text = console.export_text()
    header = next(line.split() for line in text.splitlines() if line.split()[:1] == ["turn"])
    assert header[:4] == ["turn", "prompt", "cached", "chunk"] and header[-1] == "tools"
    rows = [line.split() for line in text.splitlines() if line.strip()[:2] in {"2 ", "3 "}]
    assert [row[3] for row in rows] == ["339", "300"]
    assert "chunk store: 639 document tokens reused" in text


def test_without_chunk_reuse_there_is_no_chunk_column_or_line() -> None:
    reports = [chunk_report(prompt=900, cached=0, reused=None, mode=None)]
    assert chunk_line(reports) is None
    console = Console(record=True, width=120)
    print_summary(console, reports, wall_s=1.0)
    assert "chunk" not in console.export_text()


# --- one real run on the bundled model ----------------------------------------------------------


@pytest.mark.slow
def test_demo_blend_on_the_bundled_model_serves_a_later_turn_from_the_assembled_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AGENTCACHE_BASE_URL", raising=False)
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("json", "functools", "csv"):
        (docs / f"{name}.md").write_text(
            f"# {name}\n\nThe {name} module reads and writes data. " * 6
        )
    questions = ["What does the json module do?", "What does the csv module do?"]
    args = demo_args(
        tmp_path, docs=str(docs), question=questions, max_tokens=2, chunk_reuse="blend"
    )
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert "chunk reuse: blend (approximate: answers may differ from a full prefill" in out
    turns = re.findall(
        r"turn (\d): (\d+) of (\d+) prompt tokens cached .*; chunk store reused (\d+) document "
        r"tokens \(blend: approximate[^)]*\)(?:; each document[^;]*)?; "
        r"prefill computed (\d+) tokens",
        out,
    )
    assert [t[0] for t in turns] == ["1", "2"], out
    for _, cached, prompt, reused, computed in turns:
        assert int(computed) == int(prompt) - int(cached) - int(reused)
    assert int(turns[0][3]) == 0  # nothing stored before turn 1
    # Turn 2 repeats turn 1's assembled opening (same pinned documents, same places): the prefix
    # cache serves all of it but the last partial block (16 tokens), documents included.
    assert int(turns[1][1]) >= int(turns[0][2]) - 16, out
    total = sum(int(t[3]) for t in turns)
    assert f"chunk store: {total} document tokens reused over 2 turn(s)" in out


def test_cli_weights_with_agentcache_base_url_exits_2_without_torch(tmp_path: Path) -> None:
    """``--weights`` sets the local engine's weights: with an endpoint it is refused, naming it."""
    done = run_cli(tmp_path, "--weights", "q4_1", base_url=BASE)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "--weights q4_1 needs the local engine" in lines[0], lines
    assert done.stdout == ""
