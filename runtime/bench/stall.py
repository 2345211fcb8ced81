"""``agentcache bench stall``: inter-token latency of running streams while long prompts arrive.

Streams decode on the W1-shaped random model; once they run, long prompts (cache off) arrive at
once. Prefill in one forward (``prefill_chunk_tokens`` above the prompt length: the behaviour
before chunked prefill) and in chunks are timed alternately in the same run, on two engines
sharing one model. Only the streams' gaps that overlap the long prompts' wait (their arrival to
their last first token) are counted: a handful per round (one per stream and scheduler step), so
it prints the worst of them and their count, not percentiles, and the long prompts' TTFT,
min/median/max over rounds, with the noise warnings of ``_figures``. With ``--chunk-reuse`` each
long prompt is a short head, four documents (most of the prompt, new each round, so every chunk
misses the chunk store: the costly case) and a short question, sent with chunk reuse: the
whole-prompt engine then assembles it in one iteration (the behaviour before the assembly was
spread over iterations). It knows nothing about HTTP.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from typing import Any

import torch

from runtime.bench._common import (
    NullTokenizer,
    add_common_options,
    report,
    restores_torch_threads,
    w1_model,
)
from runtime.bench._figures import Spread, noise_warnings, print_tables, spread_table
from runtime.bench.rag import chunk_plan, rag_request, random_ids
from runtime.chunks.spans import CHUNK_MODES, DEFAULT_RECOMPUTE_FRACTION, ChunkReuse
from runtime.engine import Engine
from runtime.request.state import Request
from runtime.sampling.params import SamplingParams
from runtime.scheduler.loop import SchedulerConfig
from runtime.serve.argtypes import positive_int

__all__ = ["main", "run_round"]

HELP = """\
Inter-token gaps of running streams while long prompts arrive: whole-prompt prefill vs chunked
prefill, alternating on two engines sharing one W1-shaped random model. Counted: the streams' gaps
that overlap the long prompts' wait (from their arrival to their first token), a handful per round,
so it reports the worst gap and how many were counted (no percentiles), and the long prompts' TTFT;
min/median/max over rounds. --chunk-reuse sends each long prompt as four new documents with chunk
reuse (every chunk misses the chunk store)."""

_WHOLE = 1 << 20
"""A chunk size above any prompt: the whole prompt in one forward (no chunking)."""
_NUM_DOCS = 4
"""Documents per long prompt under ``--chunk-reuse``."""
_MIN_DOC_PROMPT = 16
"""Fewest ``--long-tokens`` under ``--chunk-reuse`` (a head, four documents, a question)."""


def _engine(model: Any, chunk: int) -> Engine:
    config = SchedulerConfig(prefill_chunk_tokens=chunk)
    return Engine(model, NullTokenizer(), model_id="bench-w1", kv_cache_bytes=1 << 26,
                  prefix_cache=False, scheduler=config)  # fmt: skip


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 49000 + 100 for i in range(n)]


def _head_len(num_tokens: int) -> int:
    """Tokens before the documents of a ``num_tokens`` long prompt (32 of 2048)."""
    return max(1, num_tokens // 64)


def _doc_len(num_tokens: int) -> int:
    """Tokens per document of a ``num_tokens`` long prompt: what the head, a question of at
    least ``num_tokens // 128`` tokens and a separator after each document leave (499 of 2048)."""
    return (num_tokens - _head_len(num_tokens) - max(1, num_tokens // 128)) // _NUM_DOCS - 1


def _long_prompt(args: argparse.Namespace, seed: int) -> tuple[list[int], ChunkReuse | None]:
    """A long prompt of ``--long-tokens`` ids and its chunk plan (None without
    ``--chunk-reuse``): then a head, four random documents drawn from ``seed`` and a question."""
    if args.chunk_reuse is None:
        return _ids(seed, args.long_tokens), None
    rng, n = random.Random(seed), args.long_tokens
    head, doc_len = random_ids(rng, _head_len(n)), _doc_len(n)
    docs = [random_ids(rng, doc_len) for _ in range(_NUM_DOCS)]
    question_len = n - len(head) - _NUM_DOCS * (doc_len + 1)
    ids, spans = rag_request(rng, docs, head, _NUM_DOCS, question_len)
    return ids, chunk_plan(args.chunk_reuse, spans, DEFAULT_RECOMPUTE_FRACTION)


def _times(eng: Engine, req: Request, out: list[float]) -> None:
    for _ in eng.run(req):
        out.append(time.perf_counter())


def run_round(eng: Engine, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One round: ``--streams`` decoding, then ``--long`` prompts at once.

    Returns ``itl_worst_s`` (the longest of the streams' gaps overlapping the long prompts' wait,
    seconds; 0.0 when none did), ``itl_gaps`` (how many gaps overlapped it) and ``long_ttft_s``
    (the long prompts' arrival to their last first token, seconds). Under ``--chunk-reuse`` it
    adds the long prompts' mean chunk-reused and missed tokens (their usage) as
    ``chunk_reused_tokens`` and ``chunk_missed_tokens``.
    """
    params = SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True)
    streams = [eng.make_request(_ids(seed * 100 + i, 32), params) for i in range(args.streams)]
    stamps: list[list[float]] = [[] for _ in streams]
    threads = [
        threading.Thread(target=_times, args=(eng, r, s))
        for r, s in zip(streams, stamps, strict=True)
    ]
    prompts = [_long_prompt(args, seed * 100 + 50 + i) for i in range(args.long)]
    longs = [eng.make_request(ids, SamplingParams(max_tokens=1, ignore_eos=True), chunk_reuse=plan)
             for ids, plan in prompts]  # fmt: skip
    ends: list[list[float]] = [[] for _ in longs]
    extra = [
        threading.Thread(target=_times, args=(eng, r, e)) for r, e in zip(longs, ends, strict=True)
    ]
    # NOTE: the loop is stepped by hand until every stream has a few tokens and the long prompts
    # are queued, so they always arrive mid-stream: a busy machine once let the short streams
    # finish before this thread woke to send them (no gap seen, itl_max 0).
    warm = min(4, args.stream_tokens - 1)
    eng.scheduler.pause()
    try:
        for t in threads:
            t.start()
        while min(len(r.output_ids) for r in streams) < warm:
            eng.scheduler.step()
        for t in extra:
            t.start()
        # NOTE: a sender that died (its request refused) ends the wait instead of hanging it
        while eng.scheduler.stats().num_waiting < len(longs) and all(t.is_alive() for t in extra):
            time.sleep(0.001)
        t0 = time.perf_counter()
    finally:
        eng.scheduler.resume()
    for t in [*threads, *extra]:
        t.join()
    last_long = max(e[-1] for e in ends)
    gaps = _stalled_gaps(stamps, t0, last_long)
    result = {
        "itl_worst_s": max(gaps, default=0.0),
        "itl_gaps": float(len(gaps)),
        "long_ttft_s": last_long - t0,
    }
    if args.chunk_reuse is not None:
        usages = [r.chunk_usage for r in longs if r.chunk_usage is not None]
        assert len(usages) == len(longs), "a finished chunk request reports its chunk usage"
        result["chunk_reused_tokens"] = statistics.fmean(u.reused_tokens for u in usages)
        result["chunk_missed_tokens"] = statistics.fmean(u.missed_tokens for u in usages)
    return result


def _stalled_gaps(stamps: list[list[float]], start: float, end: float) -> list[float]:
    """The streams' inter-token gaps (seconds) that overlap ``[start, end]``: the long prompts'
    wait. NOTE: gaps outside it are plain decode steps, the same for both engines; counting them
    would dilute the stall the bench is about."""
    return [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b > start and a < end]


def _spreads(results: dict[str, list[dict[str, float]]]) -> tuple[list[Spread], list[Spread]]:
    """(timings and gap counts per engine, the per-round worst-gap ratio whole / chunked)."""
    figures: list[Spread] = []
    for name, rounds in results.items():
        figures.append(Spread.ms(f"worst gap, {name}", [r["itl_worst_s"] for r in rounds]))
        figures.append(
            Spread(f"gaps counted, {name}", "gaps", tuple(r["itl_gaps"] for r in rounds))
        )
        figures.append(Spread.ms(f"long prompts' TTFT, {name}", [r["long_ttft_s"] for r in rounds]))
    whole, chunked = results.values()
    pairs = zip(whole, chunked, strict=True)
    ratio = tuple(w["itl_worst_s"] / max(c["itl_worst_s"], 1e-9) for w, c in pairs)
    return figures, [Spread("worst gap whole / chunked", "x", ratio)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentcache bench stall", description=HELP)
    add_common_options(p, layers=30, repeats=3)
    p.add_argument("--streams", type=positive_int, default=4, help="decoding streams")
    p.add_argument("--stream-tokens", type=positive_int, default=48, help="tokens per stream")
    p.add_argument("--long", type=positive_int, default=2, help="long prompts arriving at once")
    p.add_argument("--long-tokens", type=positive_int, default=2048, help="tokens per long prompt")
    p.add_argument("--chunk", type=positive_int, default=SchedulerConfig().prefill_chunk_tokens,
                   help="prefill_chunk_tokens of the chunked engine")  # fmt: skip
    p.add_argument(
        "--chunk-reuse",
        choices=CHUNK_MODES,
        default=None,
        help="long prompts of four new documents each, sent with chunk reuse in this "
        "mode (every chunk misses the chunk store); default: plain prompts",
    )
    return p


@restores_torch_threads
def main(argv: list[str]) -> int:
    """Entry of ``agentcache bench stall``; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.chunk_reuse is not None and args.long_tokens < _MIN_DOC_PROMPT:
        parser.error(
            f"--chunk-reuse needs --long-tokens >= {_MIN_DOC_PROMPT} "
            f"(a head, {_NUM_DOCS} documents, a question), got {args.long_tokens}"
        )
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
    for eng in engines.values():
        eng.close()
    _report(args, results)
    return 0


def _report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> None:
    """The header lines, the spread tables and warnings; with ``--json`` one JSON object last:
    the header, ``spread`` (each figure's unit and min / median / max / n), ``warnings`` and,
    under ``--chunk-reuse``, each engine's mean chunk-reused and missed tokens per long prompt."""
    header: dict[str, Any] = {"layers": args.layers, "streams": args.streams,
                              "long prompts": args.long, "long tokens": args.long_tokens,
                              "threads": torch.get_num_threads()}  # fmt: skip
    usage: dict[str, float] = {}
    if args.chunk_reuse is not None:
        header["chunk reuse"] = (
            f"{args.chunk_reuse}, {_NUM_DOCS} documents x "
            f"{_doc_len(args.long_tokens)} tokens, new each round"
        )
        for name, rounds in results.items():
            for key in ("chunk_reused_tokens", "chunk_missed_tokens"):
                usage[f"{name} {key} per long"] = statistics.fmean(r[key] for r in rounds)
    figures, ratios = _spreads(results)
    warnings = noise_warnings([f for f in figures if f.unit == "ms"], ratios)
    report({**header, **usage}, as_json=False, header={})
    title = "streams' gaps overlapping the long prompts' wait"
    print_tables([spread_table(title, figures), spread_table("same-run ratio", ratios)], warnings)
    if args.json:
        spread = {s.name: s.as_json() for s in (*figures, *ratios)}
        print(json.dumps({**header, **usage, "spread": spread, "warnings": warnings}))
