"""Benchmark figures as people read them: rich tables with units, min / median / max over the
repeats, and warnings when the spread says the machine was too noisy to trust a ranking.

Knows figures and their units, nothing about how they were measured. ``--json`` output is the
caller's; these helpers only add the ``spread`` and ``warnings`` it carries.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["Spread", "noise_warnings", "print_tables", "spread_table"]

NOISY_SPREAD = 1.5
"""max / min over the repeats above which a timing is called noisy."""


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over the repeats, already in its display unit (``ms``, ``x``, ``%``...)."""

    name: str
    unit: str
    values: tuple[float, ...]

    @classmethod
    def ms(cls, name: str, seconds: Sequence[float]) -> Spread:
        """A timing given in seconds, shown in milliseconds."""
        return cls(name, "ms", tuple(1000 * s for s in seconds))

    @property
    def min(self) -> float:
        """Smallest value."""
        return min(self.values)

    @property
    def median(self) -> float:
        """Median value."""
        return statistics.median(self.values)

    @property
    def max(self) -> float:
        """Largest value."""
        return max(self.values)

    def as_json(self) -> dict[str, float | str | int]:
        """``{"unit", "min", "median", "max", "n"}``."""
        return {
            "unit": self.unit,
            "min": self.min,
            "median": self.median,
            "max": self.max,
            "n": len(self.values),
        }


def _fmt(value: float, unit: str) -> str:
    if unit in ("x", "ms"):
        return f"{value:,.2f}"
    if unit in ("%", "tok/s", "MiB", "GB/s", "GFLOP/s"):
        return f"{value:,.1f}"
    return f"{value:,.0f}"


def spread_table(title: str, rows: Sequence[Spread]) -> Table:
    """A table: figure, unit, min, median, max and the number of runs."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("figure")
    table.add_column("unit")
    for name in ("min", "median", "max"):
        table.add_column(name, justify="right")
    table.add_column("runs", justify="right")
    for row in rows:
        cells = (_fmt(v, row.unit) for v in (row.min, row.median, row.max))
        table.add_row(row.name, row.unit, *cells, str(len(row.values)))
    return table


def noise_warnings(
    timings: Sequence[Spread],
    ratios: Sequence[Spread],
    floors: Sequence[tuple[Spread, Spread]] = (),
) -> list[str]:
    """Why the figures may not be trusted, in words (empty when they look steady).

    Args:
        timings: Timings whose spread over the repeats is checked (max / min).
        ratios: Ratios that must stay on one side of 1 to support a ranking.
        floors: ``(figure, floor)`` pairs where the figure can never beat its floor.
    """
    found: list[str] = []
    for figure, floor in floors:
        below = sum(f < fl for f, fl in zip(figure.values, floor.values, strict=False))
        if below:
            found.append(
                f"{figure.name} beat its own floor ({floor.name}) in {below} of "
                f"{len(figure.values)} runs: the machine was noisy"
            )
    for ratio in ratios:
        if ratio.min < 1 < ratio.max:
            found.append(
                f"{ratio.name} flips between runs ({ratio.min:.2f}x to {ratio.max:.2f}x): "
                "no ranking can be read from it"
            )
    for timing in timings:
        if timing.min > 0 and timing.max / timing.min > NOISY_SPREAD:
            found.append(
                f"{timing.name} varies {timing.max / timing.min:.1f}x between runs "
                f"(over {NOISY_SPREAD}x)"
            )
    if timings and all(len(t.values) == 1 for t in timings):
        found.append("one run per figure: no spread to judge noise by; use --repeats 3 or more")
    return found


def print_tables(tables: Sequence[Table], warnings: Sequence[str]) -> None:
    """Print the tables, then each warning (or that the spread looked steady)."""
    console = Console(highlight=False)
    for table in tables:
        console.print(table)
    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)
    if not warnings:
        console.print("spread over the runs looks steady (no noise warnings)")
