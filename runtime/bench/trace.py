"""``agentcache bench trace`` (W3): an interleaved agent trace, hit rate and TTFT vs the cache off.

Rows: full KV budget, a quarter of it, the quarter plus a disk tier of four times the pool, and
the cache off; each with the pool fill and, for the quarter budget, the offline-optimal (Belady)
hit rate of the same trace and capacity. Then the quarter budget's trace replayed (no model) with a
disk tier of 1-4x the pool under each disk policy, next to Belady for pool + disk, and a
multi-session agent trace (seeds 2-13) replayed at 1/8, 1/4 and 1/2 budget under each eviction
policy (``lru``, ``shared``, ``slru``, ``adaptive-shared``, the default ``adaptive``), next to
Belady. Random-weight models
built from configs (no downloads), CPU by default; the agent trace's replays need no model.
A script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.table import Table

from runtime.bench._common import (
    add_common_options,
    bench_engine,
    restores_torch_threads,
    ttft,
    w1_model,
)
from runtime.bench._figures import Spread, print_tables, spread_table
from runtime.bench._plot import check_plot_path, plot_trace
from runtime.bench._replay import (
    Step,
    agent_sessions,
    belady,
    distinct_blocks,
    make_disk,
    replay,
)
from runtime.cache.eviction import EvictionPolicy
from runtime.engine import Engine
from runtime.serve.argtypes import positive_int

__all__ = ["trace_main"]


TRACE_HELP = """\
Agent-style trace W3: 8 distinct system prompts, each used by several 3-turn conversations,
interleaved. Reports the token hit rate, pool fill and mean TTFT vs the cache off with a KV budget
that holds everything, one that holds about a quarter of it (eviction at work), and the quarter
with a disk tier of 4x the pool; the Belady (offline-optimal) hit rate for the quarter budget; the
trace replayed with a disk tier of 1-4x the pool (write-through and evict, next to Belady for pool
and disk together); and a replayed multi-session agent trace (seeds 2-13) at 1/8, 1/4, 1/2 budget
under each eviction policy (lru, shared, slru, adaptive-shared, adaptive: the default) next to
the optimal hit rate."""


def _conversations(args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, user turns) per conversation; several conversations per system prompt."""
    rng = random.Random(1)
    systems = [[rng.randrange(100, 49000) for _ in range(args.system_len)] for _ in range(8)]

    def turns() -> list[list[int]]:
        return [[rng.randrange(100, 49000) for _ in range(args.turn_len)] for _ in range(3)]

    convs = [(systems[i % 8], turns()) for i in range(8 * args.convs_per_system)]
    rng.shuffle(convs)
    return convs


Row = tuple[float, int, int]
"""One request of the trace: (TTFT seconds, cached tokens, prompt tokens)."""


def _run_trace(
    eng: Engine, args: argparse.Namespace, rows: list[Row] | None = None
) -> tuple[dict[str, float], list[Step]]:
    """Run the trace; append one ``Row`` per request to ``rows`` when given."""
    convs = _conversations(args)
    history = [list(system) for system, _ in convs]
    ttfts, prompt_tokens, cached, fills, steps = [], 0, 0, [], []
    for turn in range(3):  # NOTE: interleaved: every conversation's turn k before any turn k+1
        for i, (_, turns) in enumerate(convs):
            history[i] += turns[turn]
            prompt = list(history[i])
            c = ttft(eng, prompt, max_tokens=args.gen_tokens)
            history[i] += c.token_ids
            steps.append((prompt, list(history[i])))
            ttfts.append(c.metrics.ttft_s)
            if rows is not None:
                rows.append((c.metrics.ttft_s, c.usage.cached_tokens, c.usage.prompt_tokens))
            prompt_tokens += c.usage.prompt_tokens
            cached += c.usage.cached_tokens
            fills.append(eng.cache_stats().pool_fill)
    eng.drain_disk()
    stats = eng.cache_stats()
    eng.check_integrity()
    eng.close()
    return {
        "hit_rate": cached / prompt_tokens,
        "disk_hit_rate": stats.disk_hit_tokens / prompt_tokens,
        "mean_ttft_s": statistics.fmean(ttfts),
        "pool_fill": statistics.fmean(fills),
        "bytes_used": float(stats.bytes_used),
        "evicted_blocks": float(stats.num_evictions),
        "disk_bytes_used": float(stats.disk.bytes_used if stats.disk else 0),
        "disk_mean_load_ms": stats.disk.mean_load_ms if stats.disk else 0.0,
        "disk_bytes_written_per_prompt_token": (
            stats.disk.bytes_written / prompt_tokens if stats.disk else 0.0
        ),
    }, steps


