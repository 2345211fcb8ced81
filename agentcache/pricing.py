"""Dated price table and ``cost(usage, model)``.

Prices are USD per million tokens, one row per model family, each with its source URL and the
date it was last checked against that source. Prices change: recheck a row before relying on it
for billing. Unknown models give ``None``, never a guessed price. Knows prices, not usage fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentcache.usage import Usage

__all__ = ["PRICES", "Cost", "Price", "cost", "price_for"]

_OPENAI = "https://developers.openai.com/api/docs/pricing"
_ANTHROPIC = "https://platform.claude.com/docs/en/about-claude/pricing"
_DEEPSEEK = "https://api-docs.deepseek.com/quick_start/pricing-details-usd"
_REVIEWED = "2026-11-29"


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens for one model family.

    Attributes:
        model: Model id prefix this row applies to (dated snapshots match by prefix).
        input: Uncached input.
        cache_read: Input read from the provider's prompt cache.
        cache_write_5m: Input written to the cache with the 5-minute TTL (``None``: not billed).
        cache_write_1h: Input written with the 1-hour TTL (``None``: not offered).
        output: Output tokens.
        source: Where the numbers come from.
        reviewed: ISO date they were last checked against ``source``.
    """

    model: str
    input: float
    cache_read: float
    cache_write_5m: float | None
    cache_write_1h: float | None
    output: float
    source: str
    reviewed: str = _REVIEWED


PRICES: tuple[Price, ...] = (
    Price("gpt-4o-mini", 0.15, 0.075, None, None, 0.60, _OPENAI),
    Price("gpt-4o", 2.50, 1.25, None, None, 10.00, _OPENAI),
    Price("gpt-4.1-mini", 0.40, 0.10, None, None, 1.60, _OPENAI),
    Price("gpt-4.1", 2.00, 0.50, None, None, 8.00, _OPENAI),
    Price("gpt-5-mini", 0.25, 0.025, None, None, 2.00, _OPENAI),
    Price("gpt-5", 1.25, 0.125, None, None, 10.00, _OPENAI),
    Price("claude-opus-4-1", 15.00, 1.50, 18.75, 30.00, 75.00, _ANTHROPIC),
    Price("claude-opus-4-5", 5.00, 0.50, 6.25, 10.00, 25.00, _ANTHROPIC),
    Price("claude-opus-4-6", 5.00, 0.50, 6.25, 10.00, 25.00, _ANTHROPIC),
    Price("claude-opus-4-7", 5.00, 0.50, 6.25, 10.00, 25.00, _ANTHROPIC),
    Price("claude-opus-4-8", 5.00, 0.50, 6.25, 10.00, 25.00, _ANTHROPIC),
    Price("claude-opus-4", 15.00, 1.50, 18.75, 30.00, 75.00, _ANTHROPIC),
    Price("claude-sonnet-4", 3.00, 0.30, 3.75, 6.00, 15.00, _ANTHROPIC),
    Price("claude-haiku-4-5", 1.00, 0.10, 1.25, 2.00, 5.00, _ANTHROPIC),
    Price("claude-3-5-haiku", 0.80, 0.08, 1.00, 1.60, 4.00, _ANTHROPIC),
    Price("deepseek-chat", 0.27, 0.07, None, None, 1.10, _DEEPSEEK),
)


@dataclass(frozen=True, slots=True)
class Cost:
    """Cost of one call in USD, split by token category.

    Attributes:
        input_usd: Uncached input.
        cache_read_usd: Cached input.
        cache_write_usd: Cache writes (5m and 1h).
        output_usd: Output.
        price: The table row used (its source and review date).
        notes: Assumptions made (e.g. cache fields not reported, billed as uncached).
    """

    input_usd: float
    cache_read_usd: float
    cache_write_usd: float
    output_usd: float
    price: Price
    notes: tuple[str, ...] = ()

    @property
    def total_usd(self) -> float:
        """Sum of all parts."""
        return self.input_usd + self.cache_read_usd + self.cache_write_usd + self.output_usd


def price_for(model: str) -> Price | None:
    """The row whose ``model`` is the longest prefix of ``model``, or ``None``."""
    rows = [p for p in PRICES if model.startswith(p.model)]
    return max(rows, key=lambda p: len(p.model)) if rows else None


def cost(usage: Usage, model: str) -> Cost | None:
    """Price ``usage`` for ``model``.

    Returns ``None`` when the model has no row or ``prompt_tokens``/``completion_tokens`` are not
    reported. Unreported cache fields are billed as uncached input and say so in ``notes``; cache
    writes without a TTL split are billed at the 5-minute rate.
    """
    price = price_for(model)
    if price is None or usage.prompt_tokens is None or usage.completion_tokens is None:
        return None
    notes: list[str] = []
    if usage.cached_tokens is None:
        notes.append("cached_tokens not reported: all input billed as uncached")
    read = usage.cached_tokens or 0
    w1h = usage.cache_write_1h_tokens or 0
    w5m = usage.cache_write_5m_tokens
    if w5m is None:
        w5m = (usage.cache_write_tokens or 0) - w1h
    write_usd = (w5m * (price.cache_write_5m or price.input)) + w1h * (
        price.cache_write_1h or price.input
    )
    uncached = max(0, usage.prompt_tokens - read - w5m - w1h)
    return Cost(
        input_usd=uncached * price.input / 1e6,
        cache_read_usd=read * price.cache_read / 1e6,
        cache_write_usd=write_usd / 1e6,
        output_usd=usage.completion_tokens * price.output / 1e6,
        price=price,
        notes=tuple(notes),
    )
