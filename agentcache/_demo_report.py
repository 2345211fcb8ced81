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

__all__ = [
    "CHUNK_LABELS",
    "TurnReport",
    "chunk_line",
    "print_summary",
    "print_turn",
    "summary_line",
]


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
        """Cache-off TTFT / this turn's TTFT for the same prompt.

        ``None`` when not measured, or when nothing was reused from the prefix cache or the
        chunk store (then both runs did the same work and their ratio is only noise).
        """
        warm, cold = self.usage.ttft_s, self.cold_ttft_s
        if not self.reused_tokens or not warm or cold is None:
            return None
        return cold / warm

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens not computed: prefix-cached plus reused from the chunk store."""
        return (self.usage.cached_tokens or 0) + (self.usage.chunk_reused_tokens or 0)


CHUNK_LABELS: dict[str, str] = {
    "blend": "blend: approximate, answers may differ from a full prefill",
    "exact": "exact block mask: answers differ from a full prefill unless the model was "
    "trained with block attention",
}
"""How each chunk-reuse mode is named wherever the demo shows chunk-reused tokens."""


def _fmt_tokens(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _fmt_pct(usage: Usage) -> str:
    rate = usage.hit_rate
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def _fmt_ms(seconds: float | None, unit: str = " ms") -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.0f}{unit}"


def _fmt_ttft(report: TurnReport) -> str:
    """``98 ms vs 310 ms with the cache off (3.2x faster)``, or why there is no comparison."""
    text = f"TTFT {_fmt_ms(report.usage.ttft_s)}"
    if report.cold_ttft_s is None:
        return text
    if report.speedup is None:
        return f"{text} (nothing reused, so no cache-off comparison)"
    cold = _fmt_ms(report.cold_ttft_s)
    return f"{text} vs {cold} for the same prompt with the cache off ({_fmt_ratio(report.speedup)})"


def _fmt_ratio(speedup: float) -> str:
    """``3.2x faster``, or ``1.4x slower`` for a ratio below 1 (never "0.7x faster")."""
    return f"{speedup:.1f}x faster" if speedup >= 1 else f"{1 / speedup:.1f}x slower"


def _fmt_cached(usage: Usage, previous: TurnReport | None, number: int) -> str:
    """How many prompt tokens came from the prefix cache, and where they came from."""
    cached, prompt = usage.cached_tokens, usage.prompt_tokens
    if cached is None or prompt is None:
        return "cached n/a (the backend does not report it)"
    head = f"{cached} of {prompt} prompt tokens cached ({_fmt_pct(usage)})"
    if cached == 0:
        return f"{head}: {'first turn, nothing to reuse yet' if previous is None else 'no reuse'}"
    before = previous.usage.prompt_tokens if previous is not None else None
    if before is None:
        return f"{head}, from earlier requests to this model"
    if cached > before:
        # NOTE: whole blocks only: usually part of the answer (2032 = 2030 + 2 of 4 tokens).
        kept = cached - before
        return (
            f"{head} = turn {number - 1}'s prompt ({before}) + {kept} token{'s' * (kept != 1)} "
            "of its answer, kept after decoding"
        )
    return f"{head}, from turn {number - 1}'s {before}-token prompt (reused in whole blocks)"


def _fmt_prefill(usage: Usage) -> str:
    """Prompt tokens that went through the model."""
    if usage.prompt_tokens is None or usage.cached_tokens is None:
        return "n/a"
    return str(usage.prompt_tokens - usage.cached_tokens - (usage.chunk_reused_tokens or 0))


def _fmt_chunks(usage: Usage, previous: TurnReport | None) -> str | None:
    """Document tokens reused from the chunk store, and the mode; None when chunk reuse is off."""
    reused, mode = usage.chunk_reused_tokens, usage.chunk_reuse_mode
    if reused is None or mode is None:
        return None
    text = f"chunk store reused {reused} document tokens ({CHUNK_LABELS.get(mode, mode)})"
    if reused == 0 and previous is None:
        text += "; each document computed alone and stored for later turns"
    return text


def print_turn(
    console: Console, number: int, report: TurnReport, previous: TurnReport | None = None
) -> None:
    """Print a turn's sources and its cache figures, each with the words that explain it."""
    console.print()
    if report.sources:
        console.print(f"[dim]sources: {', '.join(report.sources[:6])}[/dim]", soft_wrap=True)
    u = report.usage
    chunks = _fmt_chunks(u, previous)
    console.print(
        f"[cyan]turn {number}: {_fmt_cached(u, previous, number)}; "
        f"{'' if chunks is None else chunks + '; '}prefill computed {_fmt_prefill(u)} tokens; "
        f"{_fmt_ttft(report)}[/cyan]",
        soft_wrap=True,
    )
    console.print(
        f"[cyan]        retrieval cache {report.retrieval_hits} hit / {report.retrieval_misses} "
        f"miss; tool cache {report.tool_hits} hit / {report.tool_misses} miss[/cyan]",
        soft_wrap=True,
    )


