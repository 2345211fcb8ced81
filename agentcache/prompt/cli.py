"""``agentcache lint FILE`` and ``agentcache diff A B`` on JSON request bodies.

Exit codes: 0 clean (lint: no warnings, info findings are printed; diff: identical or B extends
A), 1 warnings or divergence, 2 bad input (missing file, invalid JSON, not a chat body) with a
one-line message and never a traceback. Output is a rich table readable at 80 columns (lint
ends with a line saying which severity set the exit status), or one JSON object with ``--json``.
Argument parsing lives in ``agentcache/cli.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentcache.exceptions import PromptError
from agentcache.prompt.diff import diff
from agentcache.prompt.lint import Finding, lint

__all__ = ["run_diff", "run_lint"]


class _BadInput(Exception):
    pass


def _load(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise _BadInput(f"no such file: {path}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise _BadInput(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise _BadInput(f"{path} is not valid JSON: {exc.msg} (line {exc.lineno})") from exc
    except RecursionError as exc:
        raise _BadInput(f"{path} is {_TOO_DEEP}") from exc
    if not isinstance(data, dict):
        raise _BadInput(f"{path}: expected a JSON object (an OpenAI or Anthropic request body)")
    return data


_TOO_DEEP = "nested too deeply to read (arrays/objects past Python's recursion limit)"


def _fail(command: str, message: str) -> int:
    print(f"agentcache {command}: {message}", file=sys.stderr)
    return 2


def run_lint(args: argparse.Namespace) -> int:
    """Lint one request body; print findings; exit 0 (no warnings), 1 (warnings), 2 (bad input)."""
    try:
        findings = lint(_load(args.file))
    except (_BadInput, PromptError) as exc:
        return _fail("lint", str(exc))
    except RecursionError:  # NOTE: a tool schema a few hundred levels deep; was a traceback
        return _fail("lint", f"{args.file} is {_TOO_DEEP}")
    status = 1 if any(f.severity == "warning" for f in findings) else 0
    if args.json:
        print(json.dumps({"file": args.file, "findings": [f.to_dict() for f in findings]}))
        return status
    console = Console(soft_wrap=False)
    if not findings:
        console.print(f"[green]{args.file}: no prefix-cache hazards found[/green]", soft_wrap=True)
        return 0
    console.print(_findings_table(args.file, findings))
    console.print(_lint_verdict(findings, status), soft_wrap=True)
    return status


_SEVERITY_STYLE = {"warning": "bold red", "info": "yellow"}


def _findings_table(file: str, findings: list[Finding]) -> Table:
    """Severity, code and one wrapped column with the message, where, and the fix (fits 80)."""
    table = Table(title=f"{file}: {len(findings)} finding(s)", show_lines=True, expand=False)
    table.add_column("severity", no_wrap=True)
    table.add_column("code", no_wrap=True)
    table.add_column("finding (where) and fix", overflow="fold", ratio=1)
    for f in sorted(findings, key=lambda f: (f.severity != "warning", f.offset)):
        where = f"{f.segment} / {f.part}, byte {f.offset}"
        text = Text(f.message)
        text.append(f"\nat {where}", style="dim")
        text.append(f"\nfix: {f.hint}", style="green")
        table.add_row(Text(f.severity, style=_SEVERITY_STYLE[f.severity]), f.code, text)
    return table


def _lint_verdict(findings: list[Finding], status: int) -> str:
    warnings = sum(f.severity == "warning" for f in findings)
    infos = len(findings) - warnings
    if status:
        return (
            f"exit 1: {warnings} warning(s) break the prefix cache; "
            f"{infos} info finding(s) only reduce it"
        )
    return f"exit 0: {infos} info finding(s) reduce caching but break nothing (no warnings)"


def run_diff(args: argparse.Namespace) -> int:
    """Diff two request bodies; return 0 (identical or extension), 1 (divergence), 2 (bad input)."""
    try:
        result = diff(_load(args.a), _load(args.b), show_content=args.show_content)
    except (_BadInput, PromptError) as exc:
        return _fail("diff", str(exc))
    except RecursionError:
        return _fail("diff", f"{args.a} or {args.b} is {_TOO_DEEP}")
    if args.json:
        print(json.dumps(result.to_dict()))
        return 1 if result.is_divergent else 0
    console = Console(soft_wrap=True)
    if not result.is_divergent:
        console.print(f"[green]prefix kept:[/green] {result.reason}")
        return 0
    if result.segment is None:
        # NOTE: e.g. an OpenAI body against an Anthropic one: no part to point at.
        console.print(f"[red]diverges[/red] ({result.change})", markup=True)
        console.print(f"  {result.reason}", markup=False)
        return 1
    approx = "~" if result.token_offset_is_estimate else ""
    console.print(f"[red]diverges[/red] in {result.segment} / {result.part}", markup=True)
    console.print(
        f"  byte offset {result.byte_offset}, token offset {approx}{result.token_offset}",
        markup=False,
    )
    console.print(f"  {result.reason}", markup=False)
    if args.show_content:
        console.print(f"  A: {result.excerpt_a!r}\n  B: {result.excerpt_b!r}", markup=False)
    return 1
