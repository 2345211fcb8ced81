"""``bench load --llama-server``: one concurrent workload on this server and on llama.cpp's
``llama-server``, round by round in one run, the order alternating.

Both serve the W1 weights (random, seeded, f32): this engine in-process from the saved folder,
llama-server from an f32 GGUF of it. Requests are streaming ``/v1/completions`` with token-id
prompts (the same ids on both; no chat template, which the two would render differently), greedy,
``ignore_eos`` so each generates ``max_tokens``. It knows the HTTP API, not either engine's
internals.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from runtime.bench._clients import (
    PhaseRunner,
    RequestResult,
    client_phases,
    format_ms,
    phase_report,
    remote_model,
    system_prompt,
)
from runtime.bench.llama_cpp_peer import export_gguf, gguf_problem, save_hf
from runtime.bench.llama_server_peer import (
    DEFAULT_FLASH_ATTN,
    DEFAULT_LAYERS,
    DEFAULT_NUM_SLOTS,
    LlamaServer,
    PeerError,
    check_binary,
    free_port,
    server_command,
)

__all__ = [
    "ENGINES",
    "compare_level",
    "completion_bodies",
    "peer_problem",
    "peer_prompts",
    "print_level",
    "run_vs_llama_server",
]

ENGINES = ("agentcache", "llama-server")
"""Names of the two engines, ours first: ratios are ours / llama-server's."""

_Prompts = Callable[[str, int], list[list[int]]]
"""``(tag, n) -> n`` token-id prompts sharing the system prompt, each with its own question."""

_PEER_ONLY = ("llama_server_np", "llama_server_flash_attn", "llama_cpp_convert", "gguf", "layers")


def peer_problem(args: argparse.Namespace) -> str | None:
    """Why the ``--llama-server`` options cannot work, before anything slow runs (None: fine)."""
    if args.llama_server is None:
        given = [name for name in _PEER_ONLY if getattr(args, name) is not None]
        return f"--{given[0].replace('_', '-')} needs --llama-server" if given else None
    clashes = {"url": "--url", "model": "--model", "compare_packed_prefill": "--compare-packed-"
               "prefill", "plot": "--plot"}  # fmt: skip
    for name, flag in clashes.items():
        if getattr(args, name):
            return f"{flag} does not apply with --llama-server (both serve W1 here; see --help)"
    try:
        check_binary(args.llama_server)
    except ValueError as exc:
        return str(exc)
    return gguf_problem(args.gguf, args.llama_cpp_convert, "--llama-server")


def peer_prompts(
    tokenize: Callable[[str], list[int]], system_words: int, tag: str, n: int
) -> list[list[int]]:
    """``n`` prompts as token ids: the shared system prompt, then a question of their own."""
    system = system_prompt(system_words)
    return [tokenize(f"{system}\n[{tag}] question {i:04d}: summarise the notes.") for i in range(n)]


