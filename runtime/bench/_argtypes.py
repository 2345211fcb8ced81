"""argparse value types for the runtime's command-line entry points (bench prefix/trace/load).

Each converter raises ``argparse.ArgumentTypeError`` so argparse prints the usage and a line
naming the option, and exits with status 2. The runtime never imports the SDK, so it keeps its own
small copy.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["positive_int"]


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (raises ``argparse.ArgumentTypeError`` otherwise)."""
    if re.fullmatch(r"[+-]?[0-9]+", text) is None:  # NOTE: int() also takes "1_0" and " 10 "
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
