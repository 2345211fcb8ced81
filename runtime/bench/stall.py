"""``agentcache bench stall``: inter-token latency of running streams while long prompts arrive.

Streams decode on the W1-shaped random model; once they run, long prompts (cache off) arrive at
once. Prefill in one forward (``prefill_chunk_tokens`` above the prompt length: the behaviour
before chunked prefill) and in chunks are timed alternately in the same run, on two engines
sharing one model. It prints p50/p99/max inter-token gaps of the streams and the long prompts'
TTFT, min/median/max over rounds. It knows nothing about HTTP.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch

from runtime.bench._argtypes import positive_int
from runtime.bench._common import NullTokenizer, add_common_options, report, w1_model
from runtime.engine import Engine
from runtime.request import Request
from runtime.sampling import SamplingParams
from runtime.scheduler import SchedulerConfig

__all__ = ["main", "run_round"]

_WHOLE = 1 << 20
"""A chunk size above any prompt: the whole prompt in one forward (no chunking)."""


def _engine(model: Any, chunk: int) -> Engine:
    config = SchedulerConfig(prefill_chunk_tokens=chunk)
    eng = Engine(model, NullTokenizer(), model_id="bench-w1", kv_cache_bytes=1 << 26,
                 prefix_cache=False, scheduler=config)  # fmt: skip
    eng.eos_ids = frozenset()
    return eng


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 49000 + 100 for i in range(n)]


def _times(eng: Engine, req: Request, out: list[float]) -> None:
    for _ in eng.run(req):
        out.append(time.perf_counter())


def run_round(eng: Engine, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One round: ``--streams`` decoding, then ``--long`` prompts at once; gaps in seconds."""
    params = SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True)
    streams = [eng.make_request(_ids(seed * 100 + i, 32), params) for i in range(args.streams)]
    stamps: list[list[float]] = [[] for _ in streams]
    threads = [
        threading.Thread(target=_times, args=(eng, r, s))
        for r, s in zip(streams, stamps, strict=True)
    ]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 4:
        time.sleep(0.005)
    t0 = time.perf_counter()
    longs = [eng.make_request(_ids(seed * 100 + 50 + i, args.long_tokens),
                              SamplingParams(max_tokens=1)) for i in range(args.long)]  # fmt: skip
    ends: list[list[float]] = [[] for _ in longs]
    extra = [
        threading.Thread(target=_times, args=(eng, r, e)) for r, e in zip(longs, ends, strict=True)
    ]
    for t in [*extra]:
        t.start()
    for t in [*threads, *extra]:
        t.join()
    last_long = max(e[-1] for e in ends)
    # NOTE: only gaps overlapping the time from the long prompts' arrival to their first token.
    gaps = sorted(
        b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b > t0 and a < last_long
    )
    if not gaps:
        gaps = [0.0]
    return {
        "itl_p50_s": gaps[len(gaps) // 2],
        "itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "itl_max_s": gaps[-1],
        "long_ttft_s": last_long - t0,
    }


def _summary(rounds: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in rounds]
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentcache bench stall", description=__doc__)
    add_common_options(p, layers=30, repeats=3)
    p.add_argument("--streams", type=positive_int, default=4, help="decoding streams")
    p.add_argument("--stream-tokens", type=positive_int, default=48, help="tokens per stream")
    p.add_argument("--long", type=positive_int, default=2, help="long prompts arriving at once")
    p.add_argument("--long-tokens", type=positive_int, default=2048, help="tokens per long prompt")
    p.add_argument("--chunk", type=positive_int, default=SchedulerConfig().prefill_chunk_tokens,
                   help="prefill_chunk_tokens of the chunked engine")  # fmt: skip
    return p


def main(argv: list[str]) -> int:
    """Entry of ``agentcache bench stall``; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = w1_model(args)
    engines = {"whole": _engine(model, _WHOLE), f"chunk{args.chunk}": _engine(model, args.chunk)}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for eng in engines.values():
        run_round(eng, args, seed=0)  # warm-up (allocations, thread pools)
    for rep in range(args.repeats):
        for name, eng in engines.items():  # NOTE: alternating A/B within each repeat
            results[name].append(run_round(eng, args, seed=rep + 1))
    out: dict[str, Any] = {}
    for name, rounds in results.items():
        for key in ("itl_p50_s", "itl_p99_s", "itl_max_s", "long_ttft_s"):
            out[f"{name} {key} min/med/max"] = _summary(rounds, key)
    whole, chunked = results.values()
    ratios = [
        w["itl_p99_s"] / max(c["itl_p99_s"], 1e-9) for w, c in zip(whole, chunked, strict=True)
    ]
    out["p99 ITL whole / chunked (per round)"] = " ".join(f"{r:.2f}" for r in ratios)
    for eng in engines.values():
        eng.close()
    header = {"layers": args.layers, "streams": args.streams, "long prompts": args.long,
              "long tokens": args.long_tokens, "threads": torch.get_num_threads()}  # fmt: skip
    report(out, args.json, header)
    return 0
