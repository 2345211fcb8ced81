"""``agentcache demo``: a local RAG agent over real documents that shows what the caches saved.

Indexes the installed standard library's docstrings (or ``--docs PATH``), then runs a short
multi-turn session on the local engine (or ``--base-url``), streaming answers and printing
per-turn prompt-cache, retrieval-cache and tool-cache figures (and, with ``--chunk-reuse``, the
document tokens reused from the engine's chunk store). Knows no model internals.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentcache import env
from agentcache._demo_options import base_url_of, cache_dir_of, check_options, chunk_reuse_of
from agentcache._demo_report import TurnReport, print_summary, print_turn
from agentcache.agent import Agent, AgentConfig, PlannedCall
from agentcache.backends import BaseBackend, GenerationOptions, create_backend
from agentcache.backends.base import ToolChoice
from agentcache.backends.local import (  # NOTE: imports no torch until one is constructed.
    CHATML_STOPS,
    MARKUP_STOPS,
    LocalBackend,
)
from agentcache.cache import DiskStore, RetrievalCache, ToolCache
from agentcache.exceptions import AgentCacheError, ConfigError, EmptyCorpusError
from agentcache.prompt import Document
from agentcache.rag import Chunk, DocumentIndex, TextSource, format_chunks, load_folder
from agentcache.rag.chunking import chunk_sources
from agentcache.rag.loader import DEFAULT_SUFFIXES
from agentcache.rag.stdlib import stdlib_sources

__all__ = ["DEFAULT_MODEL", "QUESTIONS", "DemoSession", "DocTools", "plan", "run"]

DEFAULT_MODEL = "smollm2-135m"
"""The local engine's model without ``--model``: SmolLM2-135M-Instruct, pulled on first use
(``agentcache models pull``); ``tiny`` stays the test suite's model."""

QUESTIONS: tuple[str, ...] = (
    "What does functools.lru_cache do?",
    "What does heapq.nlargest do?",
    "What does base64.b64encode do?",
    "What does functools.lru_cache do?",
)
"""Built-in questions, each naming one stdlib object whose docstring is in the corpus: the
search brings that object's chunk into the prompt and ``read_doc`` its whole docstring, so a
model that answers from sources can answer. Short docstrings: the four turns' history must fit
the bundled model's 4096-token context (``json.loads`` twice did not). The last repeats the
first so the retrieval and tool caches hit within one run; tests/agentcache/test_demo_examples.py
checks all of this."""

SYSTEM = (
    "You are a documentation assistant for the Python standard library. Answer briefly from the "
    "documents and tool results; cite chunk ids in brackets. Call search_docs to find passages "
    "and read_doc to read one object's full docstring."
)
SYSTEM_NEUTRAL = (
    "You are a documentation assistant. Answer briefly from the documents and tool results; "
    "cite chunk ids in brackets. Call search_docs to find passages and read_doc to read one "
    "source in full."
)
"""System prompt for ``--docs``: names no corpus."""
PINNED_SOURCES = (
    "json",
    "functools",
    "csv",
    "pathlib",
    "collections",
    "itertools",
    "re",
    "datetime",
    "heapq",
)
"""Module docstrings pinned into the stable prefix (those present in the corpus)."""
TOY_NOTE = (
    "model: bundled 'tiny' - a toy trained on stdlib docstrings. It shows the caching "
    "mechanics, not good answers; a deterministic planner picks its tool calls."
)
_DOTTED = re.compile(r"\b([a-z_][a-z0-9_]*\.[A-Za-z_][A-Za-z0-9_.]*)")


