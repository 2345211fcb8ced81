"""The one planner for Anthropic ``cache_control`` breakpoints.

Rules, from Anthropic's prompt-caching docs
(https://platform.claude.com/docs/en/build-with-claude/prompt-caching, reviewed 2026-11-29):
at most 4 breakpoints per request; the cache prefix runs in the order tools -> system -> messages;
a prefix shorter than the model's minimum cacheable length is silently not cached; the TTL is
``{"type": "ephemeral", "ttl": "5m" | "1h"}`` and, when TTLs are mixed, 1h entries must come
before 5m ones. This module knows tiers and token counts, not how a request body is assembled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeAlias

__all__ = [
    "DEFAULT_MIN_CACHEABLE_TOKENS",
    "MAX_BREAKPOINTS",
    "MIN_CACHEABLE_TOKENS",
    "Breakpoint",
    "BreakpointPlan",
    "Tier",
    "TierSpan",
    "Ttl",
    "min_cacheable_tokens",
    "plan_breakpoints",
]

Tier: TypeAlias = Literal["tools", "system", "documents", "conversation"]
Ttl: TypeAlias = Literal["5m", "1h"]
Location: TypeAlias = tuple[str | int, ...]

MAX_BREAKPOINTS = 4
"""Anthropic accepts at most 4 ``cache_control`` blocks per request (prompt-caching docs)."""

# Model id prefix -> minimum cacheable prompt length in tokens, longest prefix first.
# Sources: the prompt-caching docs as quoted in anthropics/anthropic-sdk-python#1194 (4096 Opus
# 4.5/4.6 and Haiku 4.5; 1024 Sonnet 4.x, Opus 4/4.1, Sonnet 3.7; 2048 Haiku 3/3.5) and
# https://dev.to/creeta/claudes-prompt-cache-fails-silently-below-1024-tokens-1ch1 (512 Opus 5;
# 2048 Opus 4.7; 1024 Opus 4.8, Sonnet 5). Reviewed 2026-11-29.
MIN_CACHEABLE_TOKENS: tuple[tuple[str, int], ...] = (
    ("claude-opus-4-8", 1024),
    ("claude-opus-4-7", 2048),
    ("claude-opus-4-6", 4096),
    ("claude-opus-4-5", 4096),
    ("claude-opus-4-1", 1024),
    ("claude-opus-4", 1024),
    ("claude-opus-5", 512),
    ("claude-sonnet-5", 1024),
    ("claude-sonnet-4", 1024),
    ("claude-3-7-sonnet", 1024),
    ("claude-haiku-4-5", 4096),
    ("claude-3-5-haiku", 2048),
    ("claude-3-haiku", 2048),
)
DEFAULT_MIN_CACHEABLE_TOKENS = 1024
"""Used for models not in the table: the most common documented minimum."""


def min_cacheable_tokens(model: str) -> int:
    """Minimum cacheable prefix length, tokens, for an Anthropic ``model`` id (dated or not)."""
    for prefix, tokens in MIN_CACHEABLE_TOKENS:
        if model.startswith(prefix):
            return tokens
    return DEFAULT_MIN_CACHEABLE_TOKENS


class TierSpan(NamedTuple):
    """One stability tier of a request, in request order.

    ``tokens`` is the tier's own length; ``location`` is the path of its last content block in the
    request body (e.g. ``("messages", 3, "content", 0)``), where a breakpoint would go.
    """

    tier: Tier
    tokens: int
    location: Location


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A planned ``cache_control`` marker.

    Attributes:
        tier: The stability tier it closes.
        location: Path of the content block that carries it.
        ttl: ``"5m"`` or ``"1h"``.
        prefix_tokens: Tokens from the request start through this block (as counted by the caller).
    """

    tier: Tier
    location: Location
    ttl: Ttl
    prefix_tokens: int

    @property
    def cache_control(self) -> dict[str, str]:
        """The marker object, e.g. ``{"type": "ephemeral", "ttl": "1h"}``."""
        return {"type": "ephemeral", "ttl": self.ttl}


@dataclass(frozen=True, slots=True)
class BreakpointPlan:
    """Breakpoints to place and why others were not.

    Attributes:
        breakpoints: At most ``MAX_BREAKPOINTS``, in request order, 1h ones before 5m ones.
        notes: Human-readable reasons for skipped or downgraded markers.
        min_tokens: The minimum cacheable length applied.
    """

    breakpoints: tuple[Breakpoint, ...]
    notes: tuple[str, ...]
    min_tokens: int


def plan_breakpoints(
    spans: Sequence[TierSpan],
    *,
    model: str,
    ttl: Mapping[Tier, Ttl] | None = None,
    min_tokens: int | None = None,
) -> BreakpointPlan:
    """Place one breakpoint at the end of each tier whose prefix reaches the model's minimum.

    Args:
        spans: Tiers in request order (tools, system, documents, conversation); empty tiers
            (``tokens == 0``) get no marker.
        model: Anthropic model id; selects the minimum cacheable length.
        ttl: Tier -> TTL; tiers not named get ``"5m"``. A ``"1h"`` tier after a ``"5m"`` marker is
            downgraded to ``"5m"`` (Anthropic requires 1h entries before 5m ones) and noted.
        min_tokens: Overrides the table's minimum cacheable length for ``model``, tokens.

    Returns:
        The plan; never more than ``MAX_BREAKPOINTS`` markers.

    Raises:
        ValueError: ``min_tokens`` is not a positive int.
    """
    ttl = ttl or {}
    if min_tokens is not None and (
        isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1
    ):
        raise ValueError(f"min_tokens must be a positive int, got {min_tokens!r}")
    minimum = min_tokens if min_tokens is not None else min_cacheable_tokens(model)
    prefix = 0
    placed: list[Breakpoint] = []
    notes: list[str] = []
    seen_5m = False
    for span in spans:
        prefix += span.tokens
        if span.tokens <= 0:
            continue
        if prefix < minimum:
            notes.append(f"{span.tier}: prefix {prefix} tokens < minimum {minimum} for {model!r}")
            continue
        want: Ttl = ttl.get(span.tier, "5m")
        if want == "1h" and seen_5m:
            notes.append(f"{span.tier}: 1h TTL after a 5m marker downgraded to 5m")
            want = "5m"
        seen_5m = seen_5m or want == "5m"
        placed.append(Breakpoint(span.tier, span.location, want, prefix))
    if len(placed) > MAX_BREAKPOINTS:
        notes.append(f"kept the last {MAX_BREAKPOINTS} of {len(placed)} candidate markers")
        placed = placed[-MAX_BREAKPOINTS:]
    return BreakpointPlan(tuple(placed), tuple(notes), minimum)
