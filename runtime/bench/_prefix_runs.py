"""``bench prefix``'s measured runs: the transformers recipes, our engine's prefix miss / hit /
floor per forward path, the peers side by side (alternating), decode, and the agreement check.

Each run returns raw seconds; ``runtime.bench.prefix`` takes the medians, ratios and tables.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from runtime.bench._common import (
    bench_engine,
    products_record,
    timed,
    ttft,
    w1_model,
)
from runtime.bench._figures import Spread, spread_table
from runtime.bench.floors import W1Shape, measure_hardware
from runtime.bench.llama_cpp_peer import (
    LlamaCppPeer,
    export_gguf,
    peer_python,
)
from runtime.engine import Engine
from runtime.model.runner import ForwardPath

__all__ = [
    "PEER_PATHS",
    "agreement_warnings",
    "append",
    "engine_run",
    "hf_deepcopy_forward",
    "hf_forward",
    "hf_prefilled",
    "measure_decode",
    "measure_paths",
    "measure_peers",
    "measure_prefix",
    "peer_tables",
    "same_prefix_len",
]


def hf_forward(model: Any, ids: list[int], cache: Any) -> int:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax())


def hf_deepcopy_forward(model: Any, ids: list[int], prefix_cache: DynamicCache) -> int:
    """HF's documented prompt-reuse recipe: deep-copy the prefilled cache, run the suffix."""
    return hf_forward(model, ids, copy.deepcopy(prefix_cache))


def hf_prefilled(model: Any, prefix: list[int]) -> DynamicCache:
    cache = DynamicCache()
    hf_forward(model, prefix, cache)
    return cache


def measure_prefix(
    args: argparse.Namespace, peer_dir: Path | None = None
) -> tuple[dict[str, float], dict[str, list[float]], tuple[str | None, dict[str, str] | None]]:
    """The figures (medians), their per-run values, and ``products_record`` of the engine."""
    model = w1_model(args, model=args.model)
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, min(49000, model.config.vocab_size)) for _ in range(n)]

    prefix, reps = toks(args.prefix_len), args.repeats
    suffixes = [toks(args.suffix_len) for _ in range(reps + 1)]
    kv_bytes = args.kv_cache_bytes
    eng, off = (
        bench_engine(model, kv_bytes=kv_bytes, weights=args.weights, kv_dtype=args.kv_dtype),
        bench_engine(
            model,
            kv_bytes=kv_bytes,
            prefix_cache=False,
            weights=args.weights,
            kv_dtype=args.kv_dtype,
        ),
    )
    products = products_record(eng)
    ttft(eng, prefix + suffixes[-1])  # warm-up + store the prefix
    r: dict[str, list[float]] = {
        k: [] for k in ("miss", "hit", "floor", "alone", "deep", "zero", "off")
    }
    hf_cache = hf_prefilled(model, prefix)
    for s in suffixes[:reps]:
        r["hit"].append(ttft(eng, prefix + s).metrics.ttft_s)
        # floor: suffix over the already materialized prefix, then crop it back (untimed).
        r["floor"].append(timed(partial(hf_forward, model, s, hf_cache)))
        hf_cache.crop(-len(s))
        r["deep"].append(timed(partial(hf_deepcopy_forward, model, s, hf_cache)))
        r["alone"].append(timed(partial(hf_forward, model, s, None)))
    for _ in range(reps):
        r["miss"].append(
            ttft(eng, toks(args.prefix_len) + suffixes[0], use_cache=False).metrics.ttft_s
        )
        r["zero"].append(ttft(eng, toks(args.prefix_len + args.suffix_len)).metrics.ttft_s)
        r["off"].append(ttft(off, toks(args.prefix_len + args.suffix_len)).metrics.ttft_s)
    out = {f"{k}_ttft_s": statistics.median(v) for k, v in r.items()}
    decode = measure_decode(model, eng, prefix, suffixes[0], hf_cache, args)
    out.update({k: statistics.median(v) for k, v in decode.items()})
    paths = measure_paths(model, prefix, suffixes, args)
    out.update({k: statistics.median(v) for k, v in paths.items()})
    raw = {**r, **decode, **paths}
    if peer_dir is not None:
        peers = measure_peers(model, prefix, suffixes, args, peer_dir)
        out.update({k: statistics.median(v) for k, v in peers.items()})
        raw.update(peers)
    return _rename(out), raw, products


PEER_PATHS = ("compact", "transformers", "llama.cpp")


