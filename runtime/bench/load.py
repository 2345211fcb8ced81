"""``agentcache bench load``: concurrent streaming clients against the OpenAI-compatible server.

Starts the server in-process on 127.0.0.1 (or targets ``--url``), sends chat requests that share
one system prompt from 16 and 64 concurrent streaming clients, then the same number of requests
one by one, and reports throughput ratio, TTFT p50/p99, hit rate, errors, pinned blocks and (for
an in-process server) the peak and mean decode batch, counted by the engine's scheduler.
Clients run in a separate process (spawned once) so they do not share the server's GIL; their
side is ``_clients``. ``--llama-server`` runs ``load_peer``'s comparison with llama.cpp instead.
``--hf`` (transformers' ``generate_batch``) was dropped: see ``HF_DROPPED``.
A benchmark script, never a timed test; it knows the HTTP API, not the engine's internals.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import asdict
from typing import Any

from runtime.bench._clients import (
    BadURL,
    PhaseReport,
    PhaseRunner,
    client_phases,
    format_ms,
    phase_report,
    remote_model,
    system_prompt,
)
from runtime.bench._common import kernels_record, products_record
from runtime.bench._plot import check_plot_path, plot_load
from runtime.bench.floors import Hardware, W1Shape, batching_floor_ratio, measure_hardware
from runtime.bench.llama_server_peer import BUILD_HELP as LLAMA_SERVER_BUILD_HELP
from runtime.bench.llama_server_peer import DEFAULT_NUM_SLOTS, PeerError, add_peer_options
from runtime.bench.load_peer import peer_problem, run_vs_llama_server
from runtime.exceptions import ModelLoadError
from runtime.serve.argtypes import positive_int

__all__ = ["PhaseReport", "main"]


def _bodies(model: str, system: str, tag: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"[{tag}] question {i:04d}: summarise the notes."},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(n)
    ]


def _decode_steps(engine: Any) -> tuple[int, ...] | None:
    """The engine's cumulative decode-step counts by batch size; None for a remote server."""
    if engine is None or not hasattr(engine, "scheduler_stats"):
        return None
    return tuple(engine.scheduler_stats().decode_steps_by_rows)


def _decode_batch(
    before: tuple[int, ...] | None, after: tuple[int, ...] | None
) -> tuple[int | None, float | None]:
    """``(peak, mean)`` decode batch (rows per step) between two ``_decode_steps`` snapshots.

    NOTE: the scheduler counts its own steps; sampling ``scheduler_stats`` from a thread instead
    took the engine lock hundreds of times a second and perturbed the phase it measured.
    """
    if before is None or after is None:
        return None, None
    steps = [b - a for a, b in zip(before, after, strict=True)]
    if not any(steps):
        return 0, 0.0
    peak = max(rows for rows, count in enumerate(steps) if count)
    mean = sum(rows * count for rows, count in enumerate(steps)) / sum(steps)
    return peak, round(mean, 2)


