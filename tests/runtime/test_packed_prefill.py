"""Packed prefill (several requests' prompts in one forward) never changes the answer.

Requests arriving together are prefilled in one packed forward on the compact path; on the
transformers path (gpt2, sliding-window Mistral) each still runs alone. Either way every step's
logits agree within 1e-4 (fp32) with the same prompts prefilled one request at a time, greedy
tokens match except at near-ties, a request that would hit another's prompt once stored waits
for it, and a request that fails or is cancelled in a packed group ends alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.engine import Engine
from runtime.model.compact_llama import Segment
from runtime.model.kv_cache import RequestKVCache
from runtime.request.state import Request
from runtime.sampling.params import SamplingParams
from runtime.scheduler.loop import SchedulerConfig
from tests.conftest import ARCHS, VOCAB_SIZE, make_config, make_tokenizer, save_tiny_model
from tests.runtime.test_engine_exactness import TOL, assert_same_answer
from tests.runtime.test_scheduler import completion_of


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * i + 5 * seed + 1) % (VOCAB_SIZE - 3) + 3 for i in range(n)]


PROMPTS = [tokens(9, 7), tokens(3, 11), tokens(26, 5), tokens(1, 3), tokens(14, 13)]
LONG = tokens(43, 17)
Chunks = Sequence[tuple[list[int], RequestKVCache]]


def make_engine(path: Path, *, batch: int, chunk: int = 4096) -> Engine:
    config = SchedulerConfig(prefill_chunk_tokens=chunk, max_prefill_batch=batch)
    return Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4, scheduler=config)


@pytest.fixture(scope="module", params=ARCHS)
def path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def engines(path: Path) -> Iterator[tuple[Engine, Engine]]:
    solo, packed = make_engine(path, batch=1), make_engine(path, batch=16)
    yield solo, packed
    solo.close()
    packed.close()


def request(engine: Engine, ids: list[int], n: int = 6, *, use_cache: bool = False) -> Request:
    params = SamplingParams(ignore_eos=True, max_tokens=n)
    return engine.make_request(ids, params, use_prefix_cache=use_cache, record_logits=True)


def burst(engine: Engine, reqs: list[Request]) -> list[Request]:
    """Submit ``reqs`` at once (one admission sees them all) and wait for every choice."""
    engine.scheduler.submit_all(reqs)
    members = [m for r in reqs for m in (r, *r.forks)]
    for member in members:
        completion_of(member)
    return members


def alone(engine: Engine, ids: list[int], n: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    req = request(engine, ids, n)
    burst(engine, [req])
    assert req.logits_log is not None
    return req.output_ids, req.logits_log


def spy_packed(engine: Engine, hook: Callable[[Chunks], None] = lambda c: None) -> list[int]:
    """Record the number of chunks of every packed forward (``hook`` runs first)."""
    sizes: list[int] = []
    packed = engine.runner.forward_packed

    def spy(chunks: Chunks, **kwargs: Any) -> torch.Tensor:
        sizes.append(len(chunks))
        hook(chunks)
        return packed(chunks, **kwargs)

    engine.runner.forward_packed = spy  # type: ignore[method-assign]
    return sizes


def same(ref: tuple[list[int], list[torch.Tensor]], req: Request) -> None:
    assert req.logits_log is not None
    assert_same_answer(ref, (req.output_ids, req.logits_log))


def test_packed_forward_matches_one_by_one(path: Path) -> None:
    """Runner level: each chunk's logits and stored KV as when it runs alone (after a hit too)."""
    engine = make_engine(path, batch=16)
    check_packed_forward(engine)
    engine.close()


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with head dim 16, which the native ``segment_attention`` takes (8 in ``ARCHS``)."""
    from transformers import AutoModelForCausalLM

    config = make_config("llama")
    config.hidden_size, config.head_dim, config.intermediate_size = 64, 16, 128
    torch.manual_seed(0)
    path = Path(tmp_path_factory.mktemp("wide"))
    # NOTE: transformers leaves from_config unannotated.
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # type: ignore[no-untyped-call]
    make_tokenizer().save_pretrained(path)
    return path


def test_native_segment_attention_matches_one_by_one(wide_path: Path) -> None:
    """With native kernels a packed forward attends in one ``segment_attention`` call per layer
    (it writes the KV too): logits and KV as one request at a time, and greedy answers of a
    burst as alone."""
    engine = make_engine(wide_path, batch=16)
    compact = engine.runner.compact
    if compact is None or compact.native is None or not compact.native.is_vectorized:
        engine.close()
        pytest.skip("no vectorized native kernels here: packed prefill attends per segment")
    calls: list[int] = []
    forward = compact._forward_segments

    def spy(
        h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[Segment]
    ) -> torch.Tensor:
        calls.append(h.shape[1])
        return forward(h, cos, sin, segments)

    compact._forward_segments = spy  # type: ignore[method-assign]
    check_packed_forward(engine)
    assert calls, "the packed forward attended through segment_attention"
    solo = make_engine(wide_path, batch=1)
    refs = [alone(solo, ids) for ids in PROMPTS]
    reqs = burst(engine, [request(engine, ids) for ids in PROMPTS])
    for ref, req in zip(refs, reqs, strict=True):
        same(ref, req)
    solo.close()
    engine.close()


def check_packed_forward(engine: Engine) -> None:
    """``engine``'s packed forward of four chunks (two after a cached prefix) against each run
    alone: logits and stored KV within TOL."""
    runner = engine.runner
    starts = [0, 5, 0, 12]
    chunks = [tokens(7, 3), tokens(4, 5), tokens(1, 9), tokens(10, 13)]

    def caches() -> list[RequestKVCache]:
        out = []
        for start in starts:
            kv = runner.new_cache(32)
            if start:
                runner.forward(tokens(start, 19), kv)  # NOTE: a cached prefix before the chunk
            out.append(kv)
        return out

    if not runner.can_pack_prefill:
        with pytest.raises(ValueError, match="compact forward"):
            runner.forward_packed(list(zip(chunks, caches(), strict=True)))
        return
    solo_kv, packed_kv = caches(), caches()
    solo = torch.stack([runner.forward(c, kv) for c, kv in zip(chunks, solo_kv, strict=True)])
    packed = runner.forward_packed(list(zip(chunks, packed_kv, strict=True)))
    assert packed.shape == solo.shape == (len(chunks), VOCAB_SIZE)
    assert (packed - solo).abs().max().item() <= TOL
    for a, b in zip(solo_kv, packed_kv, strict=True):
        assert a.length == b.length
        assert (a.span(0, a.length) - b.span(0, b.length)).abs().max().item() <= TOL


def test_burst_matches_one_by_one(engines: tuple[Engine, Engine]) -> None:
    solo, packed = engines
    refs = [alone(solo, ids) for ids in PROMPTS]
    fork_head = request(solo, PROMPTS[2], n=2)
    ref_forks = burst(solo, [fork_head])
    sizes = spy_packed(packed)
    try:
        reqs = [request(packed, ids) for ids in PROMPTS]
        group = request(packed, PROMPTS[2], n=2)
        burst(packed, [*reqs, group])
    finally:
        del packed.runner.forward_packed
    for ref, req in zip(refs, reqs, strict=True):
        same(ref, req)
    for ref_req, member in zip(ref_forks, (group, *group.forks), strict=True):
        assert ref_req.output_ids == member.output_ids
    if packed.runner.can_pack_prefill:
        assert sizes == [len(PROMPTS) + 1]  # NOTE: one forward for every prompt
    else:
        assert sizes == []
    assert packed.scheduler_stats().num_blocks_pinned == 0
    packed.check_integrity()


def test_packed_with_chunks_and_a_prefix_hit(path: Path) -> None:
    """Chunked prefill (8 tokens) packs a long prompt's chunks with short prompts; its uncached
    tail after a prefix-cache hit is still answered as the whole-prompt reference."""
    ref_engine, chunked = make_engine(path, batch=1), make_engine(path, batch=16, chunk=8)
    refs = [alone(ref_engine, ids) for ids in [LONG, *PROMPTS]]
    burst(chunked, [request(chunked, LONG[:22], 1, use_cache=True)])  # store 20 positions
    sizes = spy_packed(chunked)
    reqs = [request(chunked, LONG, use_cache=True)] + [request(chunked, p) for p in PROMPTS]
    burst(chunked, reqs)
    assert reqs[0].cached_len == 20
    for ref, req in zip(refs, reqs, strict=True):
        same(ref, req)
    assert (max(sizes, default=0) > 1) == chunked.runner.can_pack_prefill
    assert chunked.scheduler_stats().num_blocks_pinned == 0
    chunked.check_integrity()
    ref_engine.close()
    chunked.close()


def test_shared_prompt_waits_for_the_stored_prefix(engines: tuple[Engine, Engine]) -> None:
    """B shares A's uncached 24-token prefix: it is not packed with A but admitted after A's
    prompt is stored, so it hits it as it would one by one; C, unrelated, packs with A."""
    _, packed = engines
    packed.flush_cache()
    prefix = tokens(24, 23)
    a, b = (
        request(packed, [*prefix, 4], use_cache=True),
        request(packed, [*prefix, 5], use_cache=True),
    )
    c = request(packed, tokens(10, 29), use_cache=True)
    sizes = spy_packed(packed)
    try:
        burst(packed, [a, b, c])
    finally:
        del packed.runner.forward_packed
    assert (a.cached_len, b.cached_len) == (0, 24)
    assert sizes == ([2] if packed.runner.can_pack_prefill else [])
    assert packed.scheduler_stats().num_blocks_pinned == 0
    packed.check_integrity()


@pytest.mark.parametrize("ending", ["fail", "cancel"])
def test_a_request_ends_alone_in_a_packed_group(
    engines: tuple[Engine, Engine], ending: str
) -> None:
    solo, packed = engines
    refs = [alone(solo, ids) for ids in PROMPTS[:3]]
    reqs = [request(packed, ids) for ids in PROMPTS[:3]]
    victim = request(packed, tokens(12, 31), use_cache=True)
    forward = packed.runner.forward

    def hook(chunks: Chunks) -> None:
        if ending == "cancel":
            packed.scheduler.cancel(victim, wait=False)
        elif any(kv is victim.kv for _, kv in chunks):
            raise RuntimeError("packed forward failed")

    def spy_forward(
        token_ids: list[int], kv: RequestKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        if ending == "fail" and kv is victim.kv:
            raise RuntimeError("forward failed")
        if ending == "cancel" and kv is victim.kv:
            packed.scheduler.cancel(victim, wait=False)
        return forward(token_ids, kv, all_logits=all_logits)

    sizes = spy_packed(packed, hook)
    packed.runner.forward = spy_forward  # type: ignore[method-assign]
    try:
        packed.scheduler.submit_all([reqs[0], victim, *reqs[1:]])
        for req in reqs:
            completion_of(req)
        if ending == "fail":
            with pytest.raises(RuntimeError, match="forward failed"):
                completion_of(victim)
        assert victim.released.wait(60)
    finally:
        del packed.runner.forward_packed, packed.runner.forward
    assert victim.is_cancelled or not victim.output_ids
    for ref, req in zip(refs, reqs, strict=True):
        same(ref, req)
    assert sizes == ([4] if packed.runner.can_pack_prefill else [])
    assert packed.scheduler_stats().num_blocks_pinned == 0
    packed.check_integrity()
