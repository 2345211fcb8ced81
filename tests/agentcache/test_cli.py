"""The command line parses every subcommand and prints help without importing torch."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentcache import cli
from agentcache.cli import build_parser, main

SUBCOMMANDS = ["demo", "serve", "models", "bench", "lint", "diff"]


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


UPSTREAM = ["--upstream", "http://127.0.0.1:1/v1"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["demo", "--max-tokens", "x"],
            "agentcache demo: --max-tokens: expected a whole number, got 'x'",
        ),
        (["demo", "--max-tokens", "0"], "agentcache demo: --max-tokens: must be at least 1, got 0"),
        (
            ["serve", "--port", "99999"],
            "agentcache serve: --port: must be a port in 1..65535, got 99999",
        ),
        (["serve", "--port", "0"], "agentcache serve: --port: must be a port in 1..65535, got 0"),
        (
            ["serve", "--port", "8_0"],
            "agentcache serve: --port: expected a whole number, got '8_0'",
        ),
        (
            ["serve", "--port", " 80"],
            "agentcache serve: --port: expected a whole number, got ' 80'",
        ),
        (
            ["serve", "--port", "\u0668\u0660"],  # Arabic-Indic 80: int() would take it
            "agentcache serve: --port: expected a whole number, got '\u0668\u0660'",
        ),
        (
            ["serve", "--port", "http"],
            "agentcache serve: --port: expected a whole number, got 'http'",
        ),
        (
            ["serve", "--kv-cache-bytes", "-5"],
            "agentcache serve: --kv-cache-bytes: must be at least 0, got -5",
        ),
        (
            ["serve", "--max-request-bytes", "0"],
            "agentcache serve: --max-request-bytes: must be at least 1, got 0",
        ),
        (["demo", "--question"], "agentcache demo: --question: expected one argument"),
        (
            ["serve", "--dtype", "fp8"],
            "agentcache serve: --dtype: invalid choice: 'fp8' (choose from ",
        ),
        (
            ["proxy", *UPSTREAM, "--max-request-bytes", "1k"],
            "agentcache proxy: --max-request-bytes: expected a whole number, got '1k'",
        ),
        (
            ["proxy", *UPSTREAM, "--provider", "gemini"],
            "agentcache proxy: --provider: invalid choice: 'gemini' ",
        ),
        (["proxy"], "agentcache proxy: the following arguments are required: --upstream"),
        (
            ["proxy", *UPSTREAM, "--port", "99999"],
            "agentcache proxy: --port: must be a port in 1..65535, got 99999",
        ),
        (["lint"], "agentcache lint: the following arguments are required: file"),
        (["diff", "a.json"], "agentcache diff: the following arguments are required: b"),
        (["demo", "--bogus"], "agentcache demo: unrecognized arguments: --bogus"),
        (["bench", "nope"], "agentcache bench: kind: invalid choice: 'nope' (choose from "),
        # NOTE: a key typed after a mistyped or ambiguous flag is masked, not echoed
        (["serve", "--api=sk-secret-1"], "agentcache serve: ambiguous option: --api=*** could"),
        (["serve", "--apikey", "sk-secret-2"], "agentcache serve: unrecognized arguments: --api"),
        (["proxy", *UPSTREAM, "--token=sk-secret-3"], "agentcache proxy: unrecognized arguments"),
    ],
)
def test_bad_option_values_are_one_line_and_exit_2(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # As each command's own checks of its options (e.g. demo --chunk-reuse, serve --model): one
    # line naming the option and the value, no argparse usage block; --help still has the usage.
    # Parse errors come before anything loads (test_serve_usage_error_loads_no_model_and_no_torch).
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    [err] = captured.err.splitlines()
    assert err.startswith(line), err
    assert captured.out == "" and "sk-secret" not in err


def test_proxy_takes_the_body_limit_of_serve(capsys: pytest.CaptureFixture[str]) -> None:
    upstream = ["proxy", *UPSTREAM]
    assert build_parser().parse_args(upstream).max_request_bytes is None  # the shared default
    args = build_parser().parse_args([*upstream, "--max-request-bytes", "64"])
    assert args.max_request_bytes == 64
    with pytest.raises(SystemExit) as exc:
        main([*upstream, "--max-request-bytes", "0"])
    assert exc.value.code == 2
    assert "must be at least 1, got 0" in capsys.readouterr().err


def test_serve_usage_error_loads_no_model_and_no_torch() -> None:
    code = (
        "import sys\n"
        "from agentcache.cli import main\n"
        "try:\n    main(['serve', '--port', '99999'])\nexcept SystemExit as exc:\n"
        "    assert exc.code == 2\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_model_name_typo_is_one_line_and_exit_2_without_torch(
    command: str, tmp_path: Path
) -> None:
    # NOTE: a None entry in sys.modules makes `import torch` fail, as if it were not installed.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "from agentcache.cli import main\n"
        f"sys.exit(main(['{command}', '--model', 'tinyy']))\n"
    )
    env = {**os.environ, "AGENTCACHE_CACHE_DIR": str(tmp_path)}  # NOTE: the demo creates it.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    # NOTE: both print the failure on stderr, and nothing on stdout (the demo would print its
    # output there, after the checks)
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"agentcache {command}: unknown model 'tinyy': did you mean 'tiny'? bundled models: tiny; "
        "named models (pulled on first use): smollm2-135m; or give a local folder, a .gguf file "
        "or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    ]


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from agentcache.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'agentcache --help imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    import agentcache

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"agentcache {agentcache.__version__}"
    assert agentcache.__version__ == importlib.metadata.version("agentcache")


@pytest.mark.parametrize("kind", ["prompt", "cache"])
def test_bench_help_is_user_facing(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", kind, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--iterations" in out
    for internal in ("``", "issue", "Target ("):
        assert internal not in out


@pytest.mark.parametrize(
    "argv", [["bench", "prompt", "--iterations", "0"], ["bench", "cache", "--iterations", "-3"]]
)
def test_bench_rejects_non_positive_iterations(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "--iterations: must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["prompt", "proxy", "stall", "choices"])
def test_ctrl_c_in_any_bench_is_one_line_and_exit_130(
    kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def stopped(argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load", lambda target: stopped)
    assert main(["bench", kind]) == 130
    captured = capsys.readouterr()
    assert captured.err == f"agentcache bench {kind}: interrupted\n" and captured.out == ""


ROOT = Path(__file__).resolve().parents[2]


def _readme_lint_diff_commands() -> list[tuple[list[str], int]]:
    """README's ``lint``/``diff`` lines on ``examples/`` files, each with the exit code its
    comment (on the line or the comment lines right below it) states."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        command = re.match(r"\.venv/bin/agentcache (lint|diff) ((?:examples/\S+ ?)+)", line)
        if command is None:
            continue
        notes = [line.partition("#")[2]]
        for below in lines[i + 1 :]:
            if not below.lstrip().startswith("#"):
                break
            notes.append(below)
        stated = re.search(r"exit (\d)", " ".join(notes))
        assert stated is not None, f"README line {i + 1} states no exit code"
        found.append(([command[1], *command[2].split()], int(stated[1])))
    return found


