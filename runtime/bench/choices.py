"""``agentcache bench choices``: ``n = 4`` from one prefill vs four requests; grammar cost/token.

Figure 1 (W1-shaped random model, token ids): wall time and tokens/s of one request with
``n = 4`` against four separate requests submitted together, with the prefix cache off (four
prefills) and on (the first stores the prompt, the others hit its whole blocks). Figure 2 (the
bundled ``tiny`` model, a real tokenizer): decode time per token with and without a JSON-schema
grammar, one row and a batch of rows. Same run, min/median/max over ``--repeats``, with the
noise warnings of ``_figures``; a grammar overhead that the free and constrained spreads cannot
tell from zero is a warning, not a figure. A script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from runtime.bench._common import (
    add_common_options,
    bench_engine,
    report,
    restores_torch_threads,
    w1_model,
)
from runtime.bench._figures import Spread, noise_warnings, print_tables, spread_table
from runtime.engine import Engine
from runtime.outputs import Completion
from runtime.sampling.grammar import Grammar, JsonSchemaSpec
from runtime.sampling.params import SamplingParams
from runtime.serve.argtypes import positive_int

__all__ = ["grammar_overhead", "main"]

HELP = """\
n=4 choices from one prefill vs four separate requests (cache off and on), and the decode-time
overhead per token of grammar-constrained (JSON schema) decoding. Same-run ratios, min/median/max
over --repeats; an overhead whose constrained and free runs overlap (or come out negative) is below
the noise: a warning and n/a (null in --json), not a figure."""

_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
    "required": ["notes"],
}


def _drain(streams: list[Any]) -> list[Completion]:
    """Read every stream to its end, round-robin (they decode together in the scheduler)."""
    done: list[Completion | None] = [None] * len(streams)
    while any(c is None for c in done):
        for i, stream in enumerate(streams):
            if done[i] is None:
                delta = next(stream)
                done[i] = delta.completion
    return [c for c in done if c is not None]


def _choices_run(
    eng: Engine, prompt: list[int], args: argparse.Namespace, *, grouped: bool
) -> float:
    """Seconds for ``args.n`` choices of ``prompt``: one request with ``n``, or ``n`` requests."""
    eng.flush_cache()
    params = SamplingParams(max_tokens=args.gen_tokens, temperature=1.0, seed=0, ignore_eos=True)
    start = time.perf_counter()
    if grouped:
        streams = eng.stream_choices(prompt, params, n=args.n)
    else:
        streams = [s for _ in range(args.n) for s in eng.stream_choices(prompt, params)]
    _drain(streams)
    return time.perf_counter() - start


def _stats(name: str, times: list[float], tokens: int) -> dict[str, float]:
    return {
        f"{name}_s_min": min(times),
        f"{name}_s_median": statistics.median(times),
        f"{name}_s_max": max(times),
        f"{name}_tok_per_s_median": tokens / statistics.median(times),
    }


def _figure_choices(args: argparse.Namespace) -> tuple[dict[str, Any], list[Spread]]:
    """Figure 1's medians by key, and its timings (ms) and per-run ratios over the repeats."""
    model = w1_model(args)
    prompt = [100 + (7 * i) % 40000 for i in range(args.prompt_len)]
    tokens = args.n * args.gen_tokens
    out: dict[str, Any] = {}
    spreads: list[Spread] = []
    for cache in ("off", "on"):
        eng = bench_engine(
            model, kv_bytes=1 << 31 if cache == "on" else 0, prefix_cache=cache == "on"
        )
        _choices_run(eng, prompt, args, grouped=True)  # NOTE: warm-up (allocations, kernels)
        grouped = [_choices_run(eng, prompt, args, grouped=True) for _ in range(args.repeats)]
        separate = [_choices_run(eng, prompt, args, grouped=False) for _ in range(args.repeats)]
        out.update(_stats(f"n{args.n}_cache_{cache}", grouped, tokens))
        out.update(_stats(f"separate{args.n}_cache_{cache}", separate, tokens))
        out[f"speedup_cache_{cache}"] = statistics.median(separate) / statistics.median(grouped)
        spreads += [
            Spread.ms(f"n={args.n}, cache {cache}", grouped),
            Spread.ms(f"{args.n} requests, cache {cache}", separate),
            Spread(f"{args.n} requests / n={args.n}, cache {cache}", "x",
                   tuple(a / b for a, b in zip(separate, grouped, strict=True))),
        ]  # fmt: skip
        eng.close()
    return out, spreads


def _decode_s_per_token(eng: Engine, ids: list[int], rows: int, grammar: Grammar | None) -> float:
    """Mean decode seconds per token over ``rows`` greedy rows decoded together."""
    params = SamplingParams(max_tokens=48, ignore_eos=grammar is None)
    streams = [s for _ in range(rows) for s in eng.stream_choices(ids, params, grammar=grammar)]
    done = _drain(streams)
    per_token = [1.0 / c.metrics.decode_tokens_per_s for c in done if c.metrics.decode_tokens_per_s]
    return statistics.fmean(per_token)


