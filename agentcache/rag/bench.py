"""``agentcache bench qa``: grounded QA on the shipped question set, per cache mode.

Each question of ``qa_set.json`` goes through the SDK's RAG pipeline (``DocumentIndex`` with BM25,
``PromptBuilder`` with the retrieved chunks as documents, ``LocalBackend``) on the local engine,
greedy, once per mode: cache off (a force-miss engine), prefix cache, and chunk reuse exact and
blend (on the prefix-cache engine, each mode its own ``cache_salt`` so no mode reuses another's
KV). The modes alternate question by question (rotated order), so their TTFTs come from the same
minutes of the machine. Prints exact-fact accuracy, retrieval recall, TTFT, the prefix-cached and
chunk-reused shares of prompt tokens, and how many answers equal cache off's token for token.
``--compare-weights`` adds a prefix-cache engine per other weight type and reports how many of its
answers equal the reference weights' token for token and which questions flip right/wrong.
A script, never a timed test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentcache._argtypes import positive_int
from agentcache.backends.base import GenerationOptions
from agentcache.exceptions import AgentCacheError, ConfigError
from agentcache.prompt import Document, PromptBuilder
from agentcache.rag.chunking import Chunk
from agentcache.rag.pipeline import DocumentIndex
from agentcache.rag.qa_set import QaQuestion, QaSet, answer_matches, load_qa_set

if TYPE_CHECKING:
    from agentcache.backends.local import LocalBackend

__all__ = ["MARKUP_STOPS", "MODES", "SYSTEM", "main"]

MODES: tuple[str, ...] = ("cache off", "prefix cache", "chunk exact", "chunk blend")
SYSTEM = (
    "Answer the question using only the documents. Reply with the short answer only, "
    "in a few words."
)
MARKUP_STOPS: tuple[str, ...] = ("<document", "</document")
"""Stop strings: a model that copies the prompt's document tags (``templates/documents.jinja``)
has left its answer; the rest would be markup, not answer text."""
WEIGHTS: tuple[str, ...] = ("float32", "bfloat16", "float32-packed", "q8_0", "q4_1")
KV_DTYPES: tuple[str, ...] = ("auto", "float32", "float16")
_MARKUP = re.compile(r"</?documents?\b|<\|im_(?:start|end)\|>|</?tool_(?:call|response)>")

DESCRIPTION = """\
Grounded QA on the question set that ships with agentcache (made-up facts, so pretraining cannot
answer): each question is retrieved (BM25), built into a prompt (PromptBuilder) and answered
greedily by the local engine (LocalBackend) in each mode: cache off, prefix cache, chunk reuse
exact and blend. Prints exact-fact accuracy, retrieval recall, TTFT (min/median/max), the shares
of prompt tokens served by the prefix cache and by chunk reuse, and how many answers equal cache
off's token for token (prefix cache must match all: the exactness contract). Exit 1 when they do
not. --compare-weights W... also answers every question with weights W (prefix cache) and prints
how many answers equal --weights' token for token and the questions that flip right<->wrong."""


