"""Per-turn cache lines and the summary table of ``agentcache demo`` (rich output only).

Knows the figures a turn produced; nothing about how they were measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table

from agentcache.usage import Usage

__all__ = ["TurnReport", "print_summary", "print_turn"]


@dataclass(frozen=True, slots=True)
class TurnReport:
    """Figures of one demo turn (``usage`` is the final model call's)."""

    question: str
    usage: Usage
    wall_s: float
    sources: list[str]
    retrieval_hits: int
    retrieval_misses: int
    tool_hits: int
    tool_misses: int
    cold_ttft_s: float | None = None
    """TTFT of the same final prompt with the prefix cache forced off (local engine only)."""

    @property
    def speedup(self) -> float | None:
        """Cache-off TTFT / this turn's TTFT for the same prompt; ``None`` when not measured."""
        warm, cold = self.usage.ttft_s, self.cold_ttft_s
        return cold / warm if warm and cold is not None else None


def _fmt_tokens(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _fmt_pct(usage: Usage) -> str:
    rate = usage.hit_rate
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def _fmt_ms(seconds: float | None, unit: str = " ms") -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.0f}{unit}"


def _fmt_ttft(report: TurnReport) -> str:
    """``98 ms (cache off: 310 ms, 3.2x)``, or just the TTFT without a cache-off run."""
    text = _fmt_ms(report.usage.ttft_s)
    if report.cold_ttft_s is None or report.speedup is None:
        return text
    return f"{text} (cache off: {_fmt_ms(report.cold_ttft_s)}, {report.speedup:.1f}x)"


def _fmt_prefill(usage: Usage) -> str:
    """Prompt tokens that went through the model, of all prompt tokens."""
    if usage.prompt_tokens is None or usage.cached_tokens is None:
        return "n/a"
    return f"{usage.prompt_tokens - usage.cached_tokens}/{usage.prompt_tokens}"


def print_turn(console: Console, number: int, report: TurnReport) -> None:
    """Print a turn's sources and its one-line cache summary."""
    console.print()
    if report.sources:
        console.print(f"[dim]sources: {', '.join(report.sources[:6])}[/dim]", soft_wrap=True)
    u = report.usage
    console.print(
        f"[cyan]turn {number}: prompt {_fmt_tokens(u.prompt_tokens)} tok, cached "
        f"{_fmt_tokens(u.cached_tokens)} ({_fmt_pct(u)}), prefill computed {_fmt_prefill(u)} "
        f"tok, TTFT {_fmt_ttft(report)} | retrieval cache {report.retrieval_hits} "
        f"hit/{report.retrieval_misses} miss | tool cache {report.tool_hits} "
        f"hit/{report.tool_misses} miss[/cyan]",
        soft_wrap=True,
    )


def print_summary(console: Console, reports: Sequence[TurnReport], wall_s: float) -> None:
    """Print every turn in a table, then the same-prompt cache-off speedup of turns 2 onwards."""
    table = Table(
        title="agentcache demo: what the caches saved (tokens, ms)",
        caption="speedup: same prompt, TTFT cache off / on; retrieval, tools: cache hits/misses",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    columns = ("turn", "prompt", "cached", "hit", "TTFT", "TTFT off", "speedup", "retrieval")
    for name in (*columns, "tools"):
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for i, r in enumerate(reports, start=1):
        u = r.usage
        table.add_row(
            str(i),
            _fmt_tokens(u.prompt_tokens),
            _fmt_tokens(u.cached_tokens),
            _fmt_pct(u),
            _fmt_ms(u.ttft_s, unit=""),
            _fmt_ms(r.cold_ttft_s, unit=""),
            "n/a" if r.speedup is None else f"{r.speedup:.1f}x",
            f"{r.retrieval_hits}/{r.retrieval_misses}",
            f"{r.tool_hits}/{r.tool_misses}",
        )
    console.print()
    console.print(table)
    console.print(summary_line(reports), soft_wrap=True)
    console.print(f"demo wall time: {wall_s:.1f}s")


def summary_line(reports: Sequence[TurnReport]) -> str:
    """The prefix cache's effect: median same-prompt TTFT speedup over turns 2 onwards.

    Turn 1 is left out because nothing was cached yet. Each ratio compares one prompt with
    itself (cache on vs forced off), so turns with different amounts of new text never mix.
    """
    later = [r.speedup for r in reports[1:] if r.speedup is not None]
    if not later:
        if any(r.cold_ttft_s is None for r in reports):
            return "TTFT: a cache-off comparison of the same prompts needs the local engine"
        return "TTFT: only one turn, so nothing was reused from the prefix cache yet"
    median = statistics.median(later)
    last = len(reports)
    turns = "turn 2" if last == 2 else f"turns 2-{last}"
    return (
        f"prefix cache: {turns} reached the first token {median:.1f}x faster (median) than the "
        "same prompts with the cache forced off"
    )
