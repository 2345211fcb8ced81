"""Benchmark command lines reject counts below one with a usage error (exit 2), not a traceback."""

from __future__ import annotations

import pytest

from runtime.bench import load as loadtest
from runtime.bench import prefix, trace


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (prefix.prefix_main, ["--repeats", "0"]),
        (prefix.prefix_main, ["--prefix-len", "-5"]),
        (trace.trace_main, ["--system-len", "0"]),
        (trace.trace_main, ["--layers", "x"]),
        (loadtest.main, ["--concurrency", "16", "0"]),
        (loadtest.main, ["--rounds", "0"]),
    ],
)
def test_non_positive_counts_are_usage_errors(
    main: object, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(main)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "must be at least 1" in err or "expected a whole number" in err


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    for main in (prefix.prefix_main, trace.trace_main, loadtest.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        out = capsys.readouterr().out
        assert "``" not in out and "issue" not in out.lower()