def grammar_overhead(free: Spread, bound: Spread) -> tuple[float | None, str | None]:
    """The grammar's added time per token (``bound``'s median minus ``free``'s, in their unit),
    or None and a warning where the noise hides it.

    Args:
        free: Decode time per token without a grammar, over the repeats.
        bound: The same with the grammar, same run.

    Returns:
        ``(overhead, None)``, or ``(None, warning)`` when the difference's spread reaches zero
        (``bound.min <= free.max``: the fastest constrained run was no slower than the slowest
        free one), which includes every negative median difference.
    """
    overhead = bound.median - free.median
    if bound.min > free.max:
        return overhead, None
    return None, (
        f"{bound.name} minus {free.name} is below the noise ({overhead:+.2f} {bound.unit} at "
        f"the medians; constrained {bound.min:.2f}-{bound.max:.2f} vs free "
        f"{free.min:.2f}-{free.max:.2f} {bound.unit}): no overhead figure"
    )


def _figure_grammar(args: argparse.Namespace) -> tuple[dict[str, Any], list[Spread], list[str]]:
    """Figure 2's figures by key, its per-token timings (ms) and the overheads' warnings."""
    eng = Engine.from_pretrained("tiny", kv_cache_bytes=64 << 20)
    ids = eng.render_chat([{"role": "user", "content": "List notes on the json module as JSON."}])
    grammar = eng.compile_grammar(JsonSchemaSpec(json.dumps(_SCHEMA)))
    out: dict[str, Any] = {}
    spreads: list[Spread] = []
    warnings: list[str] = []
    for rows in (1, args.grammar_rows):
        _decode_s_per_token(eng, ids, rows, grammar)  # NOTE: warm-up
        free, bound = (
            Spread.ms(
                f"{label}, {rows} rows, per token",
                [_decode_s_per_token(eng, ids, rows, g) for _ in range(args.repeats)],
            )
            for label, g in (("free", None), ("grammar", grammar))
        )
        overhead, warning = grammar_overhead(free, bound)
        out[f"rows{rows}_free_ms_per_token_median"] = free.median
        out[f"rows{rows}_grammar_ms_per_token_min"] = bound.min
        out[f"rows{rows}_grammar_ms_per_token_median"] = bound.median
        out[f"rows{rows}_grammar_ms_per_token_max"] = bound.max
        # NOTE: None (JSON null) where the noise hides the overhead; the warning says so.
        out[f"rows{rows}_grammar_overhead_ms_per_token"] = overhead
        out[f"rows{rows}_grammar_over_free"] = None if warning else bound.median / free.median
        spreads += [free, bound]
        warnings += [warning] if warning else []
    eng.close()
    return out, spreads, warnings


@restores_torch_threads
def main(argv: list[str]) -> int:
    """``agentcache bench choices``: n=4 vs four requests, and grammar overhead per token."""
    p = argparse.ArgumentParser(prog="agentcache bench choices", description=HELP)
    add_common_options(p, layers=8, repeats=3)
    p.add_argument("--n", type=positive_int, default=4, help="choices per request")
    p.add_argument("--prompt-len", type=positive_int, default=1024, help="prompt tokens (W1)")
    p.add_argument("--gen-tokens", type=positive_int, default=32, help="tokens per choice")
    p.add_argument("--grammar-rows", type=positive_int, default=8, help="batch rows (figure 2)")
    p.add_argument("--skip-choices", action="store_true", help="only the grammar figure")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {}
    spreads: list[Spread] = []
    if not args.skip_choices:
        figures, spreads = _figure_choices(args)
        result.update(figures)
    figures, timings, below_noise = _figure_grammar(args)
    result.update(figures)
    spreads += timings
    header = {"workload": "W1 n-choices + tiny grammar", "layers": args.layers, "n": args.n}
    _report(result, header, spreads, below_noise, as_json=args.json)
    return 0


def _report(
    result: dict[str, Any], header: dict[str, Any], spreads: list[Spread], below_noise: list[str],
    *, as_json: bool,
) -> None:  # fmt: skip
    """The figures by key (an overhead the noise hides: n/a), the spread table and warnings;
    with ``as_json`` one JSON object last: the figures, ``spread`` and ``warnings``."""
    timings = [s for s in spreads if s.unit == "ms"]
    warnings = below_noise + noise_warnings(timings, [s for s in spreads if s.unit == "x"])
    shown = {k: "n/a (below the noise: see the warnings)" if v is None else v
             for k, v in result.items()}  # fmt: skip
    report(shown, False, header)
    print_tables([spread_table("same run, over --repeats", spreads)], warnings)
    if as_json:
        spread = {s.name: s.as_json() for s in spreads}
        print(json.dumps({**header, **result, "spread": spread, "warnings": warnings}))
