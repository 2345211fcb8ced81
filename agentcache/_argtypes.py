"""argparse value types shared by the SDK's command-line entry points (bench, demo).

Each converter raises ``argparse.ArgumentTypeError`` so argparse prints a one-line usage error and
exits with status 2. Knows nothing about what the numbers mean.
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int"]


def positive_int(text: str) -> int:
    """Parse an int >= 1 (counts of iterations, tokens, tools).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer or is below 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
