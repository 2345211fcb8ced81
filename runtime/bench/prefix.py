"""``agentcache bench prefix`` (W1): TTFT miss / hit / floor vs transformers recipes; decode rate.

Random-weight models built from configs (no downloads), CPU by default. Every figure is a median
over repetitions of one run, and ratios are taken within that run. A script, never a timed test.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, get_args

import torch
from transformers import DynamicCache

from runtime.bench._argtypes import positive_int
from runtime.bench._common import (
    add_common_options,
    bench_engine,
    kernels_record,
    products_record,
    report,
    restores_torch_threads,
    timed,
    ttft,
    w1_model,
)
from runtime.bench._figures import Spread, noise_warnings, print_tables, spread_table
from runtime.bench.floors import W1Shape, measure_hardware
from runtime.bench.llama_cpp_peer import (
    BUILD_HELP,
    LlamaCppPeer,
    export_gguf,
    gguf_problem,
    peer_python,
)
from runtime.engine import Engine
from runtime.model_runner import ForwardPath, WeightsDtype

__all__ = ["agreement_warnings", "prefix_main"]


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


def _measure_prefix(
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
        bench_engine(model, kv_bytes=kv_bytes, weights=args.weights),
        bench_engine(model, kv_bytes=kv_bytes, prefix_cache=False, weights=args.weights),
    )
    products = products_record(eng)
    ttft(eng, prefix + suffixes[-1])  # warm-up + store the prefix
    r: dict[str, list[float]] = {
        k: [] for k in ("miss", "hit", "floor", "alone", "deep", "zero", "off")
    }
    hf_cache = _hf_prefilled(model, prefix)
    for s in suffixes[:reps]:
        r["hit"].append(ttft(eng, prefix + s).metrics.ttft_s)
        # floor: suffix over the already materialized prefix, then crop it back (untimed).
        r["floor"].append(timed(partial(_hf_forward, model, s, hf_cache)))
        hf_cache.crop(-len(s))
        r["deep"].append(timed(partial(_hf_deepcopy_forward, model, s, hf_cache)))
        r["alone"].append(timed(partial(_hf_forward, model, s, None)))
    for _ in range(reps):
        r["miss"].append(
            ttft(eng, toks(args.prefix_len) + suffixes[0], use_cache=False).metrics.ttft_s
        )
        r["zero"].append(ttft(eng, toks(args.prefix_len + args.suffix_len)).metrics.ttft_s)
        r["off"].append(ttft(off, toks(args.prefix_len + args.suffix_len)).metrics.ttft_s)
    out = {f"{k}_ttft_s": statistics.median(v) for k, v in r.items()}
    decode = _measure_decode(model, eng, prefix, suffixes[0], hf_cache, args)
    out.update({k: statistics.median(v) for k, v in decode.items()})
    paths = _measure_paths(model, prefix, suffixes, args)
    out.update({k: statistics.median(v) for k, v in paths.items()})
    raw = {**r, **decode, **paths}
    if peer_dir is not None:
        peers = _measure_peers(model, prefix, suffixes, args, peer_dir)
        out.update({k: statistics.median(v) for k, v in peers.items()})
        raw.update(peers)
    return _rename(out), raw, products


_PEER_PATHS = ("compact", "transformers", "llama.cpp")


def _measure_peers(
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
    engines = {p: bench_engine(model, kv_bytes=args.kv_cache_bytes, forward=p,
                               weights=args.weights) for p in paths}  # fmt: skip
    rng = random.Random(1)
    hw = [measure_hardware()]
    out: dict[str, list[float]] = {}
    try:
        runners: dict[str, Callable[[list[int], int], tuple[float, float, list[int]]]] = {
            p: partial(_engine_run, e) for p, e in engines.items()
        }
        runners["llama.cpp"] = peer.run
        ids = {p: run(prefix + suffixes[0], args.decode_tokens)[2] for p, run in runners.items()}
        for s in suffixes[: args.repeats]:
            top = min(49000, model.config.vocab_size)
            fresh = [rng.randrange(100, top) for _ in range(args.prefix_len + args.suffix_len)]
            for path, run in runners.items():
                _append(out, f"{path}_miss_s", run(fresh, 1)[0])
                run(prefix + suffixes[-1], 1)  # NOTE: the prefix is in the cache again
                _append(out, f"{path}_hit_s", run(prefix + s, 1)[0])
                t_first, decode_s, _ = run(prefix + s, args.decode_tokens)
                _append(out, f"{path}_decode_tps", (args.decode_tokens - 1) / decode_s)
    finally:
        peer.close()
        for eng in engines.values():
            eng.close()
    hw.append(measure_hardware())
    out["same_ids_as_compact"] = [_same_prefix_len(ids["compact"], ids[p]) for p in _PEER_PATHS]
    weight_bytes = 2 if args.weights == "bfloat16" else None
    shape, total = W1Shape.of(model, weight_bytes=weight_bytes), args.prefix_len + args.suffix_len
    out["gemm_gflops"] = [max(h.gemm_gflops for h in hw)]
    out["read_gb_s"] = [max(h.read_gb_s for h in hw)]
    out["miss_gflop"] = [shape.prefill_flops(0, total) / 1e9]
    out["hit_gflop"] = [shape.prefill_flops(args.prefix_len, args.suffix_len) / 1e9]
    out["decode_mb"] = [shape.decode_bytes(total) / 1e6]
    return out


def _engine_run(eng: Engine, ids: list[int], n: int) -> tuple[float, float, list[int]]:
    """``(TTFT s, decode s after the first token, greedy token ids)`` of one request."""
    done = ttft(eng, ids, max_tokens=n)
    rate = done.metrics.decode_tokens_per_s
    return done.metrics.ttft_s, (n - 1) / rate if rate else 0.0, list(done.token_ids)


def _append(out: dict[str, list[float]], key: str, value: float) -> None:
    out.setdefault(key, []).append(value)


def _same_prefix_len(a: list[int], b: list[int]) -> float:
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
    for path, n in zip(_PEER_PATHS[1:], same[1:], strict=True):
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


def _peer_tables(raw: dict[str, list[float]], args: argparse.Namespace) -> list[Any]:
    """Engines side by side (min/median/max) and the hardware floors of each figure."""
    gflops, gbs = raw["gemm_gflops"][0], raw["read_gb_s"][0]
    miss_gf, hit_gf, mb = raw["miss_gflop"][0], raw["hit_gflop"][0], raw["decode_mb"][0]
    rows = []
    for path in _PEER_PATHS:
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
        for other in _PEER_PATHS[1:]:
            pairs = zip(raw[f"compact_{key}"], raw[f"{other}_{key}"], strict=True)
            rows.append(Spread(f"compact / {other} {label} (per run)", "x",
                               tuple(a / b for a, b in pairs if b > 0)))  # fmt: skip
    same = raw["same_ids_as_compact"]
    agree = ", ".join(f"{p} {int(n)}" for p, n in zip(_PEER_PATHS[1:], same[1:], strict=True))
    title = (f"engines side by side, alternating (greedy tokens agreeing with compact's, of "
             f"{args.decode_tokens}: {agree})")  # fmt: skip
    return [spread_table(title, rows), spread_table("hardware floors, same run", floors)]


def _measure_paths(
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


def _measure_decode(
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


def _model_problem(args: argparse.Namespace) -> str | None:
    """Why ``--model`` cannot run this bench (None when it can); sets ``args.layers`` to its
    layer count. The prompts are random ids below 49000, so the vocabulary must hold them."""
    from transformers import AutoConfig

    from runtime.models import resolve_model

    path = resolve_model(args.model)
    try:
        if path.endswith(".gguf"):  # NOTE: transformers reads a GGUF's config from its folder
            config = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=path)
        else:
            config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        return f"--model {args.model!r}: cannot read its config ({exc})"
    if config.vocab_size < 49000:
        return f"--model {args.model!r}: vocabulary of {config.vocab_size} < 49000 random ids"
    args.layers = config.num_hidden_layers
    return None


def _measure_restart(args: argparse.Namespace) -> dict[str, float]:
    """Warm restart: the first request on a known prefix in a fresh engine, served from disk.

    Engine A stores the prefix and closes (write-through put its blocks on the disk tier, and
    ``close`` flushed what was still queued: no eviction needed). Each repeat then
    starts a fresh engine on the same directory and times its first request (known prefix + new
    suffix) against a cold miss of the same length on that engine.
    """
    model = w1_model(args, model=args.model)
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, min(49000, model.config.vocab_size)) for _ in range(n)]

    prefix, warm, cold, cached = toks(args.prefix_len), [], [], []
    with tempfile.TemporaryDirectory(prefix="agentcache-bench-restart-") as disk_dir:

        def engine() -> Engine:
            return bench_engine(model, kv_bytes=args.kv_cache_bytes, disk_dir=disk_dir,
                                disk_bytes=8 << 30, weights=args.weights)  # fmt: skip

        first = engine()
        ttft(first, prefix + toks(args.suffix_len))
        first.close()
        for _ in range(args.repeats):
            eng = engine()
            hit = ttft(eng, prefix + toks(args.suffix_len))
            warm.append(hit.metrics.ttft_s)
            cached.append(hit.usage.cached_tokens)
            cold.append(ttft(eng, toks(args.prefix_len + args.suffix_len)).metrics.ttft_s)
            eng.close()
    ratios = [c / w for c, w in zip(cold, warm, strict=True)]
    return {
        "restart_hit_ttft_s": statistics.median(warm),
        "restart_cold_miss_ttft_s": statistics.median(cold),
        "restart_cached_tokens": float(min(cached)),
        "restart_miss_over_hit_min": min(ratios),
        "restart_miss_over_hit_median": statistics.median(ratios),
        "restart_miss_over_hit_max": max(ratios),
    }


PREFIX_HELP = """\
TTFT of a prefix-cache miss, a hit, the hit floor (the model's own forward over KV already in
memory), the suffix alone, transformers' deep-copy reuse recipe, and a 0%-hit request vs the cache
off; decode tokens/s vs transformers generate. Default workload W1: a SmolLM2-135M-shaped Llama
with random weights, 2000-token shared prefix, 30-token suffix, fp32. Figures are medians over
--repeats, ratios are taken within the run. --warm-restart instead times the first request of a
freshly started engine whose disk tier holds the prefix, against a cold miss."""


@restores_torch_threads
def prefix_main(argv: list[str]) -> int:
    """``agentcache bench prefix``: W1 TTFT miss/hit/floor/HF recipes and decode rate."""
    p = argparse.ArgumentParser(
        prog="agentcache bench prefix", description=PREFIX_HELP, epilog=BUILD_HELP
    )
    add_common_options(p, layers=30, repeats=5)
    p.add_argument("--prefix-len", type=positive_int, default=2000, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=positive_int, default=30, help="distinct suffix tokens")
    p.add_argument("--decode-tokens", type=positive_int, default=32, help="decode rate tokens")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="prefix cache budget")
    p.add_argument(
        "--warm-restart",
        action="store_true",
        help="only the warm-restart figures: first request after a restart (disk tier) vs a miss",
    )
    p.add_argument(
        "--llama-cpp",
        metavar="PYTHON_OR_VENV",
        default=None,
        help="add llama.cpp (llama-cpp-python in that interpreter) side by side",
    )
    p.add_argument(
        "--llama-cpp-convert",
        metavar="convert_hf_to_gguf.py",
        default=None,
        help="llama.cpp's converter, to write the W1 weights as an f32 GGUF (bf16 with "
        "--weights bfloat16)",
    )
    p.add_argument(
        "--weights",
        choices=list(get_args(WeightsDtype)),
        default="float32",
        help="bfloat16: round W1's linear weights to bf16 for every engine and peer (ours then "
        "decodes from packed bf16 copies; llama.cpp gets a bf16 GGUF); float32-packed: ours "
        "keeps a packed fp32 copy for decode steps (the peers see the same f32 weights); "
        "q8_0 / q4_1: W1 quantized to GGUF's blocks (llama.cpp gets a q8_0 GGUF from the "
        "converter; q4_1 needs --gguf, which the converter cannot write); default float32",
    )
    p.add_argument(
        "--gguf",
        default=None,
        help="give llama.cpp this GGUF instead of converting the weights (of the same model: "
        "another quantization of --model's weights is fine, its figures then compare other work)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a real model instead of W1's random weights: bundled or named (smollm2-135m, "
        "pulled on first use), folder, .gguf file or hub id; its own shape (--layers is then "
        "ignored); token ids stay random, so answers are not meaningful",
    )
    args = p.parse_args(argv)
    if args.weights != "float32" and args.dtype != "float32":
        p.error(f"--weights {args.weights} needs --dtype float32, not {args.dtype}")
    if args.weights == "q4_1" and args.llama_cpp is not None and args.gguf is None:
        p.error("--weights q4_1 with --llama-cpp needs --gguf (llama.cpp's converter writes no "
                "Q4_1; quantize one with llama-quantize)")  # fmt: skip
    if args.llama_cpp is not None:
        problem = _peer_problem(args)
        if problem is not None:
            p.error(problem)
    if args.model is not None:
        problem = _model_problem(args)
        if problem is not None:
            p.error(problem)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels_line, kernels = kernels_record()
    workload = "W1" if args.model is None else f"model {args.model}"
    header = {"workload": workload, "layers": args.layers, "prefix_len": args.prefix_len,
              "dtype": args.dtype, "weights": args.weights,
              "kernel_isa": kernels["isa"] or "off"}  # fmt: skip
    if args.warm_restart:
        report(_measure_restart(args), args.json, {**header, "suffix_len": args.suffix_len})
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="agentcache-bench-gguf-") as folder:
            peer_dir = Path(folder) if args.llama_cpp is not None else None
            result, raw, (products_line, products) = _measure_prefix(args, peer_dir)
    except KeyboardInterrupt:
        print("agentcache bench prefix: interrupted", file=sys.stderr)
        return 130
    timings, ratios, decode = _spreads(raw)
    floors = [(timings[1], timings[2])]
    warnings = noise_warnings(timings, ratios, floors)
    title = (
        f"bench prefix: {workload}, {args.layers} layers, {args.prefix_len}-token prefix + "
        f"{args.suffix_len}-token suffix, {args.dtype}, {kernels['isa'] or 'no'} native kernels"
        + {
            "bfloat16": ", bf16 weights",
            "float32-packed": ", float32-packed weights (compact)",
            "q8_0": ", q8_0 weights (quantized)",
            "q4_1": ", q4_1 weights (quantized)",
        }.get(args.weights, "")
    )
    tables = [
        spread_table(f"{title}: time to first token", timings),
        spread_table("same-run ratios (per run)", ratios),
        spread_table(f"decode rate ({args.decode_tokens} tokens)", decode),
    ]
    if args.llama_cpp is not None:
        tables += _peer_tables(raw, args)
        warnings += agreement_warnings(raw["same_ids_as_compact"], args.decode_tokens)
    print(kernels_line)
    if products_line is not None:
        print(products_line)
    print_tables(tables, warnings)
    if args.json:
        spread = {s.name: s.as_json() for s in (*timings, *ratios, *decode)}
        extra = {"spread": spread, "warnings": warnings, "products": products,
                 "kernels": kernels}  # fmt: skip
        print(json.dumps({**header, "suffix_len": args.suffix_len, **result, **extra}))
    return 0


def _peer_problem(args: argparse.Namespace) -> str | None:
    """Why the llama.cpp options cannot work, before anything slow runs (None when fine)."""
    try:
        peer_python(args.llama_cpp)
    except ValueError as exc:
        return str(exc)
    return gguf_problem(args.gguf, args.llama_cpp_convert, "--llama-cpp")


_TIMING_NAMES = (
    ("miss", "miss (prefix not cached)"),
    ("hit", "hit (prefix cached)"),
    ("floor", "hit floor: forward over KV in memory"),
    ("alone", "suffix alone, no prefix"),
    ("deep", "transformers deep-copy reuse"),
    ("zero", "0%-hit request, cache on"),
    ("off", "same, cache off"),
)


def _spreads(raw: dict[str, list[float]]) -> tuple[list[Spread], list[Spread], list[Spread]]:
    """(TTFT timings, per-run ratios, decode rates) over the repeats."""
    timings = [Spread.ms(label, raw[key]) for key, label in _TIMING_NAMES]

    def per_run(name: str, top: str, bottom: str) -> Spread:
        pairs = zip(raw[top], raw[bottom], strict=False)
        return Spread(name, "x", tuple(a / b for a, b in pairs if b > 0))

    ratios = [
        per_run("miss / hit TTFT", "miss", "hit"),
        per_run("hit / floor TTFT", "hit", "floor"),
        per_run("hit / transformers deep-copy TTFT", "hit", "deep"),
        per_run("0%-hit / cache-off TTFT", "zero", "off"),
        per_run(
            "decode rate / transformers generate", "decode_tokens_per_s", "hf_decode_tokens_per_s"
        ),
    ]
    timings += [
        Spread.ms(f"hit, {path} forward path", raw[f"{path}_path_hit_ttft_s"])
        for path in ("compact", "transformers")
    ]
    decode = [
        Spread("this engine", "tok/s", tuple(raw["decode_tokens_per_s"])),
        Spread("transformers generate", "tok/s", tuple(raw["hf_decode_tokens_per_s"])),
    ] + [
        Spread(
            f"this engine, {path} forward path",
            "tok/s",
            tuple(raw[f"{path}_path_decode_tokens_per_s"]),
        )
        for path in ("compact", "transformers")
    ]
    return timings, ratios, decode
