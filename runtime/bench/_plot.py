"""PNG plots of benchmark runs (matplotlib, an optional extra: ``pip install 'agentcache[plot]'``).

Knows the shapes of the trace and load results, nothing about how they were measured. The
caller checks ``check_plot_path()`` before a run so a missing extra fails in milliseconds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_plot_path", "plot_load", "plot_trace"]


def check_plot_path(path: str | None) -> str | None:
    """Why ``--plot path`` cannot work (no matplotlib, not a .png, no folder), or None."""
    if path is None:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'agentcache[plot]'"
    target = Path(path)
    if target.suffix.lower() != ".png":
        return f"--plot {path!r}: give a .png file name"
    if not target.parent.resolve().is_dir():
        return f"--plot {path!r}: folder {str(target.parent)!r} does not exist"
    return None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only; never opens a window.
    import matplotlib.pyplot as plt

    return plt


def plot_trace(path: str, runs: dict[str, Sequence[tuple[float, int, int]]]) -> None:
    """Hit rate and TTFT over the trace, and TTFT vs cached fraction.

    Args:
        path: PNG file to write.
        runs: Per budget name, one ``(ttft_s, cached_tokens, prompt_tokens)`` per request in
            trace order.
    """
    plt = _pyplot()
    fig, (over, ttft, scatter) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, rows in runs.items():
        cached = prompt = 0
        rates = []
        for _, c, p in rows:
            cached, prompt = cached + c, prompt + p
            rates.append(100 * cached / prompt if prompt else 0.0)
        index = range(1, len(rows) + 1)
        over.plot(index, rates, label=name)
        ttft.plot(index, [1000 * t for t, _, _ in rows], label=name, linewidth=0.9)
        scatter.scatter(
            [100 * c / p if p else 0 for _, c, p in rows],
            [1000 * t for t, _, _ in rows],
            label=name,
            s=12,
        )
    over.set(title="cumulative hit rate over the trace", xlabel="request", ylabel="hit rate (%)")
    ttft.set(title="TTFT per request", xlabel="request", ylabel="TTFT (ms)")
    scatter.set(
        title="TTFT vs cached fraction", xlabel="cached prompt tokens (%)", ylabel="TTFT (ms)"
    )
    for axis in (over, ttft, scatter):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_load(path: str, levels: Sequence[dict[str, Any]]) -> None:
    """Throughput and TTFT p50 / p99 vs concurrency (``levels`` as ``bench load`` reports)."""
    plt = _pyplot()
    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    concurrency = [lv["concurrent"]["concurrency"] for lv in levels]
    rate.plot(
        concurrency, [lv["concurrent"]["tokens_per_s"] for lv in levels], "o-", label="concurrent"
    )
    rate.plot(
        concurrency, [lv["sequential"]["tokens_per_s"] for lv in levels], "s--", label="one by one"
    )
    for key, style in (("ttft_p50_s", "o-"), ("ttft_p99_s", "^--")):
        values = [lv["concurrent"][key] for lv in levels]
        shown = [(c, 1000 * v) for c, v in zip(concurrency, values, strict=True) if v is not None]
        if shown:
            xs, ys = zip(*shown, strict=True)
            ttft.plot(xs, ys, style, label=key.removeprefix("ttft_").removesuffix("_s"))
    rate.set(title="throughput", xlabel="concurrent clients", ylabel="generated tokens / s")
    ttft.set(title="TTFT percentiles", xlabel="concurrent clients", ylabel="TTFT (ms)")
    for axis in (rate, ttft):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