def test_readme_lint_and_diff_examples_exist_and_exit_as_stated(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = _readme_lint_diff_commands()
    assert {args[0] for args, _ in commands} == {"lint", "diff"}
    assert {code for _, code in commands} == {0, 1}
    monkeypatch.chdir(ROOT)
    for args, code in commands:
        assert main(args) == code, (args, capsys.readouterr().out)


@pytest.mark.parametrize("name", ["serve", "proxy"])
def test_serve_and_proxy_help_state_every_default(name: str) -> None:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = sub.choices[name]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or action.required or "-h" in action.option_strings:
            continue
        assert "default" in (action.help or ""), f"{name} {action.option_strings} hides its default"


def test_serve_help_defaults_match_the_runtime() -> None:
    pytest.importorskip("torch")
    from runtime.engine import DEFAULT_KV_CACHE_BYTES
    from runtime.serve.app import DEFAULT_MAX_REQUEST_BYTES

    args = build_parser().parse_args(["serve"])  # the defaults that run
    assert (args.model, args.port, args.kv_cache_bytes, args.max_request_bytes) == (
        "smollm2-135m", 8000, None, None  # None: the runtime's constants below
    )  # fmt: skip
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    helps = sub.choices["serve"].format_help().replace("\n", " ")
    assert DEFAULT_KV_CACHE_BYTES == 1 << 30 and "(default: 1 GiB)" in helps
    assert f"2 MiB = {DEFAULT_MAX_REQUEST_BYTES})" in " ".join(helps.split())


def test_a_host_that_is_not_local_gets_a_host_hint(capsys: pytest.CaptureFixture[str]) -> None:
    # NOTE: 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine
    assert main(["proxy", *UPSTREAM, "--host", "192.0.2.1", "--port", "18999"]) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("agentcache proxy: cannot listen on 192.0.2.1:18999: ")
    assert "give --host a local address" in line and "pick another --port" not in line
