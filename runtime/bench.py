"""Benchmarks behind ``agentcache bench prefix`` (W1) and ``agentcache bench trace`` (W3).

Random-weight models built from configs (no downloads), CPU by default. Every figure is a median
over repetitions of one run, and ratios are taken within that run. Scripts, never timed tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from runtime._argtypes import positive_int
from runtime.engine import Engine
from runtime.sampling import SamplingParams

__all__ = ["prefix_main", "trace_main"]


class _NullTokenizer:
    """Stands in for a tokenizer: benchmarks feed token ids and ignore text."""

    eos_token_id = None
    chat_template = None
    model_max_length = 1 << 20

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def _model(args: argparse.Namespace) -> Any:
    """SmolLM2-135M-shaped Llama (W1) with random weights; ``--layers`` scales it down."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=576, num_hidden_layers=args.layers, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()  # type: ignore[no-untyped-call]


def _engine(model: Any, *, kv_bytes: int, prefix_cache: bool = True) -> Engine:
    eng = Engine(model, _NullTokenizer(), model_id="bench-w1", kv_cache_bytes=kv_bytes,
                 prefix_cache=prefix_cache)  # fmt: skip
    eng.eos_ids = frozenset()
    return eng


def _ttft(eng: Engine, ids: list[int], *, use_cache: bool = True, max_tokens: int = 1) -> Any:
    req = eng.make_request(ids, SamplingParams(max_tokens=max_tokens), use_prefix_cache=use_cache)
    return list(eng.run(req))[-1].completion


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _hf_forward(model: Any, ids: list[int], cache: Any) -> int:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax())


def _hf_deepcopy_forward(model: Any, ids: list[int], prefix_cache: DynamicCache) -> int:
    """HF's documented prompt-reuse recipe: deep-copy the prefilled cache, run the suffix."""
    return _hf_forward(model, ids, copy.deepcopy(prefix_cache))


def _hf_prefilled(model: Any, prefix: list[int]) -> DynamicCache:
    cache = DynamicCache()
    _hf_forward(model, prefix, cache)
    return cache


def _measure_prefix(args: argparse.Namespace) -> dict[str, float]:
    model = _model(args)
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    prefix, reps = toks(args.prefix_len), args.repeats
    suffixes = [toks(args.suffix_len) for _ in range(reps + 1)]
    kv_bytes = args.kv_cache_bytes
    eng, off = (
        _engine(model, kv_bytes=kv_bytes),
        _engine(model, kv_bytes=kv_bytes, prefix_cache=False),
    )
    _ttft(eng, prefix + suffixes[-1])  # warm-up + store the prefix
    r: dict[str, list[float]] = {
        k: [] for k in ("miss", "hit", "floor", "alone", "deep", "zero", "off")
    }
    hf_cache = _hf_prefilled(model, prefix)
    for s in suffixes[:reps]:
        r["hit"].append(_ttft(eng, prefix + s).metrics.ttft_s)
        # floor: suffix over the already materialized prefix, then crop it back (untimed).
        r["floor"].append(_timed(partial(_hf_forward, model, s, hf_cache)))
        hf_cache.crop(-len(s))
        r["deep"].append(_timed(partial(_hf_deepcopy_forward, model, s, hf_cache)))
        r["alone"].append(_timed(partial(_hf_forward, model, s, None)))
    for _ in range(reps):
        r["miss"].append(
            _ttft(eng, toks(args.prefix_len) + suffixes[0], use_cache=False).metrics.ttft_s
        )
        r["zero"].append(_ttft(eng, toks(args.prefix_len + args.suffix_len)).metrics.ttft_s)
        r["off"].append(_ttft(off, toks(args.prefix_len + args.suffix_len)).metrics.ttft_s)
    out = {f"{k}_ttft_s": statistics.median(v) for k, v in r.items()}
    out.update(_measure_decode(model, eng, prefix, suffixes[0], hf_cache, args))
    return _rename(out)


