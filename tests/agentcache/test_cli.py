"""The command line parses every subcommand and prints help without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentcache.cli import build_parser

SUBCOMMANDS = ["demo", "serve", "bench", "lint", "diff"]


def test_top_level_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([name, "--help"])
    assert exc.value.code == 0
    assert name in capsys.readouterr().out


def test_serve_binds_loopback_by_default() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from agentcache.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'agentcache --help imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
