"""Chunk reuse (issue 17): document chunks' KV from the chunk store, in any order.

Exact mode equals one transformers forward under the block attention mask (logits within 1e-4,
fp32, at every generated step) on Llama and Qwen2, on both forward paths, whether the chunks
missed or hit the store and in whatever order they come; blend mode at 100% recompute equals the
plain causal prefill; models whose keys cannot be moved refuse with the reason; bad spans fail
the request alone; the prefix cache keeps assembled KV in each mode's own namespace, keyed by
ids that spell the spans, so a later turn hits it and a plain request never does.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from runtime.cache.radix_cache import Namespace
from runtime.chunks.assembler import block_attention_mask, masked_prefill_logits
from runtime.chunks.spans import ChunkReuse
from runtime.engine import Engine
from runtime.exceptions import InvalidRequestError
from runtime.outputs import Completion
from runtime.sampling.params import SamplingParams
from tests.conftest import VOCAB_SIZE, save_tiny_model

TOL = 1e-4
HEAD = [(5 * i + 3) % (VOCAB_SIZE - 3) + 3 for i in range(9)]
DOCS = [[(k * 11 + 7 * i) % (VOCAB_SIZE - 3) + 3 for i in range(n)] for k, n in
        ((1, 13), (2, 17), (3, 10))]  # fmt: skip
SEP = [4]
QUESTION = [9, 10, 11, 12, 13]


def rag_prompt(order: list[int]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """HEAD, then the DOCS in ``order`` each followed by SEP, then QUESTION; and the doc spans."""
    ids, spans = list(HEAD), []
    for k in order:
        spans.append((len(ids), len(ids) + len(DOCS[k])))
        ids += DOCS[k] + SEP
    return ids + QUESTION, tuple(spans)


def make_engine(arch: str, folder: Path, forward: str = "auto") -> Engine:
    path = save_tiny_model(arch, folder)
    return Engine.from_pretrained(
        str(path), kv_cache_bytes=1 << 20, block_size=4, chunk_cache_bytes=1 << 20,
        forward=forward,
    )  # fmt: skip


@pytest.fixture(scope="module", params=[("llama", "auto"), ("qwen2", "auto"),
                                        ("llama", "transformers")])  # fmt: skip
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    arch, forward = request.param
    return make_engine(arch, Path(tmp_path_factory.mktemp(arch)), forward)


def run(
    engine: Engine, ids: list[int], plan: ChunkReuse | None, n: int = 4
) -> tuple[Completion, list[torch.Tensor]]:
    req = engine.make_request(
        ids, SamplingParams(ignore_eos=True, max_tokens=n), record_logits=True, chunk_reuse=plan
    )
    completion = list(engine.run(req))[-1].completion
    assert completion is not None and req.logits_log is not None
    return completion, req.logits_log


def assert_logits_close(want: torch.Tensor, got: torch.Tensor, step: int) -> None:
    diff = (want - got).abs().max().item()
    assert diff <= TOL, f"step {step}: logits differ by {diff:.2e}"


def assert_masked_steps(
    engine: Engine, ids: list[int], spans: tuple[tuple[int, int], ...], completion: Completion,
    logits: list[torch.Tensor],
) -> None:  # fmt: skip
    """Every step's logits equal one forward under the block mask over the prompt and the tokens
    generated so far (generated tokens lie outside every span: they attend to everything)."""
    for step, got in enumerate(logits):
        full = ids + completion.token_ids[:step]
        want = masked_prefill_logits(engine.runner.model, full, spans)[-1]
        assert_logits_close(want, got, step)


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0]])
def test_exact_mode_equals_masked_full_prefill(engine: Engine, order: list[int]) -> None:
    ids, spans = rag_prompt(order)
    completion, logits = run(engine, ids, ChunkReuse(spans, "exact"))
    assert_masked_steps(engine, ids, spans, completion, logits)
    engine.check_integrity()


def test_exact_mode_reuses_stored_chunks_in_another_order(engine: Engine) -> None:
    engine.flush_cache()
    first_ids, first_spans = rag_prompt([0, 1, 2])
    first, _ = run(engine, first_ids, ChunkReuse(first_spans, "exact"), n=1)
    num_span = sum(len(d) for d in DOCS)
    assert first.usage.chunk_reuse is not None
    assert first.usage.chunk_reuse.missed_tokens == num_span
    ids, spans = rag_prompt([2, 1, 0])
    completion, logits = run(engine, ids, ChunkReuse(spans, "exact"), n=1)
    usage = completion.usage
    assert usage.chunk_reuse is not None and usage.chunk_reuse.mode == "exact"
    assert (usage.chunk_reuse.reused_tokens, usage.chunk_reuse.missed_tokens) == (num_span, 0)
    assert usage.chunk_reuse.recomputed_tokens == 0
    # The head came from the prefix cache (whole blocks of 4, never the chunks).
    assert usage.cached_tokens == 8
    assert completion.metrics.prefill_tokens_computed == len(ids) - 8 - num_span
    want = masked_prefill_logits(engine.runner.model, ids, spans)[-1]
    assert_logits_close(want, logits[0], 0)
    engine.check_integrity()


def test_a_later_turn_hits_the_assembled_prompt_in_the_prefix_cache(engine: Engine) -> None:
    """Turn 2 repeats turn 1 (same chunks at the same places) and adds to it: the prefix cache
    serves the assembled opening, documents included, and the answer is still exact."""
    engine.flush_cache()
    ids, spans = rag_prompt([1, 0, 2])
    first, _ = run(engine, ids, ChunkReuse(spans, "exact"), n=3)
    later = ids + first.token_ids + QUESTION
    completion, logits = run(engine, later, ChunkReuse(spans, "exact"), n=2)
    usage = completion.usage
    assert usage.chunk_reuse is not None
    assert usage.cached_tokens >= spans[-1][1]  # every chunk came from the prefix cache
    assert usage.cached_tokens == (len(ids) + len(first.token_ids) - 1) // 4 * 4
    assert (usage.chunk_reuse.reused_tokens, usage.chunk_reuse.missed_tokens) == (0, 0)
    assert_masked_steps(engine, later, spans, completion, logits)
    engine.check_integrity()


def test_a_hit_ending_inside_a_changed_chunk_keeps_it_and_places_the_tail(engine: Engine) -> None:
    """The same opening up to a chunk whose end differs: the hit ends inside that chunk and is
    kept (its KV there depends only on the chunk's tokens so far); the chunk's tail is placed
    from the chunk (another one, computed alone), and the answer is exact."""
    engine.flush_cache()
    ids, spans = rag_prompt([0, 1, 2])
    run(engine, ids, ChunkReuse(spans, "exact"), n=1)
    changed = list(ids)
    second_start, second_end = spans[1]
    changed[second_end - 2] = changed[second_end - 2] % (VOCAB_SIZE - 4) + 3  # inside chunk 2
    assert changed != ids
    completion, logits = run(engine, changed, ChunkReuse(spans, "exact"), n=1)
    usage = completion.usage
    assert usage.chunk_reuse is not None
    assert usage.cached_tokens == (second_end - 2) // 4 * 4  # the block-aligned hit: 36
    assert second_start < usage.cached_tokens < second_end
    assert usage.chunk_reuse.missed_tokens == second_end - usage.cached_tokens
    assert usage.chunk_reuse.reused_tokens == spans[2][1] - spans[2][0]
    want = masked_prefill_logits(engine.runner.model, changed, spans)[-1]
    assert_logits_close(want, logits[0], 0)
    engine.check_integrity()


def test_a_hit_ending_inside_a_stored_chunk_places_its_tail(engine: Engine) -> None:
    """Only what follows the last chunk changes: the hit ends inside the last chunk, whose tail
    comes from the chunk store (slice of the stored chunk, rotated by the chunk's start)."""
    engine.flush_cache()
    ids, spans = rag_prompt([2, 0, 1])
    run(engine, ids, ChunkReuse(spans, "exact"), n=1)
    last_start, last_end = spans[-1]
    changed = ids[:last_end] + [5] + ids[last_end + 1 :]  # another separator after it
    assert changed != ids and last_end % 4
    completion, logits = run(engine, changed, ChunkReuse(spans, "exact"), n=2)
    usage = completion.usage
    assert usage.chunk_reuse is not None
    assert last_start < usage.cached_tokens == last_end // 4 * 4 < last_end
    assert (usage.chunk_reuse.reused_tokens, usage.chunk_reuse.missed_tokens) == (
        last_end - usage.cached_tokens,
        0,
    )
    assert_masked_steps(engine, changed, spans, completion, logits)
    engine.check_integrity()


def test_cache_ids_spell_the_spans() -> None:
    plan = ChunkReuse(((1, 3), (3, 5)), "exact")
    key = plan.cache_ids([7, 7, 7, 7, 7, 7])
    assert len(set(key)) == 3 and key[0] == key[5] == 7  # outside, start, inside: three kinds
    assert key[1] == key[3] != key[2] == key[4]
    other = ChunkReuse(((1, 5),), "exact")  # the same tokens as one chunk: another key
    assert other.cache_ids([7] * 6)[:5] != key[:5] and other.cache_ids([7] * 6)[:3] == key[:3]
    blend = ChunkReuse(((1, 3),), "blend", 0.15)
    namespaces = {plan.cache_namespace(Namespace("n")), blend.cache_namespace(Namespace("n")),
                  ChunkReuse(((1, 3),), "blend", 0.3).cache_namespace(Namespace("n"))}  # fmt: skip
    assert len(namespaces) == 3 and Namespace("n") not in namespaces
    assert [plan.spans_from(n) for n in (0, 1, 2, 3, 4, 5)] == [
        ((1, 3), (3, 5)), ((1, 3), (3, 5)), ((2, 3), (3, 5)), ((3, 5),), ((4, 5),), (),
    ]  # fmt: skip


def test_masked_prefill_differs_from_causal(engine: Engine) -> None:
    """The exactness tests can fail: the block mask changes the answer of a random model."""
    ids, spans = rag_prompt([0, 1, 2])
    masked = masked_prefill_logits(engine.runner.model, ids, spans)[-1]
    with torch.no_grad():
        causal = engine.runner.model(torch.tensor([ids])).logits[0, -1]
    assert (masked - causal).abs().max().item() > 100 * TOL


def test_prefix_cache_never_stores_chunk_kv(engine: Engine) -> None:
    engine.flush_cache()
    ids, spans = rag_prompt([1, 0, 2])
    run(engine, ids, ChunkReuse(spans, "exact"), n=3)
    plain, plain_logits = run(engine, ids, None)
    assert plain.usage.cached_tokens <= spans[0][0] and plain.usage.chunk_reuse is None
    with torch.no_grad():
        want = engine.runner.model(torch.tensor([ids])).logits[0, -1]
    assert_logits_close(want, plain_logits[0], 0)
    engine.check_integrity()


def test_block_attention_mask_shape() -> None:
    mask = block_attention_mask(7, [(1, 3), (3, 5)])
    assert mask[2].tolist() == [False, True, True, False, False, False, False]
    assert mask[4].tolist() == [False, False, False, True, True, False, False]
    assert mask[5].tolist() == [True] * 6 + [False]  # after the chunks: everything before
    assert mask[0].tolist() == [True] + [False] * 6


# --- blend mode ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def compact(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return make_engine(request.param, Path(tmp_path_factory.mktemp(request.param)))


def test_blend_full_recompute_equals_causal_prefill(compact: Engine) -> None:
    compact.flush_cache()
    cold_ids, cold_spans = rag_prompt([0, 1, 2])
    cold, _ = run(compact, cold_ids, ChunkReuse(cold_spans, "blend", 1.0), n=1)
    num_span = sum(len(d) for d in DOCS)
    # Each span token counted once: computed on a store miss (then recomputed, still "missed").
    assert cold.usage.chunk_reuse is not None
    assert (cold.usage.chunk_reuse.missed_tokens, cold.usage.chunk_reuse.recomputed_tokens) == (
        num_span,
        0,
    )
    ids, spans = rag_prompt([2, 0, 1])  # NOTE: another first chunk: the prefix cache has the head
    completion, logits = run(compact, ids, ChunkReuse(spans, "blend", 1.0))
    assert completion.usage.cached_tokens == 8
    for step, got in enumerate(logits):
        full = ids + completion.token_ids[:step]
        with torch.no_grad():
            want = compact.runner.model(torch.tensor([full])).logits[0, -1]
        assert_logits_close(want, got, step)
    usage = completion.usage.chunk_reuse
    num_span = sum(len(d) for d in DOCS)
    assert usage is not None and usage.mode == "blend"
    assert (usage.recomputed_tokens, usage.reused_tokens) == (num_span, 0)
    compact.check_integrity()


def test_blend_places_the_tail_of_a_chunk_a_hit_ends_inside(compact: Engine) -> None:
    """At 100% recompute the cached opening is causal KV and every row after it is recomputed:
    a hit ending inside a changed chunk still gives the causal prefill."""
    compact.flush_cache()
    ids, spans = rag_prompt([0, 1, 2])
    run(compact, ids, ChunkReuse(spans, "blend", 1.0), n=1)
    changed = list(ids)
    changed[spans[1][1] - 2] = changed[spans[1][1] - 2] % (VOCAB_SIZE - 4) + 3  # inside chunk 2
    completion, logits = run(compact, changed, ChunkReuse(spans, "blend", 1.0), n=2)
    usage = completion.usage
    assert usage.chunk_reuse is not None and spans[1][0] < usage.cached_tokens < spans[1][1]
    num_tail = spans[1][1] - usage.cached_tokens
    assert (usage.chunk_reuse.missed_tokens, usage.chunk_reuse.recomputed_tokens) == (
        num_tail,
        spans[2][1] - spans[2][0],
    )
    for step, got in enumerate(logits):
        with torch.no_grad():
            want = compact.runner.model(torch.tensor([changed + completion.token_ids[:step]]))
        assert_logits_close(want.logits[0, -1], got, step)
    compact.check_integrity()


@pytest.mark.parametrize("fraction", [0.0, 0.15, 0.5])
def test_blend_recomputes_the_asked_fraction(compact: Engine, fraction: float) -> None:
    ids, spans = rag_prompt([0, 2, 1])
    run(compact, ids, ChunkReuse(spans, "exact"), n=1)
    completion, logits = run(compact, ids, ChunkReuse(spans, "blend", fraction), n=1)
    num_span = sum(len(d) for d in DOCS)
    usage = completion.usage.chunk_reuse
    assert usage is not None
    assert usage.recomputed_tokens == math.ceil(fraction * num_span)
    assert usage.reused_tokens + usage.recomputed_tokens == num_span
    with torch.no_grad():
        causal = compact.runner.model(torch.tensor([ids])).logits[0, -1]
    # Approximate: not the causal answer (a random model's chunks attend across a lot).
    assert (causal - logits[0]).abs().max().item() > TOL


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "why"), [("gpt2", "no rotary position embedding"),
                                           ("mistral_sliding", "sliding_window")])  # fmt: skip
