"""``agentcache models list|pull NAME|path NAME``: the model store on the command line.

Exit codes: 0 done, 1 ``path`` of a model not pulled, 2 an unknown name or a pull that found no
source (one line on stderr saying what to install). Torch loads only when a pull converts.
"""

from __future__ import annotations

import argparse
import sys

from runtime.exceptions import ModelLoadError, one_line
from runtime.models import BUNDLED_MODELS, NAMED_MODELS, resolve_model

__all__ = ["run_cli"]


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentcache models ACTION`` from parsed arguments; returns the exit code."""
    try:
        if args.action == "list":
            return _list()
        if args.action == "path":
            return _path(args.name)
        return _pull(args.name, wheel=args.wheel, quiet=args.quiet)
    except KeyboardInterrupt:
        print(f"agentcache models {args.action}: interrupted", file=sys.stderr)
        return 130


def _list() -> int:
    from rich.console import Console
    from rich.table import Table

    from runtime.models.named import NAMED, manifest_of

    table = Table("model", "kind", "pulled", "source", "folder")
    for name in BUNDLED_MODELS:
        table.add_row(name, "bundled", "yes", "package data", resolve_model(name))
    for name in NAMED_MODELS:
        manifest, model = manifest_of(name), NAMED[name]
        source = manifest.get("source", "?") if manifest else f"hub {model.hub_id} | {model.wheel}"
        folder = resolve_model(name, pull=False) if manifest else "-"
        table.add_row(name, "named", "yes" if manifest else "no", str(source), folder)
    Console(width=200).print(table)
    return 0


def _path(name: str) -> int:
    if name not in (*BUNDLED_MODELS, *NAMED_MODELS):
        return _fail("path", f"unknown model {name!r}; models: {_names()}")
    try:
        print(resolve_model(name, pull=False))
    except FileNotFoundError as exc:
        print(f"agentcache models path: {exc}", file=sys.stderr)
        return 1
    return 0


def _pull(name: str, *, wheel: str | None, quiet: bool) -> int:
    if name not in NAMED_MODELS:
        extra = " (bundled: nothing to pull)" if name in BUNDLED_MODELS else ""
        return _fail("pull", f"{name!r} is not a named model{extra}; named: {_names(True)}")
    from runtime.models.pull import pull

    try:
        folder = pull(name, wheel=wheel, quiet=quiet)
    except ModelLoadError as exc:
        return _fail("pull", one_line(exc))
    print(folder)
    return 0


def _names(named_only: bool = False) -> str:
    return ", ".join(NAMED_MODELS if named_only else (*BUNDLED_MODELS, *NAMED_MODELS))


def _fail(action: str, message: str) -> int:
    print(f"agentcache models {action}: {message}", file=sys.stderr)
    return 2
