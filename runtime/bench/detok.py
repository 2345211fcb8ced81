"""``python -m runtime.bench.detok``: detokenizer cost per token at output token 100 vs 2000.

Feeds a long token sequence (stdlib source text, encoded by the bundled tiny model's BPE
tokenizer) to ``Detokenizer.push`` one id at a time and times the pushes around two output
positions. Flat cost means O(1) work per token; a full re-decode grows with the output length.
It knows the detokenizer and a tokenizer only; no model runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from runtime.serve.argtypes import positive_int

__all__ = ["main"]

STOP = ["\n\nUser:", "</answer>"]
"""Stop strings that never appear, so every push also pays the stop-string check."""


def _token_ids(tokenizer: object, num_tokens: int) -> list[int]:
    import os

    ids: list[int] = []
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        ids += tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)  # type: ignore[attr-defined]
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise RuntimeError("not enough stdlib text")


def _push_times(
    tokenizer: object, ids: list[int], positions: list[int], window: int
) -> list[float]:
    """Mean seconds per push in ``[p - window, p + window)`` for each position ``p``."""
    from runtime.request.detokenizer import Detokenizer

    detok = Detokenizer(tokenizer, list(STOP))
    stamps = [0.0] * len(ids)
    for i, token in enumerate(ids):
        start = time.perf_counter()
        detok.push(token)
        stamps[i] = time.perf_counter() - start
    return [sum(stamps[p - window : p + window]) / (2 * window) for p in positions]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from runtime.models import resolve_model

    parser = argparse.ArgumentParser(prog="python -m runtime.bench.detok", description=__doc__)
    parser.add_argument("--repeats", type=positive_int, default=7, help="runs per figure")
    parser.add_argument("--window", type=positive_int, default=10, help="pushes averaged each side")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    positions = [100, 2000]
    ids = _token_ids(tokenizer, positions[-1] + args.window + 1)
    runs = [_push_times(tokenizer, ids, positions, args.window) for _ in range(args.repeats)]
    result: dict[str, object] = {}
    for i, pos in enumerate(positions):
        us = sorted(run[i] * 1e6 for run in runs)
        median = statistics.median(us)
        result[f"us_per_token_at_{pos}"] = {"min": us[0], "median": median, "max": us[-1]}
    ratios = sorted(run[1] / run[0] for run in runs)
    result["ratio_2000_over_100_median"] = round(statistics.median(ratios), 2)
    for key, value in result.items():
        shown = {k: round(v, 1) for k, v in value.items()} if isinstance(value, dict) else value
        print(f"{key:30s} {shown}")
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
