"""argparse value types shared by the SDK's command-line entry points (bench, demo, serve).

Each converter raises ``argparse.ArgumentTypeError`` so argparse prints a one-line usage error and
exits with status 2. Knows nothing about what the numbers mean.
"""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "port_number", "positive_int"]


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


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


def port_number(text: str) -> int:
    """Parse a TCP port in 1..65535 (a larger one would silently wrap modulo 65536).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer or is outside 1..65535.
    """
    value = _whole(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value