def print_summary(console: Console, reports: Sequence[TurnReport], wall_s: float) -> None:
    """Print every turn in a table, then the same-prompt cache-off speedup of turns 2 onwards."""
    table = Table(
        title="agentcache demo: what the caches saved (tokens, ms)",
        caption=(
            "TTFT off, speedup: the same prompt's TTFT with the cache off, and off / on (— when "
            "there is no comparison: nothing reused, or no local engine); "
            "retrieval, tools: cache hits/misses"
        ),
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    has_chunks = any(r.usage.chunk_reused_tokens is not None for r in reports)
    columns = ("turn", "prompt", "cached", *(("chunk",) if has_chunks else ()), "hit", "TTFT")
    for name in (*columns, "TTFT off", "speedup", "retrieval", "tools"):
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for i, r in enumerate(reports, start=1):
        u = r.usage
        chunk = (_fmt_tokens(u.chunk_reused_tokens),) if has_chunks else ()
        table.add_row(
            str(i),
            _fmt_tokens(u.prompt_tokens),
            _fmt_tokens(u.cached_tokens),
            *chunk,
            _fmt_pct(u),
            _fmt_ms(u.ttft_s, unit=""),
            # NOTE: "—" in both columns when there is no comparison, as the turn line says.
            "—" if r.speedup is None else _fmt_ms(r.cold_ttft_s, unit=""),
            "—" if r.speedup is None else f"{r.speedup:.1f}x",
            f"{r.retrieval_hits}/{r.retrieval_misses}",
            f"{r.tool_hits}/{r.tool_misses}",
        )
    console.print()
    console.print(table)
    console.print(summary_line(reports), soft_wrap=True)
    chunks = chunk_line(reports)
    if chunks is not None:
        console.print(chunks, soft_wrap=True)
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
        if len(reports) > 1:
            return "TTFT: no turn reused cached tokens, so there is no speedup to report"
        return "TTFT: only one turn, so nothing was reused from the prefix cache yet"
    median = statistics.median(later)
    last = len(reports)
    turns = "turn 2" if last == 2 else f"turns 2-{last}"
    modes = sorted({r.usage.chunk_reuse_mode for r in reports if r.usage.chunk_reuse_mode})
    caches = "prefix cache" + "".join(f" + chunk store ({mode})" for mode in modes)
    return (
        f"{caches}: {turns} reached the first token {_fmt_ratio(median)} (median) than the "
        "same prompts with the cache forced off"
    )


def chunk_line(reports: Sequence[TurnReport]) -> str | None:
    """Document tokens reused from the chunk store over the run, apart from the prefix cache's;
    None when chunk reuse was off."""
    used = [r.usage for r in reports if r.usage.chunk_reused_tokens is not None]
    if not used:
        return None
    reused = sum(u.chunk_reused_tokens or 0 for u in used)
    cached = sum(u.cached_tokens or 0 for u in used)
    prompt = sum(u.prompt_tokens or 0 for u in used)
    labels = "; ".join(sorted({CHUNK_LABELS.get(m, m) for u in used if (m := u.chunk_reuse_mode)}))
    return (
        f"chunk store: {reused} document tokens reused over {len(used)} turn(s) ({labels}), "
        f"apart from {cached} prefix-cached, of {prompt} prompt tokens in all"
    )