def test_models_that_cannot_move_keys_refuse(arch: str, why: str, tmp_path: Path) -> None:
    eng = make_engine(arch, tmp_path)
    ids, spans = rag_prompt([0, 1])
    for mode in ("exact", "blend"):
        with pytest.raises(InvalidRequestError, match=why):
            eng.make_request(ids, chunk_reuse=ChunkReuse(spans, mode))
    assert eng.generate(ids, SamplingParams(max_tokens=2)).usage.chunk_reuse is None
    eng.close()


def test_blend_needs_the_compact_forward(tmp_path: Path) -> None:
    eng = make_engine("llama", tmp_path, "transformers")
    ids, spans = rag_prompt([0, 1])
    with pytest.raises(InvalidRequestError, match="compact forward"):
        eng.make_request(ids, chunk_reuse=ChunkReuse(spans, "blend"))
    eng.close()


@pytest.mark.parametrize(
    ("spans", "match"),
    [
        (((3, 8), (6, 10)), "sorted and disjoint"),
        (((6, 10), (3, 5)), "sorted and disjoint"),
        (((3, 3),), "non-empty"),
        (((-1, 3),), "non-empty|sorted"),
        ((), "at least one span"),
        (((3, 8.0),), "integers"),
    ],
)
def test_bad_spans_are_refused(spans: tuple[tuple[int, int], ...], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        ChunkReuse(spans)


def test_bad_plans_fail_alone(compact: Engine) -> None:
    ids, _ = rag_prompt([0])
    for plan, match in [
        (ChunkReuse(((3, len(ids)),)), "before the last prompt token"),
        (ChunkReuse(((3, len(ids) + 5),)), "before the last prompt token"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            compact.make_request(ids, chunk_reuse=plan)
    with pytest.raises(InvalidRequestError, match="recompute_fraction"):
        ChunkReuse(((1, 3),), "blend", 1.5)
    with pytest.raises(InvalidRequestError, match="mode"):
        ChunkReuse(((1, 3),), "fuzzy")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        compact.make_request(ids, SamplingParams(prompt_logprobs=1),
                             chunk_reuse=ChunkReuse(((3, 8),)))  # fmt: skip
    assert compact.generate(ids, SamplingParams(max_tokens=2)).usage.completion_tokens == 2
    compact.check_integrity()


def test_chunks_can_start_at_zero_and_n_choices_share_usage(compact: Engine) -> None:
    ids = DOCS[0] + SEP + DOCS[1] + QUESTION
    spans = ((0, len(DOCS[0])), (len(DOCS[0]) + 1, len(DOCS[0]) + 1 + len(DOCS[1])))
    streams = compact.stream_choices(ids, SamplingParams(max_tokens=2, seed=1), n=2)
    assert all(list(s)[-1].completion is not None for s in streams)
    req = compact.make_request(ids, SamplingParams(max_tokens=2, seed=1), n=2,
                               chunk_reuse=ChunkReuse(spans), record_logits=True)  # fmt: skip
    outs = [list(s)[-1].completion for s in compact.run_choices(req)]
    assert all(c is not None and c.usage.chunk_reuse is not None for c in outs)
    assert req.logits_log is not None
    want = masked_prefill_logits(compact.runner.model, ids, spans)[-1]
    assert_logits_close(want, req.logits_log[0], 0)
    compact.check_integrity()


def test_flush_cache_drops_stored_chunks(compact: Engine) -> None:
    ids, spans = rag_prompt([0, 1])
    run(compact, ids, ChunkReuse(spans), n=1)
    assert compact.chunk_store.num_entries >= 2
    compact.flush_cache()
    assert compact.chunk_store.num_entries == 0
    again, _ = run(compact, ids, ChunkReuse(spans), n=1)
    assert again.usage.chunk_reuse is not None
    assert again.usage.chunk_reuse.missed_tokens == len(DOCS[0]) + len(DOCS[1])
    compact.check_integrity()


def test_chunks_spill_to_the_disk_tier_and_come_back_exact_after_a_restart(
    tmp_path: Path,
) -> None:
    """With ``kv_disk_dir`` a flushed (or evicted) chunk is loaded back from disk, in another
    order and by another engine process on the same directory, and stays exact."""
    path = str(save_tiny_model("llama", tmp_path / "model"))
    disk = str(tmp_path / "kv")
    first = Engine.from_pretrained(path, kv_cache_bytes=1 << 20, block_size=4,
                                   chunk_cache_bytes=1 << 20, kv_disk_dir=disk)  # fmt: skip
    ids, spans = rag_prompt([0, 1, 2])
    run(first, ids, ChunkReuse(spans, "exact"), n=1)
    first.flush_cache()  # every chunk and prefix block spills
    first.drain_disk()
    assert first.chunk_store.num_entries == 0
    first.close()
    engine = Engine.from_pretrained(path, kv_cache_bytes=1 << 20, block_size=4,
                                    chunk_cache_bytes=1 << 20, kv_disk_dir=disk)  # fmt: skip
    ids, spans = rag_prompt([2, 0, 1])
    completion, logits = run(engine, ids, ChunkReuse(spans, "exact"), n=3)
    usage = completion.usage.chunk_reuse
    assert usage is not None and (usage.reused_tokens, usage.missed_tokens) == (
        sum(len(d) for d in DOCS),
        0,
    )
    assert engine.chunk_store.num_disk_hits == len(DOCS)
    assert_masked_steps(engine, ids, spans, completion, logits)
    engine.check_integrity()
    engine.close()
