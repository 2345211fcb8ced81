"""Per-turn cache lines and the summary table of ``agentcache demo`` (rich output only).

Knows the figures a turn produced; nothing about how they were measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def _fmt_tokens(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _fmt_pct(usage: Usage) -> str:
    rate = usage.hit_rate
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def _fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.0f} ms"


def print_turn(console: Console, number: int, report: TurnReport) -> None:
    """Print a turn's sources and its one-line cache summary."""
    console.print()
    if report.sources:
        console.print(f"[dim]sources: {', '.join(report.sources[:6])}[/dim]", soft_wrap=True)
    u = report.usage
    console.print(
        f"[cyan]turn {number}: prompt {_fmt_tokens(u.prompt_tokens)} tok, cached "
        f"{_fmt_tokens(u.cached_tokens)} ({_fmt_pct(u)}), TTFT {_fmt_ms(u.ttft_s)} | retrieval "
        f"cache {report.retrieval_hits} hit/{report.retrieval_misses} miss | tool cache "
        f"{report.tool_hits} hit/{report.tool_misses} miss[/cyan]",
        soft_wrap=True,
    )


def print_summary(console: Console, reports: Sequence[TurnReport], wall_s: float) -> None:
    """Print every turn in a table, then first turn vs the mean of later turns."""
    table = Table(title="agentcache demo: what the caches saved")
    for name in ("turn", "prompt tok", "cached tok", "hit %", "TTFT", "retrieval h/m", "tool h/m"):
        table.add_column(name, justify="right")
    for i, r in enumerate(reports, start=1):
        u = r.usage
        table.add_row(
            str(i),
            _fmt_tokens(u.prompt_tokens),
            _fmt_tokens(u.cached_tokens),
            _fmt_pct(u),
            _fmt_ms(u.ttft_s),
            f"{r.retrieval_hits}/{r.retrieval_misses}",
            f"{r.tool_hits}/{r.tool_misses}",
        )
    console.print()
    console.print(table)
    later = [r.usage.ttft_s for r in reports[1:] if r.usage.ttft_s is not None]
    first = reports[0].usage.ttft_s if reports else None
    if first is not None and later:
        mean_later = sum(later) / len(later)
        console.print(
            f"TTFT: turn 1 {_fmt_ms(first)} vs later turns {_fmt_ms(mean_later)} "
            f"({first / mean_later:.1f}x faster from the prefix cache)"
            if mean_later > 0
            else f"TTFT: turn 1 {_fmt_ms(first)}"
        )
    console.print(f"demo wall time: {wall_s:.1f}s")
