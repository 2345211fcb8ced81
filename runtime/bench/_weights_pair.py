"""``bench prefix --compare-weights``: one model's decode rate under two weight types, measured in
one process with the two engines taking turns, so both see the same host.

Each engine gets its own copy of the model (a quantized engine frees the fp32 weights it was
built from). Knows nothing of the TTFT figures, the peers or the prefix cache's contract.
"""

from __future__ import annotations

import argparse
import random
import statistics

from runtime.bench._common import bench_engine, ttft, w1_model
from runtime.bench._figures import Spread
from runtime.engine import Engine
from runtime.model.runner import WeightsDtype

__all__ = ["measure_weights_pair"]


def measure_weights_pair(args: argparse.Namespace) -> tuple[list[Spread], dict[str, float]]:
    """Decode tokens/s of ``args.weights`` and ``args.compare_weights`` on the same prompt.

    The prompt (``prefix_len + suffix_len`` random ids) is run once on each engine, so every
    timed request is a prefix-cache hit that then decodes ``decode_tokens`` greedy tokens at that
    depth. ``repeats`` rounds of one request per engine, the order alternating each round.

    Returns:
        ``(spreads, medians)``: the two engines' rates (tok/s) and the per-round ratio
        ``weights / compare_weights`` (x), each over the rounds; and the same as JSON-ready
        medians plus the ratio's min and max.

    Raises:
        RuntimeError: A request measured no decode time (its rate is 0).
    """
    names = (args.weights, args.compare_weights)
    engines: list[Engine] = []
    try:
        for weights in names:
            engines.append(_engine(args, weights))
        rates = _alternate(args, engines)
    finally:
        for eng in engines:
            eng.close()
    ratios = tuple(a / b for a, b in zip(rates[0], rates[1], strict=True))
    label = f"{names[0]} / {names[1]}"
    spreads = [Spread(names[0], "tok/s", rates[0]), Spread(names[1], "tok/s", rates[1]),
               Spread(label, "x", ratios)]  # fmt: skip
    medians = {
        "decode_tokens_per_s": statistics.median(rates[0]),
        "compare_decode_tokens_per_s": statistics.median(rates[1]),
        "decode_ratio_min": min(ratios),
        "decode_ratio_median": statistics.median(ratios),
        "decode_ratio_max": max(ratios),
    }
    return spreads, medians


def _engine(args: argparse.Namespace, weights: WeightsDtype) -> Engine:
    """An engine of its own copy of the model (``w1_model`` rounds bf16 weights in place)."""
    model = w1_model(argparse.Namespace(**{**vars(args), "weights": weights}), model=args.model)
    return bench_engine(model, kv_bytes=args.kv_cache_bytes, weights=weights,
                        kv_dtype=args.kv_dtype)  # fmt: skip


def _alternate(args: argparse.Namespace, engines: list[Engine]) -> list[tuple[float, ...]]:
    """Per engine, the decode rate of each round (tok/s)."""
    vocab = 49000  # NOTE: random ids below every bench model's vocabulary (prefix.py checks it)
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prefix_len + args.suffix_len)]
    for eng in engines:  # NOTE: the prompt's KV then lies in each prefix cache: timed runs hit
        ttft(eng, prompt)
    rates: list[list[float]] = [[] for _ in engines]
    for turn in range(args.repeats):
        order = range(len(engines)) if turn % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            done = ttft(engines[i], prompt, max_tokens=args.decode_tokens)
            rate = done.metrics.decode_tokens_per_s
            if rate <= 0:  # NOTE: a ratio needs both rates (0.0: no decode time was measured)
                weights = engines[i].weights
                raise RuntimeError(f"bench prefix --compare-weights: no decode rate ({weights})")
            rates[i].append(rate)
    return [tuple(r) for r in rates]