def measure_peers(
    model: Any, prefix: list[int], suffixes: list[list[int]], args: argparse.Namespace,
    folder: Path,
) -> dict[str, list[float]]:  # fmt: skip
    """Miss TTFT, hit TTFT and decode rate of both forward paths and llama.cpp, alternating
    request by request (same weights, same token ids, greedy), plus the hardware floors
    measured before and after (the best of both)."""
    outtype = {"bfloat16": "bf16", "q8_0": "q8_0"}.get(args.weights, "f32")
    gguf = args.gguf or export_gguf(model, folder, Path(args.llama_cpp_convert), outtype=outtype)
    n_ctx = args.prefix_len + args.suffix_len + args.decode_tokens + 16
    threads = torch.get_num_threads()
    peer = LlamaCppPeer(peer_python(args.llama_cpp), Path(gguf), n_ctx=n_ctx, threads=threads)
    paths: tuple[ForwardPath, ...] = ("compact", "transformers")
    # NOTE: kv_dtype float16 exists on the compact forward only: transformers keeps fp32 K/V
    kv = {"compact": args.kv_dtype, "transformers": "auto"}
    engines = {p: bench_engine(model, kv_bytes=args.kv_cache_bytes, forward=p,
                               weights=args.weights, kv_dtype=kv[p]) for p in paths}  # fmt: skip
    rng = random.Random(1)
    hw = [measure_hardware()]
    out: dict[str, list[float]] = {}
    try:
        runners: dict[str, Callable[[list[int], int], tuple[float, float, list[int]]]] = {
            p: partial(engine_run, e) for p, e in engines.items()
        }
        runners["llama.cpp"] = peer.run
        ids = {p: run(prefix + suffixes[0], args.decode_tokens)[2] for p, run in runners.items()}
        for s in suffixes[: args.repeats]:
            top = min(49000, model.config.vocab_size)
            fresh = [rng.randrange(100, top) for _ in range(args.prefix_len + args.suffix_len)]
            for path, run in runners.items():
                append(out, f"{path}_miss_s", run(fresh, 1)[0])
                run(prefix + suffixes[-1], 1)  # NOTE: the prefix is in the cache again
                append(out, f"{path}_hit_s", run(prefix + s, 1)[0])
                t_first, decode_s, _ = run(prefix + s, args.decode_tokens)
                append(out, f"{path}_decode_tps", (args.decode_tokens - 1) / decode_s)
    finally:
        peer.close()
        for eng in engines.values():
            eng.close()
    hw.append(measure_hardware())
    out["same_ids_as_compact"] = [same_prefix_len(ids["compact"], ids[p]) for p in PEER_PATHS]
    shape = W1Shape.of(model, weights=args.weights, kv_dtype=args.kv_dtype)
    total = args.prefix_len + args.suffix_len
    out["gemm_gflops"] = [max(h.gemm_gflops for h in hw)]
    out["read_gb_s"] = [max(h.read_gb_s for h in hw)]
    out["miss_gflop"] = [shape.prefill_flops(0, total) / 1e9]
    out["hit_gflop"] = [shape.prefill_flops(args.prefix_len, args.suffix_len) / 1e9]
    out["decode_mb"] = [shape.decode_bytes(total) / 1e6]
    return out


def engine_run(eng: Engine, ids: list[int], n: int) -> tuple[float, float, list[int]]:
    """``(TTFT s, decode s after the first token, greedy token ids)`` of one request."""
    done = ttft(eng, ids, max_tokens=n)
    rate = done.metrics.decode_tokens_per_s
    return done.metrics.ttft_s, (n - 1) / rate if rate else 0.0, list(done.token_ids)


def append(out: dict[str, list[float]], key: str, value: float) -> None:
    out.setdefault(key, []).append(value)


def same_prefix_len(a: list[int], b: list[int]) -> float:
    """How many leading greedy tokens two engines agree on."""
    return float(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                      min(len(a), len(b))))  # fmt: skip


def agreement_warnings(same: list[float], num_tokens: int) -> list[str]:
    """Warnings for peers whose greedy tokens leave compact's (``same``: one count per path).

    NOTE: the engines run the same weights on the same ids, so a peer that disagrees from the first
    token ran other work (seen: a ``--gguf`` of a 2-layer model gave 0 of 32 and a 15x "faster"
    llama.cpp); a later divergence can be near-tied logits.
    """
    out = []
    for path, n in zip(PEER_PATHS[1:], same[1:], strict=True):
        if n == 0:
            out.append(
                f"{path}'s first greedy token differs from compact's: it ran other weights "
                "(a --gguf of another model?), so its figures compare different work"
            )
        elif n < num_tokens:
            out.append(
                f"{path}'s greedy tokens leave compact's after {int(n)} of {num_tokens} "
                "(near-tied logits, or other weights)"
            )
    return out


