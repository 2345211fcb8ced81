"""``agentcache bench trace`` (W3): an interleaved agent trace, hit rate and TTFT vs the cache off.

Random-weight models built from configs (no downloads), CPU by default.
A script, never a timed test.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import torch

from runtime.bench._argtypes import positive_int
from runtime.bench._common import add_common_options, bench_engine, report, ttft, w1_model
from runtime.engine import Engine

__all__ = ["trace_main"]


TRACE_HELP = """\
Agent-style trace W3: 8 distinct system prompts, each used by several 3-turn conversations,
interleaved. Reports the token hit rate and mean TTFT vs the cache off, with a KV budget that
holds everything and one that holds about a quarter of it (eviction at work)."""


def _conversations(args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, user turns) per conversation; several conversations per system prompt."""
    rng = random.Random(1)
    systems = [[rng.randrange(100, 49000) for _ in range(args.system_len)] for _ in range(8)]

    def turns() -> list[list[int]]:
        return [[rng.randrange(100, 49000) for _ in range(args.turn_len)] for _ in range(3)]

    convs = [(systems[i % 8], turns()) for i in range(8 * args.convs_per_system)]
    rng.shuffle(convs)
    return convs


def _run_trace(eng: Engine, args: argparse.Namespace) -> dict[str, float]:
    convs = _conversations(args)
    history = [list(system) for system, _ in convs]
    ttfts, prompt_tokens, cached = [], 0, 0
    for turn in range(3):  # NOTE: interleaved: every conversation's turn k before any turn k+1
        for i, (_, turns) in enumerate(convs):
            history[i] += turns[turn]
            c = ttft(eng, history[i], max_tokens=args.gen_tokens)
            history[i] += c.token_ids
            ttfts.append(c.metrics.ttft_s)
            prompt_tokens += c.usage.prompt_tokens
            cached += c.usage.cached_tokens
    stats = eng.cache_stats()
    return {
        "hit_rate": cached / prompt_tokens,
        "mean_ttft_s": statistics.fmean(ttfts),
        "bytes_used": float(stats.bytes_used),
        "evicted_blocks": float(stats.num_evictions),
    }


def trace_main(argv: list[str]) -> int:
    """``agentcache bench trace``: W3 agent trace, hit rate and TTFT vs cache off, two budgets."""
    p = argparse.ArgumentParser(prog="agentcache bench trace", description=TRACE_HELP)
    add_common_options(p, layers=4, repeats=1)
    p.add_argument(
        "--system-len", type=positive_int, default=1000, help="tokens per system prompt (8 of them)"
    )
    p.add_argument("--convs-per-system", type=positive_int, default=3, help="conversations each")
    p.add_argument("--turn-len", type=positive_int, default=30, help="tokens per user turn")
    p.add_argument("--gen-tokens", type=positive_int, default=8, help="tokens generated per turn")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = w1_model(args)
    full = _run_trace(bench_engine(model, kv_bytes=1 << 34), args)
    quarter_bytes = int(full["bytes_used"]) // 4
    quarter = _run_trace(bench_engine(model, kv_bytes=quarter_bytes), args)
    off = _run_trace(bench_engine(model, kv_bytes=0, prefix_cache=False), args)
    result: dict[str, Any] = {f"full_{k}": v for k, v in full.items()}
    result.update({f"quarter_{k}": v for k, v in quarter.items()})
    result["quarter_budget_bytes"] = quarter_bytes
    result["cache_off_mean_ttft_s"] = off["mean_ttft_s"]
    result["full_ttft_over_off"] = full["mean_ttft_s"] / off["mean_ttft_s"]
    result["quarter_ttft_over_off"] = quarter["mean_ttft_s"] / off["mean_ttft_s"]
    report(result, args.json, {"workload": "W3", "layers": args.layers})
    return 0
