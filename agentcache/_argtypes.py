"""argparse helpers shared by the SDK's command-line entry points (bench, demo, serve, proxy).

Value converters raise ``argparse.ArgumentTypeError``, which argparse reports as a usage error with
exit status 2; ``OneLineErrorParser`` makes that report one line, as the commands' own checks are.
Knows nothing about what the numbers mean.
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

# NOTE: the number converters are the runtime's (torch-free; the runtime never imports the SDK),
# so serve's engine flags and the SDK's own options refuse a value with the same words.
from runtime.serve.argtypes import non_negative_float, non_negative_int, positive_int, whole

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


def port_number(text: str) -> int:
    """Parse a TCP port in 1..65535 (a larger one would silently wrap modulo 65536).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer or is outside 1..65535.
    """
    value = whole(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value
