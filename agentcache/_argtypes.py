"""argparse helpers shared by the SDK's command-line entry points (bench, demo, serve, proxy).

Value converters raise ``argparse.ArgumentTypeError``, which argparse reports as a usage error with
exit status 2; ``OneLineErrorParser`` makes that report one line, as the commands' own checks are.
Knows nothing about what the numbers mean.
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

__all__ = [
    "OneLineErrorParser",
    "non_negative_float",
    "non_negative_int",
    "port_number",
    "positive_int",
]


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, exit status 2.

    ``agentcache demo --max-tokens x`` prints ``agentcache demo: --max-tokens: expected a whole
    number, got 'x'``, the shape of the line a command prints when its own checks refuse an
    option (``agentcache demo: --chunk-reuse must be exact or blend, got 'blned'``), instead of
    argparse's usage block; ``--help`` still prints the full usage. Subparsers made by
    ``add_subparsers`` inherit the class.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: MESSAGE`` (argparse's ``argument `` lead dropped, the value of an option
        that looks like it holds a secret masked) and exit with 2."""
        shown = _SECRET_VALUE.sub(r"\1\2***", message.removeprefix("argument "))
        self.exit(2, f"{self.prog}: {shown}\n")


_SECRET_VALUE = re.compile(r"(--?[\w-]*(?:key|token|secret|passw|api)[\w-]*)(=|\s+)(?!-)\S+", re.I)
"""An option whose name says key, token, secret, password or api, then its value (``--api=V``,
``--apikey V``): argparse echoes a mistyped or ambiguous option with its value, and an API key typed
after the wrong flag would land in the terminal's scrollback and in logs."""


def _whole(text: str) -> int:
    # NOTE: int() also takes "8_0", " 80 " and non-ASCII digits ("٨٠"): a port or a byte count
    # spelled that way is more likely a typo than a choice, so only [+-]digits pass.
    if re.fullmatch(r"[+-]?[0-9]+", text) is None:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    """Parse an int >= 1 (counts of iterations, tokens, tools; byte limits).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer or is below 1.
    """
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """Parse an int >= 0 (byte budgets where 0 means none).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer or is negative.
    """
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """Parse a finite number >= 0 (durations in seconds).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not a number, is negative, or is not finite.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def port_number(text: str) -> int:
    """Parse a TCP port in 1..65535 (a larger one would silently wrap modulo 65536).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer or is outside 1..65535.
    """
    value = _whole(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value