@dataclass
class DocTools:
    """The demo's tools over one corpus; remembers the chunks retrieved in the current turn."""

    index: DocumentIndex
    sources: dict[str, str]
    retrieved: list[Chunk] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    """Sources ``read_doc`` returned in the current turn."""

    def search_docs(self, query: str) -> str:
        """Search the documentation and return the most relevant passages.

        Args:
            query: Keywords or a question.
        """
        chunks = self.index.retrieve(query, k=3)
        self.retrieved.extend(chunks)
        return format_chunks(chunks)

    def read_doc(self, name: str) -> str:
        """Return the full docstring of one object, e.g. ``functools.lru_cache``.

        Args:
            name: Dotted name of a module, class or function (``json.decoder.JSONDecoder``:
                every module/qualname split is tried, longest module first).
        """
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            module, qualname = ".".join(parts[:cut]), ".".join(parts[cut:])
            key = f"{module}:{qualname}" if qualname else module
            text = self.sources.get(key)
            if text is not None:
                self.read.append(key)
                return text
        if name in self.sources:
            self.read.append(name)
            return self.sources[name]
        return f"no docstring for {name!r}"


def plan(question: str) -> list[PlannedCall]:
    """Deterministic tool choice for models that cannot plan: search, plus read_doc for names."""
    calls: list[PlannedCall] = [("search_docs", {"query": question})]
    calls += [("read_doc", {"name": name.rstrip(".")}) for name in _DOTTED.findall(question)]
    return calls