def _disk_rows(steps: list[Step], capacity: int, block_size: int) -> dict[str, float]:
    """The trace replayed with a disk tier of 1-4x the pool, each disk policy, next to Belady
    for the pool and disk together (one cache of (1 + k) x the pool: an upper bound)."""
    out: dict[str, float] = {}
    for k in (1, 2, 3, 4):
        for disk_policy in ("write-through", "evict"):
            with tempfile.TemporaryDirectory(prefix="agentcache-bench-replay-") as path:
                disk = make_disk(Path(path), k * capacity, block_size)
                r = replay(steps, capacity_blocks=capacity, block_size=block_size,
                           policy="adaptive", disk=disk, disk_policy=disk_policy)  # fmt: skip
                disk.close()
            name = disk_policy.replace("-", "_")
            out[f"quarter_disk{k}x_replayed_{name}_hit_rate"] = r.hit_rate
        out[f"quarter_disk{k}x_belady_hit_rate"] = belady(
            steps, capacity_blocks=(1 + k) * capacity, block_size=block_size
        )
    return out


AGENT_SEEDS = tuple(range(2, 14))
"""Seeds of the agent-sessions trace replayed (2 is the default trace; ``--agent-seeds`` takes
the first N)."""
BUDGETS = (("eighth", 8), ("quarter", 4), ("half", 2))
POLICIES: tuple[EvictionPolicy, ...] = ("lru", "shared", "slru", "adaptive-shared", "adaptive")


def _agents_key(seed: int, budget: str, policy: str) -> str:
    """JSON key of one replay (seed 2 keeps the keys it had before other seeds were added)."""
    name = policy.replace("-", "_")
    return f"agents_{budget}_{name}_hit_rate" if seed == 2 else (
        f"agents_seed{seed}_{budget}_{name}_hit_rate")  # fmt: skip


def _agent_sessions_rows(block_size: int, seeds: tuple[int, ...]) -> dict[str, float]:
    """Replayed multi-session agent trace: hit rates per seed, budget fraction and policy, and
    Belady (no model: the trace is synthetic)."""
    out: dict[str, float] = {}
    for seed in seeds:
        steps = agent_sessions(seed=seed)
        total = distinct_blocks(steps, block_size)
        if seed == 2:
            full = replay(steps, capacity_blocks=total, block_size=block_size, policy="lru")
            out["agents_full_hit_rate"] = full.hit_rate
        for name, frac in BUDGETS:
            cap = total // frac
            for policy in POLICIES:
                r = replay(steps, capacity_blocks=cap, block_size=block_size, policy=policy)
                out[_agents_key(seed, name, policy)] = r.hit_rate
            out[_agents_key(seed, name, "belady")] = belady(steps, capacity_blocks=cap,
                                                            block_size=block_size)  # fmt: skip
    return out


def _agents_table(result: dict[str, Any], seeds: tuple[int, ...]) -> Table:
    """Seed x budget rows, a column per eviction policy and Belady (prompt tokens hit, %)."""
    table = Table(title="multi-session agent trace replayed: prompt tokens hit (%)",
                  box=box.SIMPLE_HEAD, title_justify="left")  # fmt: skip
    for name in ("seed", "budget", *POLICIES[:-1], "adaptive (default)", "Belady"):
        table.add_column(name, justify="right")
    for seed in seeds:
        for name, frac in BUDGETS:
            cells = [result[_agents_key(seed, name, p)] for p in (*POLICIES, "belady")]
            table.add_row(str(seed), f"1/{frac}", *(f"{100 * c:.1f}" for c in cells))
    return table


