"""``agentcache bench choices``: ``n = 4`` from one prefill vs four requests; grammar cost/token.

Figure 1 (W1-shaped random model, token ids): wall time and tokens/s of one request with
``n = 4`` against four separate requests submitted together, with the prefix cache off (four
prefills) and on (the first stores the prompt, the others hit its whole blocks). Figure 2 (the
bundled ``tiny`` model, a real tokenizer): decode time per token with and without a JSON-schema
grammar, one row and a batch of rows. Same run, min/median/max over ``--repeats``. A script,
never a timed test.
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
from runtime.engine import Engine
from runtime.outputs import Completion
from runtime.sampling.grammar import Grammar, JsonSchemaSpec
from runtime.sampling.params import SamplingParams
from runtime.serve.argtypes import positive_int

__all__ = ["main"]

HELP = """\
n=4 choices from one prefill vs four separate requests (cache off and on), and the decode-time
overhead per token of grammar-constrained (JSON schema) decoding. Same-run ratios."""

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


def _figure_choices(args: argparse.Namespace) -> dict[str, Any]:
    model = w1_model(args)
    prompt = [100 + (7 * i) % 40000 for i in range(args.prompt_len)]
    tokens = args.n * args.gen_tokens
    out: dict[str, Any] = {}
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
        eng.close()
    return out


def _decode_s_per_token(eng: Engine, ids: list[int], rows: int, grammar: Grammar | None) -> float:
    """Mean decode seconds per token over ``rows`` greedy rows decoded together."""
    params = SamplingParams(max_tokens=48, ignore_eos=grammar is None)
    streams = [s for _ in range(rows) for s in eng.stream_choices(ids, params, grammar=grammar)]
    done = _drain(streams)
    per_token = [1.0 / c.metrics.decode_tokens_per_s for c in done if c.metrics.decode_tokens_per_s]
    return statistics.fmean(per_token)


def _figure_grammar(args: argparse.Namespace) -> dict[str, Any]:
    eng = Engine.from_pretrained("tiny", kv_cache_bytes=64 << 20)
    ids = eng.render_chat([{"role": "user", "content": "List notes on the json module as JSON."}])
    grammar = eng.compile_grammar(JsonSchemaSpec(json.dumps(_SCHEMA)))
    out: dict[str, Any] = {}
    for rows in (1, args.grammar_rows):
        _decode_s_per_token(eng, ids, rows, grammar)  # NOTE: warm-up
        free = [_decode_s_per_token(eng, ids, rows, None) for _ in range(args.repeats)]
        bound = [_decode_s_per_token(eng, ids, rows, grammar) for _ in range(args.repeats)]
        base, constrained = statistics.median(free), statistics.median(bound)
        out[f"rows{rows}_free_ms_per_token_median"] = 1e3 * base
        out[f"rows{rows}_grammar_ms_per_token_min"] = 1e3 * min(bound)
        out[f"rows{rows}_grammar_ms_per_token_median"] = 1e3 * constrained
        out[f"rows{rows}_grammar_ms_per_token_max"] = 1e3 * max(bound)
        out[f"rows{rows}_grammar_overhead_ms_per_token"] = 1e3 * (constrained - base)
        out[f"rows{rows}_grammar_over_free"] = constrained / base
    eng.close()
    return out


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
    if not args.skip_choices:
        result.update(_figure_choices(args))
    result.update(_figure_grammar(args))
    header = {"workload": "W1 n-choices + tiny grammar", "layers": args.layers, "n": args.n}
    report(result, args.json, header)
    return 0
