"""Chunked prefill never changes the answer, and running streams decode between the chunks.

A prompt prefilled in chunks of a few tokens (cache off, and after a prefix-cache hit) gives the
same logits (1e-4, fp32) and greedy tokens as the same engine model prefilled in one forward;
a decode step of a running request runs between two chunks of an arriving long prompt; a request
cancelled or failing mid-prefill ends alone and leaves nothing pinned.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from runtime.engine import Engine
from runtime.model.batch_kv import BatchKV
from runtime.model.kv_cache import RequestKVCache
from runtime.outputs import StreamDelta
from runtime.request.state import Request, RequestStatus
from runtime.sampling.params import SamplingParams
from runtime.scheduler.loop import SchedulerConfig
from tests.conftest import ARCHS, VOCAB_SIZE, save_tiny_model
from tests.runtime.test_engine_exactness import assert_same_answer
from tests.runtime.test_scheduler import completion_of

CHUNK = 5
LONG = [(7 * i + 5) % (VOCAB_SIZE - 3) + 3 for i in range(43)]
SHORT = [(3 * i + 2) % (VOCAB_SIZE - 3) + 3 for i in range(9)]


def make_engine(path: Path, chunk: int) -> Engine:
    config = SchedulerConfig(prefill_chunk_tokens=chunk)
    return Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4, scheduler=config)


@pytest.fixture(scope="module", params=ARCHS)
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    path = save_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param)))
    whole, chunked = make_engine(path, 4096), make_engine(path, CHUNK)
    yield whole, chunked
    whole.close()
    chunked.close()


def start(
    engine: Engine, ids: list[int], n: int, *, use_cache: bool = False
) -> tuple[Request, Iterator[StreamDelta]]:
    req = engine.make_request(
        ids,
        SamplingParams(ignore_eos=True, max_tokens=n),
        use_prefix_cache=use_cache,
        record_logits=True,
    )
    return req, engine.run(req)


def answer(engine: Engine, ids: list[int], n: int, *, use_cache: bool = False) -> tuple[
    list[int], list[torch.Tensor]
]:  # fmt: skip
    req, it = start(engine, ids, n, use_cache=use_cache)
    list(it)
    assert req.logits_log is not None
    return req.output_ids, req.logits_log


def test_chunked_matches_whole_prompt(engines: tuple[Engine, Engine]) -> None:
    whole, chunked = engines
    ref = answer(whole, LONG, 6)
    assert_same_answer(ref, answer(chunked, LONG, 6))
    # After a prefix-cache hit the uncached tail is chunked too (hit 20 of 43 positions).
    chunked.flush_cache()
    answer(chunked, LONG[:22], 1, use_cache=True)
    req, it = start(chunked, LONG, 6, use_cache=True)
    list(it)
    assert req.cached_len == 20 and req.logits_log is not None
    assert_same_answer(ref, (req.output_ids, req.logits_log))
    assert chunked.scheduler_stats().num_blocks_pinned == 0
    chunked.check_integrity()


def test_running_stream_decodes_between_chunks(engines: tuple[Engine, Engine]) -> None:
    whole, chunked = engines
    ref_short, ref_long = answer(whole, SHORT, 20), answer(whole, LONG, 4)
    events: list[str] = []
    forward, decode = chunked.runner.forward, chunked.runner.decode
    long_req = chunked.make_request(
        LONG,
        SamplingParams(ignore_eos=True, max_tokens=4),
        use_prefix_cache=False,
        record_logits=True,
    )

    def spy_forward(
        token_ids: list[int], kv: RequestKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        events.append(f"prefill {len(token_ids)}")
        return forward(token_ids, kv, all_logits=all_logits)

    def spy_decode(token_ids: Sequence[int | None], batch: BatchKV) -> torch.Tensor:
        events.append(f"decode {sum(t is not None for t in token_ids)}/{len(token_ids)}")
        if long_req.status is RequestStatus.WAITING and not long_req.t_enqueue:
            # NOTE: submitted from the loop thread, so it arrives while the short one decodes.
            chunked.scheduler.submit(long_req)
        return decode(token_ids, batch)

    chunked.runner.forward, chunked.runner.decode = spy_forward, spy_decode  # type: ignore[method-assign]
    try:
        short_req, short_it = start(chunked, SHORT, 20)
        list(short_it)
        completion_of(long_req)
    finally:
        del chunked.runner.forward, chunked.runner.decode
    first = events.index(f"prefill {CHUNK}", 2)
    # The long prompt ran in chunks of CHUNK with the short stream's decode step between them
    # (its own row idle), nothing else in between.
    assert events[first : first + 4] == [f"prefill {CHUNK}", "decode 1/2"] * 2, events
    assert sum(e.startswith("prefill") for e in events) == 2 + -(-len(LONG) // CHUNK)
    for ref, req in ((ref_short, short_req), (ref_long, long_req)):
        assert req.logits_log is not None
        assert_same_answer(ref, (req.output_ids, req.logits_log))
    chunked.check_integrity()


@pytest.mark.parametrize("ending", ["cancel", "fail"])
def test_mid_prefill_end_is_alone_and_unpins(engines: tuple[Engine, Engine], ending: str) -> None:
    whole, chunked = engines
    ref_short = answer(whole, SHORT, 16)
    chunked.flush_cache()
    answer(chunked, LONG[:12], 1, use_cache=True)  # the long prompt starts from a pinned hit
    long_req = chunked.make_request(LONG, SamplingParams(ignore_eos=True, max_tokens=4))
    forward, decode, seen = chunked.runner.forward, chunked.runner.decode, threading.Event()

    def spy_forward(
        token_ids: list[int], kv: RequestKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        if kv is long_req.kv and 0 < kv.length < len(LONG) - CHUNK:
            seen.set()
            if ending == "fail":
                raise RuntimeError("forward failed mid-prefill")
            chunked.scheduler.cancel(long_req, wait=False)
        return forward(token_ids, kv, all_logits=all_logits)

    def spy_decode(token_ids: Sequence[int | None], batch: BatchKV) -> torch.Tensor:
        if long_req.status is RequestStatus.WAITING and not long_req.t_enqueue:
            chunked.scheduler.submit(long_req)  # NOTE: arrives while the short one decodes
        return decode(token_ids, batch)

    chunked.runner.forward, chunked.runner.decode = spy_forward, spy_decode  # type: ignore[method-assign]
    try:
        short_req, short_it = start(chunked, SHORT, 16)
        list(short_it)
        if ending == "fail":
            with pytest.raises(RuntimeError, match="mid-prefill"):
                completion_of(long_req)
        assert long_req.released.wait(60)  # NOTE: a cancelled request posts nothing
    finally:
        del chunked.runner.forward, chunked.runner.decode
    assert seen.is_set() and long_req.released.is_set() and not long_req.output_ids
    assert short_req.logits_log is not None
    assert_same_answer(ref_short, (short_req.output_ids, short_req.logits_log))
    assert chunked.scheduler_stats().num_blocks_pinned == 0
    chunked.check_integrity()


def test_n_choices_prefilled_in_chunks_while_a_stream_decodes(
    engines: tuple[Engine, Engine],
) -> None:
    whole, chunked = engines
    params = SamplingParams(ignore_eos=True, max_tokens=5)

    def group(engine: Engine) -> list[Request]:
        head = engine.make_request(LONG, params, n=3, use_prefix_cache=False, record_logits=True)
        return [head, *head.forks]

    ref = group(whole)
    whole.scheduler.submit(ref[0])
    got, decode = group(chunked), chunked.runner.decode

    def spy_decode(token_ids: Sequence[int | None], batch: BatchKV) -> torch.Tensor:
        if got[0].status is RequestStatus.WAITING and not got[0].t_enqueue:
            chunked.scheduler.submit(got[0])  # NOTE: arrives while the short one decodes
        return decode(token_ids, batch)

    chunked.runner.decode = spy_decode  # type: ignore[method-assign]
    try:
        short_req, short_it = start(chunked, SHORT, 16)
        list(short_it)
        for req in [*ref, *got]:
            completion_of(req)
    finally:
        del chunked.runner.decode
    for a, b in zip(ref, got, strict=True):
        assert a.logits_log is not None and b.logits_log is not None
        assert_same_answer((a.output_ids, a.logits_log), (b.output_ids, b.logits_log))
    assert chunked.scheduler_stats().num_blocks_pinned == 0
    chunked.check_integrity()