@restores_torch_threads
def trace_main(argv: list[str]) -> int:
    """``agentcache bench trace``: W3 hit rate, fill and TTFT vs cache off; disk tier; Belady."""
    p = argparse.ArgumentParser(prog="agentcache bench trace", description=TRACE_HELP)
    add_common_options(p, layers=4, repeats=1)
    p.add_argument(
        "--system-len", type=positive_int, default=1000, help="tokens per system prompt (8 of them)"
    )
    p.add_argument("--convs-per-system", type=positive_int, default=3, help="conversations each")
    p.add_argument("--turn-len", type=positive_int, default=30, help="tokens per user turn")
    p.add_argument("--gen-tokens", type=positive_int, default=8, help="tokens generated per turn")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="hit rate and TTFT plots")
    p.add_argument(
        "--agent-seeds",
        type=positive_int,
        default=len(AGENT_SEEDS),
        help=f"agent-sessions traces replayed: seeds 2 to 1 + N (at most {len(AGENT_SEEDS)})",
    )
    args = p.parse_args(argv)
    if (problem := check_plot_path(args.plot)) is not None:
        p.error(problem)
    if args.agent_seeds > len(AGENT_SEEDS):
        p.error(f"--agent-seeds is at most {len(AGENT_SEEDS)} (seeds 2-13), got {args.agent_seeds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _trace(args)
    except KeyboardInterrupt:
        print("agentcache bench trace: interrupted", file=sys.stderr)
        return 130


def _trace(args: argparse.Namespace) -> int:
    rows: dict[str, list[Row]] = {name: [] for name in ("full", "quarter", "quarter+disk", "off")}
    model = w1_model(args)
    full, _ = _run_trace(bench_engine(model, kv_bytes=1 << 34), args, rows["full"])
    quarter_bytes = int(full["bytes_used"]) // 4
    quarter_eng = bench_engine(model, kv_bytes=quarter_bytes)
    pool, block_size = quarter_eng.prefix_cache.pool, quarter_eng.prefix_cache.pool.block_size
    capacity, pool_bytes = pool.num_blocks, pool.bytes_total
    quarter, steps = _run_trace(quarter_eng, args, rows["quarter"])
    with tempfile.TemporaryDirectory(prefix="agentcache-bench-disk-") as disk_dir:
        disk_eng = bench_engine(model, kv_bytes=quarter_bytes, disk_dir=disk_dir,
                                disk_bytes=4 * pool_bytes)  # fmt: skip
        disk, _ = _run_trace(disk_eng, args, rows["quarter+disk"])
    off, _ = _run_trace(bench_engine(model, kv_bytes=0, prefix_cache=False), args, rows["off"])
    result: dict[str, Any] = {}
    for name, row in (("full", full), ("quarter", quarter), ("quarter_disk4x", disk)):
        result.update({f"{name}_{k}": v for k, v in row.items()})
        result[f"{name}_ttft_over_off"] = row["mean_ttft_s"] / off["mean_ttft_s"]
    result["quarter_budget_bytes"] = quarter_bytes
    result["quarter_disk_budget_bytes"] = 4 * pool_bytes
    result["cache_off_mean_ttft_s"] = off["mean_ttft_s"]
    result["quarter_belady_hit_rate"] = belady(steps, capacity_blocks=capacity,
                                               block_size=block_size)  # fmt: skip
    for policy in POLICIES:
        sim = replay(steps, capacity_blocks=capacity, block_size=block_size, policy=policy)
        result[f"quarter_replayed_{policy.replace('-', '_')}_hit_rate"] = sim.hit_rate
    result.update(_disk_rows(steps, capacity, block_size))
    result.update(_agent_sessions_rows(block_size, AGENT_SEEDS[: args.agent_seeds]))
    warnings = _print_trace(args, result, rows)
    if args.plot:
        plot_trace(
            args.plot, {f"{k} budget" if k != "off" else "cache off": v for k, v in rows.items()}
        )
        print(f"plot: {args.plot}")
    if args.json:
        spread = {f"ttft_{k}": Spread.ms(k, [r[0] for r in v]).as_json() for k, v in rows.items()}
        extra = {"ttft_spread": spread, "warnings": warnings}
        print(json.dumps({"workload": "W3", "layers": args.layers, **result, **extra}))
    return 0


def _print_trace(
    args: argparse.Namespace, result: dict[str, Any], rows: dict[str, list[Row]]
) -> list[str]:
    """Per budget: hit rate and TTFT min / median / max over the trace's requests; then the rest.
    Returns the warnings it printed (a cached run slower than cache off)."""
    ttfts = [Spread.ms(f"TTFT per request, {k}", [r[0] for r in v]) for k, v in rows.items()]
    keys = {"full": "full", "quarter": "quarter", "quarter+disk": "quarter_disk4x"}
    hits = [
        Spread(f"hit rate, {k}", "%", (100 * result[f"{v}_hit_rate"],)) for k, v in keys.items()
    ]
    ratios = [
        Spread(f"mean TTFT {k} / cache off", "x", (result[f"{v}_ttft_over_off"],))
        for k, v in keys.items()
    ]
    others = [
        Spread(key.replace("_", " "), "%", (100 * value,))
        for key, value in result.items()
        if key.endswith("hit_rate")
        and not key.startswith(("full_", "quarter_hit", "quarter_disk4x_hit", "agents_"))
    ]
    title = f"bench trace: W3, {args.layers} layers, {args.system_len}-token system prompts"
    warnings = [
        f"{r.name} is {r.median:.2f}x: the cached run was slower than the cache off "
        "(a noisy machine)"
        for r in ratios
        if r.median > 1
    ]
    print_tables(
        [
            spread_table(f"{title} (spread over the trace's requests)", [*hits, *ttfts, *ratios]),
            spread_table("replayed traces and optimal (Belady) hit rates", others),
            _agents_table(result, AGENT_SEEDS[: args.agent_seeds]),
        ],
        warnings,
    )
    return warnings
