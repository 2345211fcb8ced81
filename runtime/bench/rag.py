"""``agentcache bench rag``: RAG prompts whose documents recur in any order (chunk reuse).

Figure 1 (W1-shaped random model, token ids): a pool of documents; each request is a head, four
documents drawn at random in random order (each followed by a separator) and a fresh question.
Mean TTFT of the same requests with no cache, prefix cache only, blend mode and exact mode,
interleaved request by request in one run, after a warm-up that put every document in the chunk
store (steady state: documents recur). Figure 2 (the bundled ``tiny`` model, or ``--model``):
blend mode's quality at recompute fractions 0/5/15/30% against the plain causal prefill: mean
KL divergence of the next-token distribution and greedy top-1 agreement over the generated
tokens; and exact mode's largest logit difference against a forward under the block mask.
A script, never a timed test.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import random
import statistics
from typing import Any

import torch

from runtime.bench._common import add_common_options, bench_engine, restores_torch_threads, w1_model
from runtime.bench._figures import Spread, noise_warnings, print_tables, spread_table
from runtime.chunks.assembler import masked_prefill_logits
from runtime.chunks.spans import ChunkReuse
from runtime.engine import Engine
from runtime.outputs import Completion
from runtime.sampling.params import SamplingParams
from runtime.serve.argtypes import positive_int

__all__ = ["SEP", "chunk_plan", "main", "rag_request", "random_ids"]

HELP = """\
RAG workload with documents reused in any order: mean TTFT for no cache, prefix cache only,
blend mode and exact mode in one run (W1-shaped random model), and blend mode's quality
(KL divergence, greedy top-1 agreement) at several recompute fractions on a real model."""

MODES = ("no cache", "prefix only", "blend", "exact")
SEP = 13
"""Separator token id after each document (any id: the W1 model has random weights)."""


def random_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` token ids drawn by ``rng`` (ordinary vocabulary ids of the W1 model)."""
    return [rng.randrange(100, 40000) for _ in range(n)]


def rag_request(
    rng: random.Random, docs: list[list[int]], head: list[int], num_docs: int, question_len: int
) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """Token ids of ``head`` + ``num_docs`` of ``docs`` drawn by ``rng`` in random order (each
    followed by ``SEP``) + a fresh random question of ``question_len`` tokens; and the spans
    ``(start, end)`` of the documents in those ids (end exclusive), for ``ChunkReuse``."""
    ids, spans = list(head), []
    for k in rng.sample(range(len(docs)), num_docs):
        spans.append((len(ids), len(ids) + len(docs[k])))
        ids += docs[k] + [SEP]
    return ids + random_ids(rng, question_len), tuple(spans)


def chunk_plan(mode: str, spans: tuple[tuple[int, int], ...], fraction: float) -> ChunkReuse | None:
    """``ChunkReuse`` over ``spans`` for ``mode`` ``"exact"`` or ``"blend"`` (recomputing
    ``fraction`` of the span tokens); None for any other mode (no chunk reuse)."""
    if mode == "blend":
        return ChunkReuse(spans, "blend", fraction)
    return ChunkReuse(spans, "exact") if mode == "exact" else None


def _ttft(eng: Engine, ids: list[int], mode: str, plan: ChunkReuse | None) -> Completion:
    req = eng.make_request(
        ids,
        SamplingParams(max_tokens=1, ignore_eos=True),
        use_prefix_cache=mode != "no cache",
        chunk_reuse=plan,
    )
    completion = list(eng.run(req))[-1].completion
    assert completion is not None, "a finished request has a completion"
    return completion


def _figure_ttft(args: argparse.Namespace) -> tuple[dict[str, Any], list[Spread]]:
    rng = random.Random(0)
    docs = [random_ids(rng, args.doc_len) for _ in range(args.num_docs)]
    head = random_ids(rng, args.head_len)
    eng = bench_engine(w1_model(args), kv_bytes=1 << 30)
    for doc in docs:  # NOTE: warm-up: every document once in the chunk store
        ids, spans = rag_request(rng, [doc], head, 1, args.question_len)
        _ttft(eng, ids, "exact", chunk_plan("exact", spans, 0.0))
    done: dict[str, list[Completion]] = {mode: [] for mode in MODES}
    for i in range(args.requests):
        ids, spans = rag_request(rng, docs, head, args.docs_per_request, args.question_len)
        order = MODES[i % 4 :] + MODES[: i % 4]  # NOTE: rotate so no mode always goes first
        for mode in order:
            done[mode].append(_ttft(eng, ids, mode, chunk_plan(mode, spans, args.fraction)))
    eng.check_integrity()
    store = eng.cache_stats().chunk_store
    eng.close()
    times = {mode: [c.metrics.ttft_s for c in done[mode]] for mode in MODES}
    out: dict[str, Any] = {"prompt_tokens": len(ids)}
    out["chunk_store"] = None if store is None else dataclasses.asdict(store)
    for mode in MODES:
        key = mode.replace(" ", "_")
        out[f"{key}_ttft_ms_mean"] = 1e3 * statistics.fmean(times[mode])
        out.update({f"{key}_{name}_mean": value for name, value in _usage_means(done[mode])})
    for mode in ("blend", "exact"):
        key = mode.replace(" ", "_")
        out[f"prefix_only_over_{key}"] = (
            out["prefix_only_ttft_ms_mean"] / out[f"{key}_ttft_ms_mean"]
        )
    spreads = [Spread.ms(f"TTFT, {m}", times[m]) for m in MODES]
    ratios = [
        Spread(f"prefix only / {m}", "x",
               tuple(p / t for p, t in zip(times["prefix only"], times[m], strict=True)))
        for m in ("blend", "exact")
    ]  # fmt: skip
    return out, [*spreads, *ratios]