def _measure_decode(
    model: Any, eng: Engine, prefix: list[int], suffix: list[int], hf_cache: Any,
    args: argparse.Namespace,
) -> dict[str, float]:  # fmt: skip
    n, ours, hf = args.decode_tokens, [], []
    ids = torch.tensor([prefix + suffix])
    for _ in range(max(1, args.repeats // 2)):
        ours.append(_ttft(eng, prefix + suffix, max_tokens=n).metrics.decode_tokens_per_s)

        def hf_gen(k: int) -> None:
            with torch.no_grad():
                model.generate(input_ids=ids, cache=copy.deepcopy(hf_cache), max_new_tokens=k,
                               min_new_tokens=k, do_sample=False, pad_token_id=0)  # fmt: skip

        t1, tn = _timed(lambda: hf_gen(1)), _timed(lambda: hf_gen(n))
        hf.append((n - 1) / max(tn - t1, 1e-9))
    return {
        "decode_tokens_per_s": statistics.median(ours),
        "hf_decode_tokens_per_s": statistics.median(hf),
    }


def _rename(raw: dict[str, float]) -> dict[str, float]:
    names = {"alone_ttft_s": "suffix_alone_ttft_s", "deep_ttft_s": "hf_deepcopy_hit_ttft_s",
             "zero_ttft_s": "zero_hit_ttft_s", "off_ttft_s": "cache_off_ttft_s"}  # fmt: skip
    out = {names.get(k, k): v for k, v in raw.items()}
    out["hit_over_floor"] = out["hit_ttft_s"] / out["floor_ttft_s"]
    out["hit_over_hf_deepcopy"] = out["hit_ttft_s"] / out["hf_deepcopy_hit_ttft_s"]
    out["decode_over_hf_decode"] = out["decode_tokens_per_s"] / out["hf_decode_tokens_per_s"]
    out["zero_hit_over_cache_off"] = out["zero_hit_ttft_s"] / out["cache_off_ttft_s"]
    out["miss_over_hit"] = out["miss_ttft_s"] / out["hit_ttft_s"]
    return out


PREFIX_HELP = """\
TTFT of a prefix-cache miss, a hit, the hit floor (the model's own forward over KV already in
memory), the suffix alone, transformers' deep-copy reuse recipe, and a 0%-hit request vs the cache
off; decode tokens/s vs transformers generate. Default workload W1: a SmolLM2-135M-shaped Llama
with random weights, 2000-token shared prefix, 30-token suffix, fp32. Figures are medians over
--repeats, ratios are taken within the run."""

TRACE_HELP = """\
Agent-style trace W3: 8 distinct system prompts, each used by several 3-turn conversations,
interleaved. Reports the token hit rate and mean TTFT vs the cache off, with a KV budget that
holds everything and one that holds about a quarter of it (eviction at work)."""


def _common(parser: argparse.ArgumentParser, *, layers: int, repeats: int) -> None:
    parser.add_argument("--layers", type=positive_int, default=layers, help="decoder layers")
    parser.add_argument("--repeats", type=positive_int, default=repeats, help="runs per figure")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")


def prefix_main(argv: list[str]) -> int:
    """``agentcache bench prefix``: W1 TTFT miss/hit/floor/HF recipes and decode rate."""
    p = argparse.ArgumentParser(prog="agentcache bench prefix", description=PREFIX_HELP)
    _common(p, layers=30, repeats=5)
    p.add_argument("--prefix-len", type=positive_int, default=2000, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=positive_int, default=30, help="distinct suffix tokens")
    p.add_argument("--decode-tokens", type=positive_int, default=32, help="decode rate tokens")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="prefix cache budget")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = _measure_prefix(args)
    header = {"workload": "W1", "layers": args.layers, "prefix_len": args.prefix_len}
    _report(result, args.json, {**header, "suffix_len": args.suffix_len})
    return 0


def _report(result: dict[str, Any], as_json: bool, header: dict[str, Any]) -> None:
    for key, value in {**header, **result}.items():
        print(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
    if as_json:
        print(json.dumps({**header, **result}, sort_keys=True))


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
            c = _ttft(eng, history[i], max_tokens=args.gen_tokens)
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
    _common(p, layers=4, repeats=1)
    p.add_argument(
        "--system-len", type=positive_int, default=1000, help="tokens per system prompt (8 of them)"
    )
    p.add_argument("--convs-per-system", type=positive_int, default=3, help="conversations each")
    p.add_argument("--turn-len", type=positive_int, default=30, help="tokens per user turn")
    p.add_argument("--gen-tokens", type=positive_int, default=8, help="tokens generated per turn")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _model(args)
    full = _run_trace(_engine(model, kv_bytes=1 << 34), args)
    quarter_bytes = int(full["bytes_used"]) // 4
    quarter = _run_trace(_engine(model, kv_bytes=quarter_bytes), args)
    off = _run_trace(_engine(model, kv_bytes=0, prefix_cache=False), args)
    result: dict[str, Any] = {f"full_{k}": v for k, v in full.items()}
    result.update({f"quarter_{k}": v for k, v in quarter.items()})
    result["quarter_budget_bytes"] = quarter_bytes
    result["cache_off_mean_ttft_s"] = off["mean_ttft_s"]
    result["full_ttft_over_off"] = full["mean_ttft_s"] / off["mean_ttft_s"]
    result["quarter_ttft_over_off"] = quarter["mean_ttft_s"] / off["mean_ttft_s"]
    _report(result, args.json, {"workload": "W3", "layers": args.layers})
    return 0