@dataclass
class ModeRecord:
    """What one mode produced, question by question."""

    answers: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunk_reused_tokens: int = 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentcache bench qa", description=DESCRIPTION)
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="bundled or named model, or a model folder (default: smollm2-135m, pulled on first "
        "use; tiny: the offline toy, whose answers are noise)",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="float32",
        help="LocalBackend weights (default: float32, the reference; q8_0 / q4_1: a quantized "
        "model, another model whose accuracy this measures)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="the KV cache's element type in every mode (serve --kv-dtype; default auto: the "
        "model's dtype; float16: opt-in, half the KV bytes, whose cache-on-vs-off agreement "
        "this measures)",
    )
    p.add_argument(
        "--compare-weights",
        nargs="+",
        choices=WEIGHTS,
        default=[],
        metavar="W",
        help="also answer with these weights (prefix cache; one mode each) and report their "
        "agreement with --weights: answers equal token for token, questions that flip "
        "right->wrong and wrong->right",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--limit", type=positive_int, default=None, help="first N questions only")
    p.add_argument("--k", type=positive_int, default=3, help="documents retrieved per question")
    p.add_argument("--max-tokens", type=positive_int, default=24, help="tokens per answer")
    p.add_argument("--fraction", type=float, default=0.15, help="blend recompute fraction")
    p.add_argument(
        "--skip-chunk-reuse",
        action="store_true",
        help="run only cache off and prefix cache (half the time: enough for accuracy)",
    )
    p.add_argument("--show-answers", action="store_true", help="print every answer per mode")
    p.add_argument(
        "--json",
        action="store_true",
        help="only JSON: one line, the summary (accuracy in prefix-cache mode, weights, ...) "
        "with each mode's figures under 'modes'",
    )
    return p


def main(argv: list[str]) -> int:
    """Run the QA bench; 0 when prefix-cache answers equal cache off's, 1 when not, 2 for a
    model or option the local backend refuses."""
    parser = _parser()
    args = parser.parse_args(argv)
    compared = args.compare_weights
    if args.weights in compared or len(set(compared)) < len(compared):
        parser.error("--compare-weights: each W once, and none equal to --weights")
    qa = load_qa_set()
    questions = qa.questions[: args.limit]
    try:
        with _threads(args.threads):
            backends = _backends(args)
            try:
                records = _run(args, qa, questions, backends)
                kv_dtype = backends["prefix cache"].engine.kv_dtype
            finally:
                for backend in backends.values():
                    backend.close()
    except AgentCacheError as exc:
        print(f"agentcache bench qa: {exc}", file=sys.stderr)
        return 2
    lines, summary = _figures(args, qa, questions, records)
    summary["kv_dtype"] = kv_dtype
    _print(args, questions, records, lines, summary)
    return 0 if summary["cache_on_equals_cache_off"] else 1


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's thread count set for the run and restored after (the bench also runs in tests)."""
    if count is None:
        yield
        return
    # NOTE: torch only through the runtime's install; LocalBackend has loaded it anyway.
    torch: Any = importlib.import_module("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _backends(args: argparse.Namespace) -> dict[str, LocalBackend]:
    """A force-miss engine for cache off; one prefix-cache engine shared by the other modes."""
    from agentcache.backends.local import LocalBackend

    kv = args.kv_dtype
    off = LocalBackend(args.model, prefix_cache=False, weights=args.weights, kv_dtype=kv)
    on = LocalBackend(args.model, weights=args.weights, kv_dtype=kv, cache_salt="qa-prefix")
    found: dict[str, LocalBackend] = {"cache off": off, "prefix cache": on}
    for mode in () if args.skip_chunk_reuse else ("exact", "blend"):
        try:
            found[f"chunk {mode}"] = LocalBackend(
                args.model, engine=on.engine, chunk_reuse=mode, cache_salt=f"qa-{mode}",
                recompute_fraction=args.fraction,
            )  # fmt: skip
        except ConfigError as exc:  # NOTE: a model that cannot reuse chunks runs the rest
            print(f"agentcache bench qa: chunk {mode} skipped: {exc}", file=sys.stderr)
    for weights in args.compare_weights:
        found[_compared_mode(weights)] = LocalBackend(
            args.model, weights=weights, kv_dtype=kv, cache_salt=f"qa-{weights}"
        )
    for mode in ("cache off", "prefix cache", *map(_compared_mode, args.compare_weights)):
        found[mode].warm_up()
    return found


def _compared_mode(weights: str) -> str:
    """The mode name of ``--compare-weights``' engine with ``weights``."""
    return f"prefix cache {weights}"


def _run(
    args: argparse.Namespace,
    qa: QaSet,
    questions: tuple[QaQuestion, ...],
    backends: dict[str, LocalBackend],
) -> dict[str, ModeRecord]:
    index = DocumentIndex.from_sources(qa.documents)
    options = GenerationOptions(max_tokens=args.max_tokens, stop=MARKUP_STOPS)
    records = {mode: ModeRecord() for mode in backends}
    modes = list(backends)
    for i, item in enumerate(questions):
        prompt = _prompt(index.retrieve(item.question, args.k), item.question)
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            backend = backends[mode]
            backend.reset()  # NOTE: questions are independent conversations
            response = backend.complete(prompt, options)
            _record(records[mode], item, response, backend.last_completion_ids)
        if args.show_answers and not args.json:
            _print_answers(i, item, records)
    return records


def _prompt(chunks: list[Chunk], question: str) -> Any:
    docs = [Document(c.id, c.text, source=c.source) for c in chunks]
    return PromptBuilder(namespace="bench-qa").system(SYSTEM).documents(docs).user(question).build()


def _record(record: ModeRecord, item: QaQuestion, response: Any, ids: list[int]) -> None:
    usage = response.usage
    answer = response.text.strip()
    record.answers.append(answer)
    record.token_ids.append(ids)
    record.ttft_s.append(float(usage.ttft_s or 0.0))
    record.correct.append(answer_matches(answer, item.answers))
    record.prompt_tokens += usage.prompt_tokens or 0
    record.cached_tokens += usage.cached_tokens or 0
    record.chunk_reused_tokens += usage.chunk_reused_tokens or 0


def _recall(qa: QaSet, questions: tuple[QaQuestion, ...], k: int) -> float:
    """Mean share of each question's gold documents among its ``k`` retrieved chunks."""
    index = DocumentIndex.from_sources(qa.documents)
    shares = []
    for item in questions:
        found = {c.source for c in index.retrieve(item.question, k)}
        shares.append(sum(d in found for d in item.documents) / len(item.documents))
    return statistics.fmean(shares)


def _mode_line(mode: str, record: ModeRecord, off: ModeRecord, recall: float) -> dict[str, Any]:
    ms = [1e3 * t for t in record.ttft_s]
    prompt = max(record.prompt_tokens, 1)
    return {
        "mode": mode,
        "questions": len(record.answers),
        "completion_tokens": sum(len(ids) for ids in record.token_ids),
        "accuracy": statistics.fmean(record.correct),
        "retrieval_recall": recall,
        "ttft_ms_min": min(ms),
        "ttft_ms_median": statistics.median(ms),
        "ttft_ms_max": max(ms),
        "prefix_cached_share": record.cached_tokens / prompt,
        "chunk_reused_share": record.chunk_reused_tokens / prompt,
        "same_tokens_as_cache_off": sum(
            a == b for a, b in zip(record.token_ids, off.token_ids, strict=True)
        ),
        "answers_with_markup": sum(bool(_MARKUP.search(a)) for a in record.answers),
    }


def _ratios(num: ModeRecord, den: ModeRecord) -> tuple[float, float, float]:
    """min/median/max over questions of ``num``'s TTFT / ``den``'s (same question, same run)."""
    values = [a / b for a, b in zip(num.ttft_s, den.ttft_s, strict=True) if b > 0]
    return min(values), statistics.median(values), max(values)


def _figures(
    args: argparse.Namespace,
    qa: QaSet,
    questions: tuple[QaQuestion, ...],
    records: dict[str, ModeRecord],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    recall = _recall(qa, questions, args.k)
    off = records["cache off"]
    lines = [_mode_line(mode, rec, off, recall) for mode, rec in records.items()]
    by_mode = {line["mode"]: line for line in lines}
    prefix = by_mode["prefix cache"]
    summary: dict[str, Any] = {
        "summary": True, "model": args.model, "weights": args.weights,
        "questions": len(questions), "documents": len(qa.documents), "k": args.k,
        "accuracy": prefix["accuracy"], "cache_off_accuracy": by_mode["cache off"]["accuracy"],
        "retrieval_recall": recall,
        "cache_on_equals_cache_off": prefix["same_tokens_as_cache_off"] == len(questions),
        "prefix_ttft_speedup": _ratios(off, records["prefix cache"]),
    }  # fmt: skip
    for mode in ("chunk exact", "chunk blend"):
        if mode in by_mode:
            key = mode.replace(" ", "_")
            summary[f"{key}_accuracy"] = by_mode[mode]["accuracy"]
            summary[f"{key}_ttft_speedup"] = _ratios(off, records[mode])
            summary[f"{key}_vs_prefix_ttft"] = _ratios(records["prefix cache"], records[mode])
    summary["weights_comparison"] = {
        weights: _agreement(records["prefix cache"], records[_compared_mode(weights)])
        for weights in args.compare_weights
    }
    return lines, summary


def _agreement(ref: ModeRecord, other: ModeRecord) -> dict[str, Any]:
    """How ``other`` (another weight type) answered next to ``ref`` (the reference weights), both
    prefix cache, greedy: answers equal token for token (count and share of questions), accuracy,
    and the 1-based question numbers that flip from right to wrong and from wrong to right."""
    pairs = list(zip(ref.correct, other.correct, strict=True))
    same = sum(a == b for a, b in zip(ref.token_ids, other.token_ids, strict=True))
    return {
        "accuracy": statistics.fmean(other.correct),
        "same_tokens_as_reference": same,
        "agreement": same / len(pairs),
        "right_to_wrong": [i for i, (a, b) in enumerate(pairs, 1) if a and not b],
        "wrong_to_right": [i for i, (a, b) in enumerate(pairs, 1) if b and not a],
    }


def _print(
    args: argparse.Namespace,
    questions: tuple[QaQuestion, ...],
    records: dict[str, ModeRecord],
    lines: list[dict[str, Any]],
    summary: dict[str, Any],
) -> None:
    if args.json:
        print(json.dumps({**summary, "modes": lines}, sort_keys=True))
        return
    n = len(questions)
    print(
        f"bench qa: {n} questions over {summary['documents']} documents of made-up facts, "
        f"model {args.model}, weights {args.weights}, {summary['kv_dtype']} KV cache, "
        f"k={args.k}, greedy, "
        f"{args.max_tokens} tokens max"
    )
    print(f"retrieval recall (BM25, k={args.k}): {summary['retrieval_recall']:.3f}")
    width = max(len(line["mode"]) for line in lines)
    head = f"{'mode':{width}s} {'accuracy':>8s} {'TTFT ms min/median/max':>24s}"
    print(f"{head} {'prefix-cached':>13s} {'chunk-reused':>12s} {'= cache off':>11s} markup")
    for line in lines:
        ttft = "/".join(f"{line[f'ttft_ms_{k}']:.0f}" for k in ("min", "median", "max"))
        print(
            f"{line['mode']:{width}s} {line['accuracy']:8.3f} {ttft:>24s} "
            f"{line['prefix_cached_share']:13.1%} {line['chunk_reused_share']:12.1%} "
            f"{line['same_tokens_as_cache_off']:>6d}/{n:<4d} {line['answers_with_markup']:>6d}"
        )
    _print_verdicts(summary, n)


def _print_verdicts(summary: dict[str, Any], n: int) -> None:
    same = "equal" if summary["cache_on_equals_cache_off"] else "DIFFER FROM"
    accuracy, off_accuracy = summary["accuracy"], summary["cache_off_accuracy"]
    print(
        f"prefix-cache answers {same} cache-off answers token for token ({summary['weights']} "
        f"weights, greedy); accuracy {accuracy:.3f} vs {off_accuracy:.3f}"
    )
    lo, mid, hi = summary["prefix_ttft_speedup"]
    print(f"TTFT cache off / prefix cache: {mid:.2f}x median ({lo:.2f}-{hi:.2f}) per question")
    for mode in ("chunk exact", "chunk blend"):
        key = mode.replace(" ", "_")
        if f"{key}_accuracy" not in summary:
            continue
        lo, mid, hi = summary[f"{key}_ttft_speedup"]
        plo, pmid, phi = summary[f"{key}_vs_prefix_ttft"]
        print(
            f"{mode}: accuracy {summary[f'{key}_accuracy']:.3f} vs full prefill "
            f"{summary['cache_off_accuracy']:.3f}; TTFT cache off / {mode} {mid:.2f}x median "
            f"({lo:.2f}-{hi:.2f}), prefix cache / {mode} {pmid:.2f}x ({plo:.2f}-{phi:.2f})"
        )
    for weights, line in summary["weights_comparison"].items():
        flips = {k: ", ".join(f"Q{i}" for i in line[k]) or "none" for k in line if "_to_" in k}
        same = line["same_tokens_as_reference"]
        print(
            f"{weights} vs {summary['weights']} (prefix cache): {same}/{n} "
            f"answers equal token for token; accuracy {line['accuracy']:.3f} vs {accuracy:.3f}; "
            f"right->wrong {flips['right_to_wrong']}; wrong->right {flips['wrong_to_right']}"
        )


def _print_answers(i: int, item: QaQuestion, records: dict[str, ModeRecord]) -> None:
    """Question ``i``'s answer in every mode, as soon as it has them (a long run shows progress)."""
    print(f"Q{i + 1}: {item.question}  [accepted: {' | '.join(item.answers)}]")
    width = max(map(len, records))
    for mode, record in records.items():
        mark = "ok " if record.correct[i] else "   "
        ttft = f"{1e3 * record.ttft_s[i]:.0f} ms"
        print(f"  {mark}{mode:{width}s} {ttft:>9s} {record.answers[i]!r}", flush=True)
