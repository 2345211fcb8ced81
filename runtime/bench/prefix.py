"""``agentcache bench prefix`` (W1): TTFT miss / hit / floor vs transformers recipes; decode rate.

Random-weight models built from configs (no downloads), CPU by default. Every figure is a median
over repetitions of one run, and ratios are taken within that run. A script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, get_args

import torch

from runtime.bench._common import (
    add_common_options,
    bench_engine,
    kernels_record,
    report,
    restores_torch_threads,
    ttft,
    w1_model,
)
from runtime.bench._figures import Spread, noise_warnings, print_tables, spread_table
from runtime.bench._prefix_runs import (
    agreement_warnings,
    measure_prefix,
    peer_tables,
)
from runtime.bench._weights_pair import measure_weights_pair
from runtime.bench.llama_cpp_peer import (
    BUILD_HELP,
    gguf_problem,
    peer_python,
)
from runtime.config import KVDtype
from runtime.engine import Engine
from runtime.model.runner import WeightsDtype
from runtime.serve.argtypes import positive_int

__all__ = ["agreement_warnings", "prefix_main"]


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
                                disk_bytes=8 << 30, weights=args.weights,
                                kv_dtype=args.kv_dtype)  # fmt: skip

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
freshly started engine whose disk tier holds the prefix, against a cold miss. --compare-weights W
instead times decode only: an engine with --weights and one with W, in one process, taking turns
on the same prompt, with the ratio of each turn."""


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
        "--compare-weights",
        choices=list(get_args(WeightsDtype)),
        default=None,
        help="only decode rates: this process also loads the model with these weights and the "
        "two engines take turns (--repeats each) decoding --decode-tokens after the same "
        "prompt (a prefix-cache hit of --prefix-len + --suffix-len tokens), both with --kv-dtype; "
        "prints both rates and the per-turn ratio --weights / this",
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
        "--kv-dtype",
        choices=list(get_args(KVDtype)),
        default="auto",
        help="our engine's KV cache element type (serve --kv-dtype): float16 halves the KV "
        "bytes a decode step reads (llama.cpp's default f16 KV; a hit then equals a miss only "
        "within fp16 rounding); auto is the model's dtype; default auto",
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
    if args.llama_cpp is None:
        peer_only = (("--gguf", args.gguf), ("--llama-cpp-convert", args.llama_cpp_convert))
        unused = [flag for flag, value in peer_only if value]
        if unused:
            p.error(f"{unused[0]} gives llama.cpp its weights: it needs --llama-cpp")
    if args.compare_weights is not None:
        problem = _compare_problem(args)
        if problem is not None:
            p.error(problem)
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
              "dtype": args.dtype, "weights": args.weights, "kv_dtype": args.kv_dtype,
              "kernel_isa": kernels["isa"] or "off"}  # fmt: skip
    if args.warm_restart:
        report(_measure_restart(args), args.json, {**header, "suffix_len": args.suffix_len})
        return 0
    if args.compare_weights is not None:
        _print_weights_pair(args, kernels_line, {**header, "suffix_len": args.suffix_len})
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="agentcache-bench-gguf-") as folder:
            peer_dir = Path(folder) if args.llama_cpp is not None else None
            result, raw, (products_line, products) = measure_prefix(args, peer_dir)
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
        tables += peer_tables(raw, args)
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


def _compare_problem(args: argparse.Namespace) -> str | None:
    """Why ``--compare-weights`` cannot run with the other options (None when it can)."""
    if args.compare_weights == args.weights:
        return f"--compare-weights {args.compare_weights} equals --weights: compare two types"
    if args.compare_weights != "float32" and args.dtype != "float32":
        return f"--compare-weights {args.compare_weights} needs --dtype float32, not {args.dtype}"
    if args.decode_tokens < 2:
        return "--compare-weights needs --decode-tokens 2 or more (a decode rate)"
    others = [name for name, on in (("--warm-restart", args.warm_restart),
                                    ("--llama-cpp", args.llama_cpp is not None)) if on]  # fmt: skip
    return f"--compare-weights runs alone, not with {others[0]}" if others else None


def _print_weights_pair(
    args: argparse.Namespace, kernels_line: str, header: dict[str, Any]
) -> None:
    """Run ``measure_weights_pair`` and print its table (and JSON with ``--json``)."""
    spreads, medians = measure_weights_pair(args)
    prompt_len = args.prefix_len + args.suffix_len
    title = (f"bench prefix --compare-weights: decode rate ({args.decode_tokens} tokens after a "
             f"{prompt_len}-token prompt), engines taking turns")  # fmt: skip
    print(kernels_line)
    warnings = noise_warnings(spreads[:2], spreads[2:])
    print_tables([spread_table(title, spreads)], warnings)
    if args.json:
        extra = {"compare_weights": args.compare_weights, "warnings": warnings,
                 "spread": {s.name: s.as_json() for s in spreads}}  # fmt: skip
        print(json.dumps({**header, **medians, **extra}))


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