def completion_bodies(
    model: str, prompts: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """Streaming ``/v1/completions`` bodies: greedy, exactly ``max_tokens`` tokens each."""
    return [
        {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for ids in prompts
    ]


def compare_level(
    urls: dict[str, str], prompts: _Prompts, level: int, args: argparse.Namespace,
    phase: PhaseRunner,
) -> dict[str, Any]:  # fmt: skip
    """Warm both servers, then ``args.rounds`` rounds of ``level`` concurrent requests (one per
    client) on each, the same prompts on both, ours first in even rounds. Each body names the
    model its server lists first (``GET /v1/models``); nothing else differs.

    The warm-up is one request, then ``level`` at once, so every llama-server slot (each keeps
    its own cache) holds the shared prefix before the first timed round, as ours does.

    Returns:
        ``{"concurrency", "engines": {name: PhaseReport of all rounds, as a dict},
        "prompt_tokens": {name: int}, "tokens_per_s": {name: [per round]},
        "ratio_per_round": [ours / theirs], "ratio": {"min", "median", "max"}, "errors": int}``.
    """
    models = {name: remote_model(url) for name, url in urls.items()}
    warm = {name: _warm(urls[name], models[name], prompts, level, args, phase) for name in ENGINES}
    rounds: dict[str, list[tuple[list[RequestResult], float]]] = {name: [] for name in ENGINES}
    for r in range(args.rounds):
        ids = prompts(f"c{level}r{r}", level)
        for name in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            bodies = completion_bodies(models[name], ids, args.max_tokens)
            rounds[name].append(phase(urls[name], bodies, level, args.timeout_s))
    return _level_figures(level, rounds, sum(warm.values()))


def _warm(
    url: str, model: str, prompts: _Prompts, level: int, args: argparse.Namespace,
    phase: PhaseRunner,
) -> int:  # fmt: skip
    """Untimed: one request, then ``level`` at once, all sharing the system prompt; errors."""
    errors = 0
    for tag, n in (("warm", 1), (f"warm{level}", level)):
        done, _ = phase(url, completion_bodies(model, prompts(tag, n), 4), n, args.timeout_s)
        errors += sum(r.error is not None for r in done)
    return errors


def _level_figures(
    level: int, rounds: dict[str, list[tuple[list[RequestResult], float]]], warm_errors: int
) -> dict[str, Any]:
    """The figures ``compare_level`` returns, from each engine's ``(results, wall s)`` rounds."""
    tps = {
        name: [
            round(sum(r.completion_tokens for r in done) / wall_s, 2) if wall_s > 0 else 0.0
            for done, wall_s in rounds[name]
        ]
        for name in ENGINES
    }
    ours, theirs = ENGINES
    ratios = [round(a / b, 3) if b else 0.0 for a, b in zip(tps[ours], tps[theirs], strict=True)]
    results = {name: [r for done, _ in rounds[name] for r in done] for name in ENGINES}
    walls = {name: sum(wall_s for _, wall_s in rounds[name]) for name in ENGINES}
    reports = {name: phase_report(name, level, results[name], walls[name]) for name in ENGINES}
    return {
        "concurrency": level,
        "engines": {name: asdict(report) for name, report in reports.items()},
        "prompt_tokens": {name: sum(r.prompt_tokens for r in results[name]) for name in ENGINES},
        "tokens_per_s": tps,
        "ratio_per_round": ratios,
        "ratio": _spread(ratios),
        "errors": warm_errors + sum(report.num_errors for report in reports.values()),
    }


def _spread(values: list[float]) -> dict[str, float | None]:
    """``min`` / ``median`` / ``max`` of ``values`` (None each when there are none)."""
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def print_level(level: dict[str, Any]) -> None:
    """One line per engine (all rounds pooled), then the per-round throughput ratio."""
    for name in ENGINES:
        p = level["engines"][name]
        rounds = "/".join(f"{v:.1f}" for v in level["tokens_per_s"][name])
        print(
            f"{name:>14}: {p['num_requests']:4d} req  {p['tokens_per_s']:8.1f} tok/s "
            f"(rounds {rounds})  TTFT p50 {format_ms(p['ttft_p50_s'])} ms "
            f"p99 {format_ms(p['ttft_p99_s'])} ms  ITL p99 {format_ms(p['itl_p99_s'])} ms  "
            f"hit {p['hit_rate']:.1%}  prompt tokens {level['prompt_tokens'][name]}  "
            f"errors {p['num_errors']}"
        )
    r = level["ratio"]
    if r["median"] is not None:
        print(
            f"{'':>14}  tok/s {ENGINES[0]} / {ENGINES[1]} per round: min {r['min']:.2f}x  "
            f"median {r['median']:.2f}x  max {r['max']:.2f}x  ({len(level['ratio_per_round'])} "
            f"rounds of {level['concurrency']} concurrent requests, same run)"
        )
    tokens = set(level["prompt_tokens"].values())
    if len(tokens) > 1:
        print(f"{'':>14}  WARNING: the engines counted different prompt tokens: {tokens}")


def run_vs_llama_server(args: argparse.Namespace) -> dict[str, Any]:
    """Serve W1 here and on llama-server, run every ``--concurrency`` level on both, stop both.

    Returns:
        ``{"levels": [compare_level(...)], "errors": int, "pinned_blocks_after": None,
        "threads": int, "llama_server_command": [str]}``.

    Raises:
        PeerError: the GGUF conversion failed, or llama-server did not start.
    """
    import torch

    default_threads = torch.get_num_threads()
    threads = args.threads or default_threads
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="agentcache-bench-load-") as folder:
            return _serve_both(args, Path(folder), threads)
    finally:
        torch.set_num_threads(default_threads)  # NOTE: main() may run inside another program


def _weights(args: argparse.Namespace, folder: Path) -> tuple[Path, Path]:
    """``(HF folder, GGUF)`` of W1: saved and converted here, or the GGUF ``--gguf`` gives.

    Raises:
        PeerError: the converter failed.
    """
    from runtime.bench._common import w1_model

    layers = args.layers or DEFAULT_LAYERS
    model = w1_model(argparse.Namespace(layers=layers, dtype="float32", weights=args.weights))
    if args.gguf is not None:
        return save_hf(model, folder), Path(args.gguf)
    outtype = "bf16" if args.weights == "bfloat16" else "f32"
    try:
        return folder / "hf", export_gguf(model, folder, Path(args.llama_cpp_convert),
                                          outtype=outtype)  # fmt: skip
    except RuntimeError as exc:
        raise PeerError(str(exc)) from exc


def _serve_both(args: argparse.Namespace, folder: Path, threads: int) -> dict[str, Any]:
    """Save (and convert) W1, serve it on both engines, run the levels, stop both."""
    from runtime.engine import Engine
    from runtime.serve.app import create_app
    from runtime.serve.server_thread import ServerThread

    hf_dir, gguf = _weights(args, folder)
    engine = Engine.from_pretrained(str(hf_dir), weights=args.weights)
    prompts = partial(peer_prompts, engine.tokenize, args.system_words)
    prompt_len = len(prompts("slot", 1)[0])
    print(
        f"W1 ({args.layers or DEFAULT_LAYERS} layers, "
        f"{'bf16 weights' if args.weights == 'bfloat16' else 'f32'}), {prompt_len}-token prompts, "
        f"{args.max_tokens} tokens each, threads per engine: {threads}"
    )
    levels: list[dict[str, Any]] = []
    try:
        # NOTE: ours binds its port first, so free_port() cannot hand out the same one.
        with ServerThread(create_app(engine)) as ours:
            peer = _llama_server(args, gguf, prompt_len + 64 + args.max_tokens, threads)
            with peer as theirs, client_phases(in_process=args.in_process_clients) as phase:
                urls = dict(zip(ENGINES, (ours, theirs), strict=True))
                for level in args.concurrency:
                    levels.append(compare_level(urls, prompts, level, args, phase))
                    print_level(levels[-1])
    finally:
        engine.close()
    return {
        "levels": levels,
        "errors": sum(lv["errors"] for lv in levels),
        "pinned_blocks_after": None,
        "threads": threads,
        "llama_server_command": peer.command,
    }


def _llama_server(args: argparse.Namespace, gguf: Path, slot_len: int, threads: int) -> LlamaServer:
    """llama-server on a free port, ``slot_len`` tokens per slot (prompt + 64 for the growing
    tags + ``max_tokens``); printed, not yet started."""
    port, num_slots = free_port(), args.llama_server_np or DEFAULT_NUM_SLOTS
    flash_attn = args.llama_server_flash_attn or DEFAULT_FLASH_ATTN
    command = server_command(check_binary(args.llama_server), gguf, port=port,
                             num_slots=num_slots, slot_len=slot_len, threads=threads,
                             flash_attn=flash_attn)  # fmt: skip
    print(f"llama-server: {' '.join(command[1:])}")
    return LlamaServer(command, port)