def peer_tables(raw: dict[str, list[float]], args: argparse.Namespace) -> list[Any]:
    """Engines side by side (min/median/max) and the hardware floors of each figure."""
    gflops, gbs = raw["gemm_gflops"][0], raw["read_gb_s"][0]
    miss_gf, hit_gf, mb = raw["miss_gflop"][0], raw["hit_gflop"][0], raw["decode_mb"][0]
    rows = []
    for path in PEER_PATHS:
        rows += [Spread.ms(f"{path}: miss TTFT", raw[f"{path}_miss_s"]),
                 Spread.ms(f"{path}: hit TTFT", raw[f"{path}_hit_s"]),
                 Spread(f"{path}: decode", "tok/s", tuple(raw[f"{path}_decode_tps"]))]  # fmt: skip
    floors = [
        Spread("peak fp32 GEMM (2048^3 matmul, best)", "GFLOP/s", (gflops,)),
        Spread("read bandwidth (512 MiB sum, best)", "GB/s", (gbs,)),
        Spread.ms(f"miss floor: {miss_gf:.0f} GFLOP at peak", [miss_gf / gflops]),
        Spread.ms(f"hit floor: {hit_gf:.1f} GFLOP at peak", [hit_gf / gflops]),
        Spread(f"decode ceiling: {mb:.0f} MB/token at read bandwidth", "tok/s", (gbs * 1e3 / mb,)),
    ]
    for key, label in (("miss_s", "miss TTFT"), ("hit_s", "hit TTFT"), ("decode_tps", "decode")):
        for other in PEER_PATHS[1:]:
            pairs = zip(raw[f"compact_{key}"], raw[f"{other}_{key}"], strict=True)
            rows.append(Spread(f"compact / {other} {label} (per run)", "x",
                               tuple(a / b for a, b in pairs if b > 0)))  # fmt: skip
    same = raw["same_ids_as_compact"]
    agree = ", ".join(f"{p} {int(n)}" for p, n in zip(PEER_PATHS[1:], same[1:], strict=True))
    title = (f"engines side by side, alternating (greedy tokens agreeing with compact's, of "
             f"{args.decode_tokens}: {agree})")  # fmt: skip
    return [spread_table(title, rows), spread_table("hardware floors, same run", floors)]


def measure_paths(
    model: Any, prefix: list[int], suffixes: list[list[int]], args: argparse.Namespace
) -> dict[str, list[float]]:
    """Hit TTFT and decode rate on each forward path, alternating A/B (same weights, same run)."""
    engines = {p: bench_engine(model, kv_bytes=args.kv_cache_bytes, forward=p,
                               weights=args.weights)
               for p in ("compact", "transformers")}  # fmt: skip
    hit: dict[str, list[float]] = {p: [] for p in engines}
    decode: dict[str, list[float]] = {p: [] for p in engines}
    for eng in engines.values():
        ttft(eng, prefix + suffixes[-1])  # store the prefix
    for s in suffixes[: args.repeats]:
        for path, eng in engines.items():
            hit[path].append(ttft(eng, prefix + s).metrics.ttft_s)
            run = ttft(eng, prefix + s, max_tokens=args.decode_tokens)
            decode[path].append(run.metrics.decode_tokens_per_s)
    out: dict[str, list[float]] = {}
    for path in engines:
        out[f"{path}_path_hit_ttft_s"] = hit[path]
        out[f"{path}_path_decode_tokens_per_s"] = decode[path]
    for eng in engines.values():
        eng.close()
    return out


def measure_decode(
    model: Any, eng: Engine, prefix: list[int], suffix: list[int], hf_cache: Any,
    args: argparse.Namespace,
) -> dict[str, list[float]]:  # fmt: skip
    n, ours, hf = args.decode_tokens, [], []
    ids = torch.tensor([prefix + suffix])
    for _ in range(max(1, args.repeats // 2)):
        ours.append(ttft(eng, prefix + suffix, max_tokens=n).metrics.decode_tokens_per_s)

        def hf_gen(k: int) -> None:
            with torch.no_grad():
                model.generate(input_ids=ids, cache=copy.deepcopy(hf_cache), max_new_tokens=k,
                               min_new_tokens=k, do_sample=False, pad_token_id=0)  # fmt: skip

        t1, tn = timed(lambda: hf_gen(1)), timed(lambda: hf_gen(n))
        hf.append((n - 1) / max(tn - t1, 1e-9))
    return {"decode_tokens_per_s": ours, "hf_decode_tokens_per_s": hf}


def _rename(raw: dict[str, float]) -> dict[str, float]:
    names = {"alone_ttft_s": "suffix_alone_ttft_s", "deep_ttft_s": "hf_deepcopy_hit_ttft_s",
             "zero_ttft_s": "zero_hit_ttft_s", "off_ttft_s": "cache_off_ttft_s"}  # fmt: skip
    out = {names.get(k, k): v for k, v in raw.items()}
    out["hit_over_floor"] = out["hit_ttft_s"] / out["floor_ttft_s"]
    out["hit_over_hf_deepcopy"] = out["hit_ttft_s"] / out["hf_deepcopy_hit_ttft_s"]
    out["decode_over_hf_decode"] = out["decode_tokens_per_s"] / out["hf_decode_tokens_per_s"]
    out["zero_hit_over_cache_off"] = out["zero_hit_ttft_s"] / out["cache_off_ttft_s"]
    out["miss_over_hit"] = out["miss_ttft_s"] / out["hit_ttft_s"]
    out["compact_over_transformers_decode"] = (
        out["compact_path_decode_tokens_per_s"] / out["transformers_path_decode_tokens_per_s"]
    )
    out["compact_over_transformers_hit_ttft"] = (
        out["compact_path_hit_ttft_s"] / out["transformers_path_hit_ttft_s"]
    )
    return out