def _rss_mb() -> tuple[float, float | None]:
    """``(peak, now)`` resident memory of this process in MB (peak: ``ru_maxrss``; now: Linux
    ``/proc/self/statm``, None elsewhere). The in-process server lives here; clients do not."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return peak, None
    return peak, now


def _wait_unpinned(engine: Any, timeout_s: float = 30.0) -> int | None:
    """Pinned (in-use) blocks once the server is idle; None when the engine does not say."""
    if not hasattr(engine, "scheduler_stats"):
        return None
    deadline = time.monotonic() + timeout_s
    while engine.scheduler_stats().num_blocks_pinned and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.check_integrity()
    return int(engine.scheduler_stats().num_blocks_pinned)


def run_load(url: str, model: str, args: argparse.Namespace, engine: Any = None) -> dict[str, Any]:
    """Warm the shared prefix, then run each level concurrently and one by one.

    Clients run in one spawned process unless ``args.in_process_clients`` (then they share
    this process, and its GIL, with an in-process server).

    Returns:
        ``{"levels": [...], "errors": int, "pinned_blocks_after": int | None,
        "rss_before_mb": float | None}`` (RSS of the in-process server after the warm-up).
    """
    with client_phases(in_process=args.in_process_clients) as phase:
        return _run_levels(url, model, args, engine, phase)


def _run_levels(
    url: str, model: str, args: argparse.Namespace, engine: Any, phase: PhaseRunner
) -> dict[str, Any]:
    system = system_prompt(args.system_words)
    warm, _ = phase(url, _bodies(model, system, "warm", 1, 4), 1, args.timeout_s)
    rss_before = _rss_mb()[1] if engine is not None else None
    if rss_before is not None:
        print(f"server process RSS after the warm-up request: {rss_before:.0f} MB")
    levels: list[dict[str, Any]] = []
    pinned: int | None = None
    for level in args.concurrency:
        n = level * args.rounds
        tag = f"c{level}"
        bodies = _bodies(model, system, tag, n, args.max_tokens)
        steps = _decode_steps(engine)
        results = phase(url, bodies, level, args.timeout_s)
        peak_batch, mean_batch = _decode_batch(steps, _decode_steps(engine))
        conc = phase_report(f"{level} concurrent", level, *results)
        unpacked = None
        if args.compare_packed_prefill:
            unpacked = _unpacked_phase(engine, url, _bodies(model, system, tag + "u", n,
                                       args.max_tokens), level, args.timeout_s, phase)  # fmt: skip
        bodies = _bodies(model, system, tag + "s", n, args.max_tokens)
        seq = phase_report("one by one", 1, *phase(url, bodies, 1, args.timeout_s))
        pinned = _wait_unpinned(engine) if engine is not None else None
        ratio = conc.tokens_per_s / seq.tokens_per_s if seq.tokens_per_s else 0.0
        peak_rss, rss = _rss_mb() if engine is not None else (None, None)
        levels.append(
            {
                "concurrent": asdict(conc),
                "sequential": asdict(seq),
                "throughput_ratio": round(ratio, 3),
                "unpacked": None if unpacked is None else asdict(unpacked),
                "peak_batch": peak_batch,
                "mean_batch": mean_batch,
                "pinned_blocks_after": pinned,
                "peak_rss_mb": peak_rss,
                "rss_after_mb": rss,
                "floor_ratio": None,
            }
        )
        _print_level(levels[-1])
    errors = sum(lv["concurrent"]["num_errors"] + lv["sequential"]["num_errors"] for lv in levels)
    errors += sum(r.error is not None for r in warm)
    hardware = None
    if engine is not None and hasattr(engine, "runner"):  # NOTE: after the levels' RSS figures
        hw = measure_hardware()
        hardware = hw._asdict()
        shape = W1Shape.of(engine.runner.model, weights=args.weights, kv_dtype=engine.kv_dtype)
        _add_floor_ratios(levels, shape, hw)
    return {
        "levels": levels,
        "errors": errors,
        "pinned_blocks_after": pinned,
        "rss_before_mb": rss_before,
        "hardware": hardware,
    }


def _add_floor_ratios(levels: list[dict[str, Any]], shape: W1Shape, hw: Hardware) -> None:
    """Set each level's ``floor_ratio`` (``batching_floor_ratio`` at its concurrent phase's mean
    turn shape; None when no request of it succeeded or none reported prompt tokens) and print
    them."""
    print(
        f"hardware, same run: peak fp32 GEMM {hw.gemm_gflops:.0f} GFLOP/s, read "
        f"{hw.read_gb_s:.1f} GB/s (runtime.bench.floors)"
    )
    for level in levels:
        conc = level["concurrent"]
        done = conc["num_requests"] - conc["num_errors"]
        prompt = round(conc["prompt_tokens"] / done) if done else 0
        if prompt < 1:  # NOTE: no request succeeded, or the server reported no prompt tokens
            print(
                f"{conc['concurrency']:>4} clients: no ratio at the floors (no usage to shape it)"
            )
            continue
        cached = min(round(conc["cached_tokens"] / done), prompt - 1)
        completion = max(1, round(conc["output_tokens"] / done))
        ratio = batching_floor_ratio(shape, hw, clients=conc["concurrency"], prompt=prompt,
                                     cached=cached, completion=completion)  # fmt: skip
        level["floor_ratio"] = floor = round(ratio, 3)  # NOTE: printed as stored: they agree
        measured = level["throughput_ratio"]
        print(
            f"{conc['concurrency']:>4} clients: concurrent/sequential {measured:.2f}x measured, "
            f"{floor:.2f}x with both paths at the floors for this turn shape "
            f"({prompt} prompt tokens, {cached} cached, {completion} generated)"
        )


def _unpacked_phase(
    engine: Any, url: str, bodies: list[dict[str, Any]], level: int, timeout_s: float,
    phase: PhaseRunner,
) -> PhaseReport:  # fmt: skip
    """The same concurrent phase with packed prefill off (one prefill per forward), A/B."""
    packed = engine.scheduler.max_prefill_batch
    engine.scheduler.max_prefill_batch = 1
    try:
        return phase_report(f"{level} unpacked", level, *phase(url, bodies, level, timeout_s))
    finally:
        engine.scheduler.max_prefill_batch = packed


_REMOTE = "n/a (a remote server does not say)"
"""What the level line shows for a figure only the in-process server reports."""


def _batch_text(level: dict[str, Any]) -> str:
    """``"decode batch peak/mean: 3/2.5"``, or n/a and why (a ``--url`` server gives neither)."""
    peak, mean = level["peak_batch"], level["mean_batch"]
    if peak is None or mean is None:
        return f"decode batch: {_REMOTE}"
    return f"decode batch peak/mean: {peak}/{mean}"


def _print_level(level: dict[str, Any]) -> None:
    for key in ("concurrent", "unpacked", "sequential"):
        p = level[key]
        if p is None:
            continue
        print(
            f"{p['name']:>14}: {p['num_requests']:4d} req  {p['wall_s']:7.2f} s  "
            f"{p['tokens_per_s']:8.1f} tok/s  TTFT p50 {format_ms(p['ttft_p50_s'])} ms "
            f"p99 {format_ms(p['ttft_p99_s'])} ms  ITL p99 {format_ms(p['itl_p99_s'])} ms  "
            f"hit {p['hit_rate']:.1%}  errors {p['num_errors']}"
        )
    if level["unpacked"] is not None and level["unpacked"]["tokens_per_s"]:
        gain = level["concurrent"]["tokens_per_s"] / level["unpacked"]["tokens_per_s"]
        print(f"{'':>14}  packed / unpacked prefill throughput = {gain:.2f}x (same run, A/B)")
    pinned = level["pinned_blocks_after"]
    shown = _REMOTE if pinned is None else str(pinned)
    print(
        f"{'':>14}  throughput concurrent/sequential = {level['throughput_ratio']:.2f}x  "
        f"{_batch_text(level)}  pinned blocks after: {shown}"
    )
    if level["peak_rss_mb"] is not None:
        rss = level["rss_after_mb"]
        print(
            f"{'':>14}  server process RSS: peak {level['peak_rss_mb']:.0f} MB, "
            f"after this level {'n/a' if rss is None else f'{rss:.0f}'} MB"
        )


HF_DROPPED = (
    "--hf was dropped: transformers' generate_batch sizes its paged KV cache from free memory "
    "(12.3 GB of RAM for the 4.2M-parameter tiny model on CPU) and is built for GPUs, so on CPU "
    "the ratio measured its allocation, not its batching; `agentcache bench prefix` holds the "
    "like-for-like comparisons with transformers"
)


LOAD_HELP = """\
Concurrent streaming clients (default 16 and 64) with a shared system prompt against the
OpenAI-compatible server on 127.0.0.1 (started in-process, or --url), then the same requests one by
one: throughput ratio, TTFT p50/p99, p99 inter-token latency (gaps between a stream's content
chunks), prefix cache hit rate, errors, pinned blocks afterwards and the in-process server's peak
and after-level RSS. --compare-packed-prefill reruns each concurrent phase with packed prefill off.
--llama-server instead runs W1 on this server and on llama.cpp's llama-server, alternating (by
default at the concurrency of its -np slots). An in-process run ends by measuring this machine's
peak fp32 GEMM rate and read bandwidth and prints, per level, the ratio both paths would show at
those floors for the turn shape it measured (runtime.bench.floors.batching_floor_ratio)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentcache bench load", description=LOAD_HELP, epilog=LLAMA_SERVER_BUILD_HELP
    )
    p.add_argument(
        "--model", default=None, help="model to serve in-process (default: tiny; not with --url)"
    )
    p.add_argument("--url", default=None, help="target a running server instead")
    p.add_argument(
        "--weights",
        choices=["float32", "bfloat16", "float32-packed", "q8_0", "q4_1"],
        default="float32",
        help="the in-process engine's weights (serve --weights; not with --url). With "
        "--llama-server, bfloat16 also converts W1 to a bf16 GGUF for the peer",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads of the in-process server (default: torch's count); with other work "
        "on the cores, 1 avoids oversubscribing them (ignored with --url)",
    )
    p.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        default=None,
        help="concurrent clients, a phase per level (default: 16 64; with --llama-server its -np)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=4,
        help="requests per client (4: a 16-client phase of ~1 s at 2 swung its ratio by +-30%%)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--system-words", type=positive_int, default=200, help="system prompt words")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    p.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plot", metavar="FILE.png", default=None, help="throughput and TTFT plots")
    p.add_argument(
        "--in-process-clients",
        action="store_true",
        help="run the clients in this process (shares the GIL with an in-process server)",
    )
    p.add_argument(
        "--compare-packed-prefill",
        action="store_true",
        help="after each concurrent phase, run it again with packed prefill off (A/B, in-process)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    add_peer_options(p)
    return p


def main(argv: list[str]) -> int:
    """Run the load test; 0 when there were no errors and no blocks stayed pinned, 1 otherwise
    (also when the GGUF conversion or llama-server failed), 2 for bad options or a ``--url``
    that is not a reachable server, 130 on Ctrl-C."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.concurrency is None:
        peer = args.llama_server is not None
        args.concurrency = [args.llama_server_np or DEFAULT_NUM_SLOTS] if peer else [16, 64]
    for bad in [n for n in args.concurrency if n < 1] + [args.rounds, args.max_tokens]:
        if bad < 1:
            parser.error(f"counts must be >= 1, got {bad}")
    if args.hf:
        return _usage_error(HF_DROPPED)
    if (problem := peer_problem(args)) is not None:
        return _usage_error(problem)
    if args.weights != "float32" and args.url is not None:
        return _usage_error("--weights sets the in-process server's weights (no --url)")
    if args.compare_packed_prefill and args.url is not None:
        return _usage_error("--compare-packed-prefill needs the in-process server (no --url)")
    if (problem := check_plot_path(args.plot)) is not None:
        return _usage_error(problem)
    try:
        if args.llama_server is not None:
            report = run_vs_llama_server(args)
        elif args.url is not None:
            url = server_root(args.url)
            model = remote_model(url)
            report = run_load(url, model, args)
        else:
            report = _run_in_process(args)
    except (BadURL, ModelLoadError) as exc:  # NOTE: --model names no model: a usage error
        return _usage_error(str(exc))
    except PeerError as exc:
        print(f"agentcache bench load: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("agentcache bench load: interrupted", file=sys.stderr)
        return 130
    report["ok"] = report["errors"] == 0 and report["pinned_blocks_after"] in (0, None)
    if args.plot:
        plot_load(args.plot, report["levels"])
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0 if report["ok"] else 1


def _usage_error(message: str) -> int:
    print(f"agentcache bench load: {message}", file=sys.stderr)
    return 2


def server_root(url: str) -> str:
    """``http://h:p/v1/`` -> ``http://h:p``: the requests add ``/v1/...`` themselves."""
    root = url.rstrip("/")
    return root.removesuffix("/v1")


def _run_in_process(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runtime.engine import Engine
    from runtime.serve.app import create_app
    from runtime.serve.server_thread import ServerThread

    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or default_threads)
    engine = Engine.from_pretrained(args.model or "tiny", weights=args.weights)
    app = create_app(engine)
    try:
        with ServerThread(app) as url:
            threads = torch.get_num_threads()
            print(
                f"serving {engine.model_id!r} at {url} (max batch "
                f"{engine.scheduler.max_batch_size}, {threads} torch threads, "
                f"{args.weights} weights)"
            )
            kernels_line, kernels = kernels_record()
            print(kernels_line)
            line, products = products_record(engine)
            if line is not None:
                print(line)
            report = run_load(url, engine.model_id, args, engine)
            return {**report, "threads": threads, "weights": args.weights, "products": products,
                    "kernels": kernels}  # fmt: skip
    finally:
        engine.close()
        torch.set_num_threads(default_threads)  # NOTE: main() may run inside another program


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