def _usage_means(done: list[Completion]) -> list[tuple[str, float]]:
    """Mean tokens per request: prefix-cached, chunk-store reused/recomputed/missed, and
    ``reused_tokens`` (cached + chunk-reused, the tokens not computed)."""
    chunks = [c.usage.chunk_reuse for c in done]
    cached = [c.usage.cached_tokens for c in done]
    reused = [0 if u is None else u.reused_tokens for u in chunks]
    return [
        ("cached_tokens", statistics.fmean(cached)),
        ("chunk_reused_tokens", statistics.fmean(reused)),
        ("chunk_recomputed_tokens", statistics.fmean(0 if u is None else u.recomputed_tokens
                                                     for u in chunks)),
        ("chunk_missed_tokens", statistics.fmean(0 if u is None else u.missed_tokens
                                                 for u in chunks)),
        ("reused_tokens", statistics.fmean(c + r for c, r in zip(cached, reused, strict=True))),
    ]  # fmt: skip


def _doc_texts(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    """``args.quality_docs`` documents of about ``args.doc_len`` tokens: stdlib docstrings."""
    import collections
    import json as json_mod
    import pathlib
    import string
    import textwrap

    docs = []
    for module in (json_mod, pathlib, collections, string, textwrap, inspect, random, math):
        for _, obj in inspect.getmembers(module):
            text = inspect.getdoc(obj) or ""
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= args.doc_len // 2:
                docs.append(ids[: args.doc_len])
    return docs[: args.quality_docs]


def _kl_and_agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || got) in nats per step and the share of steps whose argmax agrees."""
    logp, logq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).float()
    return float(kl.mean()), float(agree.mean())


Prompt = tuple[list[int], tuple[tuple[int, int], ...]]


def _quality_prompt(
    eng: Engine, docs: list[list[int]], rng: random.Random, args: argparse.Namespace
) -> Prompt:
    head = eng.tokenize("Answer from the documents.\n")
    sep = eng.tokenize("\n\n")
    ids, spans = list(head), []
    for k in rng.sample(range(len(docs)), min(args.docs_per_request, len(docs))):
        spans.append((len(ids), len(ids) + len(docs[k])))
        ids += docs[k] + sep
    return ids + eng.tokenize("Question: what does the first document describe?\n"), tuple(spans)


def _quality_row(eng: Engine, prompts: list[Any], plan_of: Any, gen: int) -> tuple[float, float]:
    """Mean KL and top-1 agreement of ``plan_of(spans)`` vs the causal prefill over prompts."""
    kls, agrees = [], []
    for ids, spans in prompts:
        params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
        req = eng.make_request(ids, params, record_logits=True, chunk_reuse=plan_of(spans))
        done = list(eng.run(req))[-1].completion
        assert done is not None and req.logits_log is not None
        full = ids + done.token_ids[:-1]
        with torch.no_grad():
            ref = eng.runner.model(torch.tensor([full])).logits[0, len(ids) - 1 :]
        kl, agree = _kl_and_agreement(ref, torch.stack(req.logits_log))
        kls.append(kl)
        agrees.append(agree)
    return statistics.fmean(kls), statistics.fmean(agrees)


def _figure_quality(args: argparse.Namespace) -> dict[str, Any]:
    eng = Engine.from_pretrained(args.model, kv_cache_bytes=64 << 20)
    docs = _doc_texts(eng.tokenizer, args)
    rng = random.Random(1)
    prompts = [_quality_prompt(eng, docs, rng, args) for _ in range(args.quality_prompts)]
    out: dict[str, Any] = {"quality_model": args.model, "quality_prompts": len(prompts)}
    for pct in args.fractions:
        kl, agree = _quality_row(eng, prompts, lambda s, f=pct / 100: ChunkReuse(s, "blend", f),
                                 args.gen_tokens)  # fmt: skip
        out[f"blend_{pct}pct_kl"], out[f"blend_{pct}pct_top1"] = kl, agree
    kl, agree = _quality_row(eng, prompts, lambda s: ChunkReuse(s, "exact"), args.gen_tokens)
    out["exact_vs_causal_kl"], out["exact_vs_causal_top1"] = kl, agree
    worst = 0.0
    for ids, spans in prompts:  # exact mode against its own reference: the block-masked forward
        req = eng.make_request(ids, SamplingParams(max_tokens=1), record_logits=True,
                               chunk_reuse=ChunkReuse(spans, "exact"))  # fmt: skip
        list(eng.run(req))
        assert req.logits_log is not None
        ref = masked_prefill_logits(eng.runner.model, ids, spans)[-1]
        worst = max(worst, float((ref - req.logits_log[0]).abs().max()))
    out["exact_vs_masked_max_logit_diff"] = worst
    eng.close()
    return out


def _print_quality(q: dict[str, Any], args: argparse.Namespace) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"quality vs the causal prefill ({q['quality_model']}, "
                  f"{q['quality_prompts']} prompts x {args.gen_tokens} greedy tokens)",
                  box=box.SIMPLE_HEAD, title_justify="left")  # fmt: skip
    for col in ("mode", "recompute", "mean KL (nats)", "top-1 agreement"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for pct in args.fractions:
        table.add_row("blend", f"{pct}%", f"{q[f'blend_{pct}pct_kl']:.4f}",
                      f"{100 * q[f'blend_{pct}pct_top1']:.1f}%")  # fmt: skip
    table.add_row("exact (block mask)", "0%", f"{q['exact_vs_causal_kl']:.4f}",
                  f"{100 * q['exact_vs_causal_top1']:.1f}%")  # fmt: skip
    Console(highlight=False).print(table)
    print(f"exact mode vs a forward under the block mask: max |logit diff| "
          f"{q['exact_vs_masked_max_logit_diff']:.2e}")  # fmt: skip


@restores_torch_threads
def main(argv: list[str]) -> int:
    """``agentcache bench rag``: TTFT per mode (W1) and blend quality (tiny)."""
    p = argparse.ArgumentParser(prog="agentcache bench rag", description=HELP)
    add_common_options(p, layers=8, repeats=1)
    p.add_argument("--num-docs", type=positive_int, default=20, help="documents in the pool")
    p.add_argument("--doc-len", type=positive_int, default=300, help="tokens per document")
    p.add_argument("--docs-per-request", type=positive_int, default=4)
    p.add_argument("--head-len", type=positive_int, default=32, help="system tokens before docs")
    p.add_argument("--question-len", type=positive_int, default=16, help="fresh tokens at end")
    p.add_argument("--requests", type=positive_int, default=8, help="measured requests per mode")
    p.add_argument("--fraction", type=float, default=0.15, help="blend recompute fraction (TTFT)")
    p.add_argument("--model", default="tiny", help="model of the quality figure")
    p.add_argument("--fractions", type=int, nargs="+", default=[0, 5, 15, 30],
                   help="blend recompute percentages of the quality figure")  # fmt: skip
    p.add_argument("--quality-prompts", type=positive_int, default=8)
    p.add_argument("--quality-docs", type=positive_int, default=20)
    p.add_argument("--gen-tokens", type=positive_int, default=64, help="greedy tokens (quality)")
    p.add_argument("--skip-ttft", action="store_true", help="only the quality figure")
    p.add_argument("--skip-quality", action="store_true", help="only the TTFT figure")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"layers": args.layers, "dtype": args.dtype}
    tables, warnings = [], []
    if not args.skip_ttft:
        ttft, spreads = _figure_ttft(args)
        result.update(ttft)
        title = (f"TTFT per request ({ttft['prompt_tokens']} prompt tokens, {args.num_docs} docs "
                 f"x {args.doc_len} tokens, {args.docs_per_request} per request, W1 "
                 f"{args.layers} layers, blend {100 * args.fraction:.0f}%)")  # fmt: skip
        tables.append(spread_table(title, spreads))
        warnings = noise_warnings(spreads[:4], spreads[4:])
        result["spread"] = {s.name: s.as_json() for s in spreads}
    if tables:
        print_tables(tables, warnings)
        for mode in MODES:
            key = mode.replace(" ", "_")
            print(f"mean TTFT {mode:12s} {result[f'{key}_ttft_ms_mean']:9.2f} ms   "
                  f"prefix-cached {result[f'{key}_cached_tokens_mean']:.0f}, chunk-reused "
                  f"{result[f'{key}_chunk_reused_tokens_mean']:.0f} tokens")  # fmt: skip
        print(f"prefix only / exact: {result['prefix_only_over_exact']:.2f}x   "
              f"prefix only / blend: {result['prefix_only_over_blend']:.2f}x (means)")  # fmt: skip
    if not args.skip_quality:
        quality = _figure_quality(args)
        result.update(quality)
        _print_quality(quality, args)
    result["warnings"] = warnings
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0
