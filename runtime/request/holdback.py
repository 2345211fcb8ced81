"""How much of a growing text to hold back because it may still become a marker.

One rule for every streamed marker in the runtime: stop strings (the detokenizer) and the
``<tool_call>`` open tag (the server's tool parser). It knows text only.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["held_back_len"]


def held_back_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``.

    Example: ``held_back_len("a <tool", ["<tool_call>"]) == 5``. Work is bounded by the
    markers' lengths, not by ``len(text)``.

    Returns:
        0 when no tail can grow into a marker.
    """
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