def load_corpus(docs: str | None, console: Console, errors: Console) -> list[TextSource]:
    """Read ``docs`` (a folder) or the stdlib docstrings, with a progress bar on ``console``.

    Files of ``docs`` that cannot be read are named in one warning line on ``errors`` (stderr).

    Raises:
        ConfigError: ``docs`` does not exist.
        EmptyCorpusError: ``docs`` holds no readable, non-empty .md/.txt/.py file.
    """
    if docs is not None:
        return _load_folder(docs, errors)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("reading stdlib docstrings", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return stdlib_sources(progress=progress)


def _load_folder(docs: str, errors: Console) -> list[TextSource]:
    skipped: list[tuple[str, str]] = []
    sources = load_folder(docs, on_skip=lambda name, why: skipped.append((name, why)))
    if skipped:
        shown = ", ".join(f"{name} ({why})" for name, why in skipped[:3])
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        errors.print(f"skipped {len(skipped)} file(s): {shown}{more}", markup=False)
    if not sources:
        suffixes = "/".join(DEFAULT_SUFFIXES)
        raise EmptyCorpusError(f"no readable, non-empty {suffixes} files under {docs!r}")
    return sources


def build_session(
    args: argparse.Namespace, backend: BaseBackend, sources: list[TextSource], console: Console
) -> DemoSession:
    """Index the corpus and assemble caches and agent (stores under the cache dir)."""
    cache_dir = cache_dir_of(args)
    started = time.perf_counter()
    chunks = chunk_sources(sources)
    retrieval_cache = RetrievalCache(DiskStore(cache_dir / "retrieval"))
    index = DocumentIndex(chunks, cache=retrieval_cache)
    # NOTE: soft_wrap: rich wrapped a long cache path onto the line after its label.
    console.print(
        f"indexed {len(sources)} texts -> {len(chunks)} chunks (BM25) in "
        f"{time.perf_counter() - started:.1f}s; caches in {cache_dir}",
        soft_wrap=True,
        markup=False,
    )
    tools = DocTools(index, {s.source: s.text for s in sources})
    agent = Agent(
        backend,
        system=SYSTEM_NEUTRAL if getattr(args, "docs", None) else SYSTEM,
        documents=_pinned(chunks),
        tool_cache=ToolCache(DiskStore(cache_dir / "tools")),
        planner=plan if needs_planner(backend) or retrieves_first(backend) else None,
        config=AgentConfig(
            max_steps=3,
            # NOTE: a small local model gets the sources before the question (RAG before
            # generation) and answers one paragraph; an endpoint's model must search first
            # (tool_choice required), then answer from what it found.
            planned_results="context" if retrieves_first(backend) else "tool_messages",
            tool_choices=_tool_choices(backend),
            # NOTE: LocalBackend adds these itself; a server running the toy may not.
            generation=GenerationOptions(max_tokens=args.max_tokens, stop=_stops(backend)),
            namespace="agentcache-demo",
            raise_on_step_limit=False,
        ),
    )
    agent.registry.add(tools.search_docs, cache=False)  # NOTE: RetrievalCache inside.
    # NOTE: read_doc answers from this corpus: its version is part of every key (freshness rule).
    agent.registry.add(tools.read_doc, version="1", depends_on=lambda: tools.index.fingerprint)
    return DemoSession(tools, agent, retrieval_cache)


@dataclass(frozen=True)
class DemoSession:
    """The tools, agent and retrieval cache of one demo run."""

    tools: DocTools
    agent: Agent
    retrieval_cache: RetrievalCache


def _pinned(chunks: list[Chunk]) -> list[Document]:
    first = {}
    for chunk in chunks:
        if chunk.source in PINNED_SOURCES and chunk.source not in first:
            first[chunk.source] = chunk
    picked = list(first.values()) or chunks[:4]
    return [Document(c.id, c.text, source=c.source) for c in picked]


PROMPT = "[bold]you[/bold] [dim](empty line or Ctrl-D ends, Ctrl-C stops)[/dim]> "


def questions(args: argparse.Namespace, console: Console) -> Iterator[str]:
    """``--question`` texts, then lines typed by the user (``--interactive``); else built-ins."""
    given: list[str] = list(args.question or [])
    yield from given
    if not wants_prompt(args):
        if not given:
            yield from QUESTIONS
        return
    while True:
        try:
            line = console.input(PROMPT).strip()
        except EOFError:
            return
        if not line:
            return
        yield line


def wants_prompt(args: argparse.Namespace) -> bool:
    """Ask on the terminal: ``--interactive``, or ``--docs`` without ``--question`` on a TTY."""
    return bool(args.interactive or (args.docs and not args.question and sys.stdin.isatty()))


def ask(session: DemoSession, question: str, write: Callable[[str], None]) -> TurnReport:
    """Run one turn and collect its figures."""
    before = session.retrieval_cache.stats()
    session.tools.retrieved.clear()
    session.tools.read.clear()
    started = time.perf_counter()
    result = session.agent.run(question, on_text=write)
    wall_s = time.perf_counter() - started
    retrieval = session.retrieval_cache.stats().since(before)
    tools = result.tool_cache_stats
    backend = session.agent.backend
    # NOTE: the same prompt again with the prefix cache off: an honest per-turn comparison.
    cold = backend.measure_cold_ttft() if isinstance(backend, LocalBackend) else None
    return TurnReport(
        question=question,
        usage=result.usages[-1],
        wall_s=wall_s,
        sources=sorted({c.source for c in session.tools.retrieved} | set(session.tools.read)),
        retrieval_hits=retrieval.hits,
        retrieval_misses=retrieval.misses,
        tool_hits=tools.hits if tools else 0,
        tool_misses=tools.misses if tools else 0,
        cold_ttft_s=cold.ttft_s if cold is not None else None,
    )


def make_backend(args: argparse.Namespace) -> BaseBackend:
    """Local engine by default; an OpenAI-compatible endpoint with ``--base-url``.

    Without ``--model`` the local engine runs ``DEFAULT_MODEL`` (pulled on first use) and an
    endpoint gets ``AGENTCACHE_MODEL`` or else the first model its ``/models`` lists.
    """
    base_url = base_url_of(args)
    if base_url:
        return create_backend(base_url, model=args.model or env.default_model())
    # NOTE: chunk_reuse=None (the default) is the exact prefix cache alone.
    weights = getattr(args, "weights", None) or "float32"
    return create_backend(
        "local",
        model=args.model or DEFAULT_MODEL,
        chunk_reuse=chunk_reuse_of(args),
        weights=weights,
    )


def is_toy(backend: BaseBackend) -> bool:
    """The bundled tiny model on the local engine (it cannot plan tool calls)."""
    return backend.capabilities.is_local and backend.model == "tiny"


def retrieves_first(backend: BaseBackend) -> bool:
    """A real model on the local engine, or ``DEFAULT_MODEL`` by name (ours behind ``agentcache
    serve``): SmolLM2-135M is too small to plan searches (its grammar-held queries named the
    tool, not the question) or to answer from tool messages (it copied them back, markup
    included), so it answers from sources placed before the question."""
    if needs_planner(backend):
        return False
    return backend.capabilities.is_local or backend.model == DEFAULT_MODEL


def _tool_choices(backend: BaseBackend) -> tuple[ToolChoice, ...]:
    if needs_planner(backend):
        return ()
    return ("none",) if retrieves_first(backend) else ("required", "none")


def _stops(backend: BaseBackend) -> tuple[str, ...]:
    """The toy's ChatML stops; one paragraph for a small model (greedy 135M repeats), and over
    HTTP the document markup the local backend stops at by itself (``MARKUP_STOPS``)."""
    if needs_planner(backend):
        return CHATML_STOPS
    if not retrieves_first(backend):
        return ()
    return ("\n\n",) if backend.capabilities.is_local else ("\n\n", *MARKUP_STOPS)


def needs_planner(backend: BaseBackend) -> bool:
    """Models named ``tiny`` (ours, locally or behind ``agentcache serve``) cannot plan tools."""
    return backend.model == "tiny"


def describe(backend: BaseBackend, args: argparse.Namespace) -> str:
    """The model note printed before the session (and what ``--chunk-reuse`` does, when on)."""
    mode = chunk_reuse_of(args)
    note = _describe_model(backend, args)
    if mode is None:
        return note
    fraction = getattr(backend, "recompute_fraction", 0.15)
    return f"{note}\n{chunk_reuse_note(mode, is_toy_model=is_toy(backend), fraction=fraction)}"


def chunk_reuse_note(mode: str, *, is_toy_model: bool, fraction: float) -> str:
    """What ``--chunk-reuse MODE`` changes in the demo, in words (printed once, before turn 1).

    Assembled prompts are prefix-cached in the mode's own namespace, keyed by ids that spell the
    document spans (``ChunkReuse.cache_ids``), so a turn that keeps the pinned documents where
    they were reuses the whole earlier turn; the chunk store serves documents that are new or
    moved. Chunk reuse pays where documents change order under a short question
    (``agentcache bench rag``); the demo shows its mechanics and says so.
    """
    if mode == "blend":
        how = (
            f"blend (approximate: answers may differ from a full prefill; {fraction:.0%} of "
            "document tokens recomputed, CacheBlend's selection)"
        )
    else:
        trained = (
            "the bundled tiny was not trained with block attention, so answers differ from a "
            "full prefill"
            if is_toy_model
            else "answers differ from a full prefill unless the model was trained with it"
        )
        how = f"exact under the block attention mask (documents see only themselves; {trained})"
    return (
        f"chunk reuse: {how}. Each pinned document's KV comes from the chunk store in any order "
        "(computed alone on a miss); a later turn with the documents in the same places is "
        "served by the prefix cache, documents included (bench rag shows where chunk reuse pays)."
    )


def _describe_model(backend: BaseBackend, args: argparse.Namespace) -> str:
    if is_toy(backend):
        return TOY_NOTE
    planner = (
        "the demo's planner picks tool calls"
        if needs_planner(backend)
        else "sources retrieved before each question, one-paragraph answers"
        if retrieves_first(backend)
        else "the model calls a tool first, then answers"
    )
    base_url = base_url_of(args)
    where = f"at {base_url}" if base_url else "on the local engine"
    return f"model: {backend.model} {where} ({planner})"


def _answer_writer(console: Console, written: list[str]) -> Callable[[str], None]:
    """Print streamed answer text as it comes (no markup parsing) and keep it in ``written``;
    leading whitespace is not printed, so the answer starts on the ``A:`` line."""

    def write(text: str) -> None:
        written.append(text)
        if not "".join(written[:-1]).strip():
            text = text.lstrip()
        console.print(text, end="", markup=False, highlight=False)

    return write


def run(args: argparse.Namespace) -> int:
    """Entry point of ``agentcache demo``.

    Returns:
        0 on success; 2 when the options or inputs cannot be used (bad option, missing or empty
        ``--docs``, unknown model, endpoint unavailable or refusing the key or model, found
        before or during a turn); 1 when a turn fails otherwise; 130 on Ctrl-C.

    Answers, turn lines and the summary go to stdout; a failure's one line and the skipped-files
    warning go to stderr (red on a terminal), as the other commands' errors do.
    """
    console = Console(highlight=False)
    errors = Console(stderr=True, highlight=False)
    held: list[BaseBackend] = []
    try:
        return _run(args, console, errors, held)
    except KeyboardInterrupt:  # NOTE: stdout: it ends the transcript, answer mid-line included.
        console.print("\n[dim]interrupted[/dim]")
        return EXIT_INTERRUPTED
    finally:
        for backend in held:
            backend.close()


def _run(
    args: argparse.Namespace, console: Console, errors: Console, held: list[BaseBackend]
) -> int:
    started = time.perf_counter()
    try:
        check_options(args)
        sources = load_corpus(args.docs, console, errors)
        base_url = base_url_of(args)
        loading = f"connecting to {base_url}..." if base_url else "loading torch and the model..."
        with _loading(console, loading):
            backend = make_backend(args)
            held.append(backend)
            if isinstance(backend, LocalBackend):
                backend.warm_up()  # NOTE: keeps one-time start-up costs out of turn 1's TTFT.
        console.print(describe(backend, args), soft_wrap=True)
        session = build_session(args, backend, sources, console)
    except AgentCacheError as exc:
        return _fail(errors, exc, default=2)
    reports: list[TurnReport] = []
    try:
        for question in questions(args, console):
            console.print(f"\n[bold]Q:[/bold] {question}\n[bold]A:[/bold] ", end="")
            written: list[str] = []
            report = ask(session, question, _answer_writer(console, written))
            if not "".join(written).strip():
                console.print("[dim](empty: the model ended its turn at once)[/dim]", end="")
            print_turn(console, len(reports) + 1, report, reports[-1] if reports else None)
            reports.append(report)
    except AgentCacheError as exc:
        console.print()  # NOTE: ends the turn's answer line on stdout, which may be mid-line.
        return _fail(errors, exc, default=1)
    print_summary(console, reports, time.perf_counter() - started)
    return 0


EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""


@contextlib.contextmanager
def _loading(console: Console, text: str) -> Iterator[None]:
    """A spinner on a terminal, one plain line elsewhere, while something slow loads."""
    if not console.is_terminal:
        console.print(text)
        yield
        return
    with console.status(text):
        yield


def _fail(errors: Console, exc: AgentCacheError, *, default: int) -> int:
    """One line on stderr naming ``exc`` and a fix; 2 for configuration errors, else ``default``."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    status = getattr(exc, "status_code", None)
    if status in (401, 403):
        message += (
            "; the endpoint refused the API key: set AGENTCACHE_API_KEY (or OPENAI_API_KEY) "
            "to the key the server expects (agentcache serve --api-key KEY)"
        )
    elif status == 404:
        message += "; check the endpoint URL (it usually ends in /v1) and --model"
    errors.print(f"agentcache demo: {message}", style="red", markup=False, soft_wrap=True)
    is_config = isinstance(exc, ConfigError | EmptyCorpusError) or status in (400, 401, 403, 404)
    return 2 if is_config else default


if __name__ == "__main__":  # pragma: no cover
    from agentcache.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
