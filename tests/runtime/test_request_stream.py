"""RequestStream: blocking reads give one delta per token; polls merge what is ready, never block.

A stub scheduler scripts the outbox exactly; one tiny random Llama checks the real loop's wakes.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from runtime import RuntimeEngineError, SamplingParams
from runtime.engine import Engine
from runtime.outputs import StreamDelta
from runtime.request.state import Request
from runtime.stream import RequestStream, merge_deltas
from tests.conftest import VOCAB_SIZE

PROMPT = [(7 * i + 2) % (VOCAB_SIZE - 3) + 3 for i in range(20)]


class StubScheduler:
    """Records submit/cancel; the test posts to the request's outbox itself."""

    def __init__(self) -> None:
        self.submitted: list[Request] = []
        self.cancelled: list[tuple[Request, bool]] = []

    def submit(self, req: Request) -> None:
        self.submitted.append(req)

    def cancel(self, req: Request, *, wait: bool = True) -> None:
        self.cancelled.append((req, wait))


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine.from_pretrained(str(llama_path), kv_cache_bytes=1 << 20, block_size=4)


def stub_stream(engine: Engine) -> tuple[RequestStream, Request, StubScheduler]:
    req = engine.make_request(PROMPT, SamplingParams(ignore_eos=True, max_tokens=4))
    scheduler = StubScheduler()
    return RequestStream(req, scheduler), req, scheduler  # type: ignore[arg-type]


def test_poll_merges_ready_deltas_and_raises_a_later_error_on_the_next_poll(
    engine: Engine,
) -> None:
    stream, req, scheduler = stub_stream(engine)
    assert stream.poll() is None and scheduler.submitted == [req]  # submitted, nothing ready
    req.post(StreamDelta([5], "a"))
    req.post(StreamDelta([6, 7], "bc"))
    req.post(RuntimeEngineError("boom"))
    merged = stream.poll()
    assert merged == StreamDelta([5, 6, 7], "abc") and not stream.is_done
    with pytest.raises(RuntimeEngineError, match="boom"):
        stream.poll()
    assert stream.is_done and stream.poll() is None
    stream.close()
    assert scheduler.cancelled == []  # it ended with an error: nothing left to cancel


def test_next_reads_one_delta_at_a_time_and_close_cancels(engine: Engine) -> None:
    stream, req, scheduler = stub_stream(engine)
    req.post(StreamDelta([5], "a"))
    req.post(StreamDelta([6], "b"))
    assert next(stream) == StreamDelta([5], "a")
    assert next(stream) == StreamDelta([6], "b")
    stream.close()
    stream.close()
    assert scheduler.cancelled == [(req, True)] and stream.is_done
    with pytest.raises(StopIteration):
        next(stream)


def test_an_unsubmitted_stream_cancels_nothing(engine: Engine) -> None:
    stream, _, scheduler = stub_stream(engine)
    stream.close()
    dropped, _, dropped_scheduler = stub_stream(engine)
    del dropped
    gc.collect()
    assert scheduler.submitted == [] and scheduler.cancelled == []
    assert dropped_scheduler.cancelled == []


def test_a_dropped_stream_is_cancelled_without_waiting(engine: Engine) -> None:
    stream, req, scheduler = stub_stream(engine)
    req.post(StreamDelta([5], "a"))
    next(stream)
    del stream
    gc.collect()
    assert scheduler.cancelled == [(req, False)]


def test_the_loop_wakes_once_per_posted_delta_and_a_poll_gets_them_all(engine: Engine) -> None:
    wakes: list[int] = []
    stream = engine.stream(PROMPT, SamplingParams(ignore_eos=True, max_tokens=8))
    stream.set_waker(lambda: wakes.append(1))
    early = stream.poll()  # submits; the loop may have posted a token already
    assert stream.request.released.wait(timeout=60)
    rest = stream.poll()
    assert rest is not None and stream.is_done
    merged = merge_deltas([early, rest] if early is not None else [rest])
    assert merged.completion is not None and len(merged.token_ids) == 8
    assert merged.token_ids == merged.completion.token_ids
    assert merged.text == merged.completion.text
    assert len(wakes) == 8  # one post per token, the last carrying the completion
    assert engine.scheduler_stats().num_blocks_pinned == 0
    engine.check_integrity()


