"""argparse value types for the runtime's command-line entry points (serve's engine flags, the
benches).

Each converter raises ``argparse.ArgumentTypeError`` so argparse prints the usage and a line
naming the option, and exits with status 2. The SDK's option types (``agentcache._argtypes``)
re-export these, so both refuse a value with the same words; the runtime never imports the SDK.
Torch-free. ``whole``'s rule: ``int()`` also takes ``"8_0"``, ``" 80 "`` and non-ASCII digits,
which in a port or a byte count are more likely a typo than a choice.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["non_negative_float", "non_negative_int", "positive_int", "whole"]


def whole(text: str) -> int:
    """An int written as ``[+-]digits`` only (``int()`` also takes ``"8_0"`` and ``" 80 "``).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if re.fullmatch(r"[+-]?[0-9]+", text) is None:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    """An int >= 1 (counts, token and byte limits).

    Raises:
        argparse.ArgumentTypeError: not a whole number, or below 1.
    """
    value = whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (budgets where 0 means none).

    Raises:
        argparse.ArgumentTypeError: not a whole number, or negative.
    """
    value = whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0 (seconds, fractions).

    Raises:
        argparse.ArgumentTypeError: not a number, negative, infinite or NaN.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value