def test_an_unstreamed_request_posts_only_its_completion(engine: Engine) -> None:
    params = SamplingParams(ignore_eos=True, max_tokens=8, logprobs=2, stop=["never"])
    streamed = list(engine.stream(PROMPT, params))
    req = engine.make_request(PROMPT, params)
    req.is_streamed = False
    wakes: list[int] = []
    req.waker = lambda: wakes.append(1)
    (only,) = list(engine.run(req))  # what Engine.generate reads
    done, want = only.completion, streamed[-1].completion
    assert done is not None and want is not None and len(wakes) == 1
    assert (done.token_ids, done.text, done.finish_reason) == (
        want.token_ids, want.text, want.finish_reason)  # fmt: skip
    assert done.logprobs == want.logprobs and len(streamed) == 8
    assert engine.generate(PROMPT, params).token_ids == want.token_ids
    assert engine.scheduler_stats().num_blocks_pinned == 0
    engine.check_integrity()


def test_a_poll_after_the_end_merges_every_token(engine: Engine) -> None:
    expected = engine.generate(PROMPT, SamplingParams(ignore_eos=True, max_tokens=6))
    stream = engine.stream(PROMPT, SamplingParams(ignore_eos=True, max_tokens=6))
    first = next(stream)  # blocking read: exactly one token
    assert stream.request.released.wait(timeout=60)
    rest = stream.poll()
    assert len(first.token_ids) == 1 and rest is not None and rest.completion is not None
    assert first.token_ids + rest.token_ids == expected.token_ids
    assert first.text + rest.text == expected.text
    assert stream.poll() is None


def test_a_cancelled_stream_counts_the_prefill_and_tokens_it_computed(engine: Engine) -> None:
    # NOTE: a prompt no other test sends, so nothing of it is cached: all of it is computed.
    prompt = [(11 * i + 5) % (VOCAB_SIZE - 3) + 3 for i in range(24)]
    before = engine.scheduler_stats()
    engine.scheduler.pause()
    try:
        stream = engine.stream(prompt, SamplingParams(ignore_eos=True, max_tokens=40))
        assert stream.poll() is None  # submitted; the paused loop ran nothing yet
        delivered: list[int] = []
        for _ in range(3):  # admission + prefill, then decode steps
            engine.scheduler.step()
            delta = stream.poll()
            delivered += [] if delta is None else delta.token_ids
        engine.scheduler.cancel(stream.request, wait=False)
        engine.scheduler.step()  # releases it
    finally:
        engine.scheduler.resume()
    assert stream.request.released.wait(timeout=60)
    stream.close()
    after = engine.scheduler_stats()
    assert 2 <= len(delivered) < 40 and stream.request.cached_len == 0
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == len(prompt)
    assert after.generation_tokens - before.generation_tokens == len(delivered)
    assert after.num_blocks_pinned == 0
    engine.check_integrity()


def test_finished_streams_count_as_their_completions_say(engine: Engine) -> None:
    before = engine.scheduler_stats()
    params = SamplingParams(ignore_eos=True, max_tokens=5)
    done = [engine.generate(PROMPT, params) for _ in range(2)]  # the second hits the first
    after = engine.scheduler_stats()
    computed = sum(c.metrics.prefill_tokens_computed for c in done)
    assert done[1].usage.cached_tokens > 0
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == computed
    assert after.generation_tokens - before.generation_tokens == 10


def test_a_decode_step_posts_every_row_before_it_wakes_any_consumer(engine: Engine) -> None:
    """A wake-up hands the consumer's thread the GIL; posting the rest first keeps the step's
    own work from waiting on it (Executor._waking_after)."""
    params = SamplingParams(ignore_eos=True, max_tokens=4)
    prompts = [PROMPT, PROMPT[:12] + [3, 4, 5], PROMPT[5:]]
    seen: list[list[int]] = []  # every row's posted deltas, at each wake-up
    engine.scheduler.pause()
    try:
        streams = [engine.stream(ids, params) for ids in prompts]
        reqs = [stream.request for stream in streams]
        for stream in streams:
            stream.set_waker(lambda: seen.append([req.outbox.qsize() for req in reqs]))
            assert stream.poll() is None  # submitted; the paused loop ran nothing
        for _ in range(8):
            engine.scheduler.step()
    finally:
        engine.scheduler.resume()
    for stream in streams:
        merged = merge_deltas(list(stream))
        assert merged.completion is not None and len(merged.token_ids) == 4
    steps = [sizes for sizes in seen if min(sizes) >= 1]  # NOTE: prefills post one by one
    assert len(steps) >= 3 * 3  # every row woken on each of the three decode steps
    assert all(len(set(sizes)) == 1 for sizes in steps), seen
    assert engine.scheduler_stats().num_blocks_pinned == 0
    engine.check_integrity()
