"""``n > 1``: the choices of one prompt share ONE prefill, then decode as their own batch rows.

On the word-level random-weight Llama (tests/conftest.py): usage and prefill counters show a
single prefill, choice ``i`` samples as a single request seeded ``seed + i``, greedy choices
agree with the prefix cache on and off, and a cancelled or oversized group behaves.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from runtime.engine import Engine
from runtime.exceptions import InvalidRequestError
from runtime.outputs import Completion
from runtime.request.builder import choice_seed
from runtime.sampling.params import SEED_MAX, SEED_MIN, SamplingParams
from runtime.scheduler.loop import SchedulerConfig
from tests.conftest import VOCAB_SIZE

TOL = 1e-4
PROMPT = [(5 * i + 3) % (VOCAB_SIZE - 3) + 3 for i in range(37)]


@pytest.fixture(scope="module")
def model_path(llama_path: Path) -> Path:
    return llama_path


def make_engine(path: Path, **kwargs: object) -> Engine:
    eng = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4, **kwargs)  # type: ignore[arg-type]
    eng.debug_integrity = True
    return eng


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Engine:
    return make_engine(model_path)


def finish(streams: list) -> list[Completion]:  # type: ignore[type-arg]
    out = []
    for stream in streams:
        completion = list(stream)[-1].completion
        assert completion is not None
        out.append(completion)
    return out


def run_group(
    engine: Engine, n: int, *, use_cache: bool, max_tokens: int = 6
) -> tuple[list[Completion], list[list[torch.Tensor]]]:
    head = engine.make_request(
        PROMPT,
        SamplingParams(ignore_eos=True, max_tokens=max_tokens),
        n=n,
        use_prefix_cache=use_cache,
        record_logits=True,
    )
    completions = finish(engine.run_choices(head))
    logs = [req.logits_log for req in (head, *head.forks)]
    assert all(log is not None for log in logs)
    return completions, [log for log in logs if log is not None]


def assert_same_answer(
    ref: tuple[list[int], list[torch.Tensor]], got: tuple[list[int], list[torch.Tensor]]
) -> None:
    """Logits within TOL while tokens agree; they may differ only at a near-tie of the two."""
    for step, (tok_a, tok_b, la, lb) in enumerate(zip(ref[0], got[0], ref[1], got[1], strict=True)):
        diff = (la - lb).abs().max().item()
        assert diff <= TOL, f"step {step}: logits differ by {diff:.2e}"
        if tok_a != tok_b:
            gap = abs(la[tok_a].item() - la[tok_b].item())
            assert gap < 2 * TOL, f"step {step}: tokens differ, no near-tie"
            return


def test_n_choices_share_one_prefill_and_count_the_prompt_once(engine: Engine) -> None:
    engine.flush_cache()
    before = engine.cache_stats().queried_tokens
    completions = finish(
        engine.stream_choices(PROMPT, SamplingParams(ignore_eos=True, max_tokens=5), n=4)
    )
    # One prefix-cache lookup and one forward of the whole prompt, for four choices.
    assert engine.cache_stats().queried_tokens - before == len(PROMPT)
    computed = [c.metrics.prefill_tokens_computed for c in completions]
    assert computed == [len(PROMPT), 0, 0, 0]
    assert all(c.usage.prompt_tokens == len(PROMPT) for c in completions)
    assert all(c.usage.completion_tokens == 5 for c in completions)
    engine.check_integrity()
    assert engine.scheduler_stats().num_blocks_pinned == 0


def test_choice_i_samples_like_a_single_request_seeded_seed_plus_i(engine: Engine) -> None:
    params = SamplingParams(ignore_eos=True, max_tokens=8, temperature=1.0, seed=1234)
    group = finish(engine.stream_choices(PROMPT, params, n=3))
    for i, choice in enumerate(group):
        single = engine.generate(
            PROMPT, SamplingParams(ignore_eos=True, max_tokens=8, temperature=1.0, seed=1234 + i)
        )
        assert choice.token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in group}) > 1, "distinct seeds gave identical samples"


def test_choice_seeds_wrap_in_the_signed_64_bit_range() -> None:
    assert choice_seed(7, 0) == 7 and choice_seed(7, 2) == 9
    assert choice_seed(SEED_MAX, 1) == SEED_MIN
    assert choice_seed(-1, 1) == 0


def test_unseeded_sampling_leaves_torch_global_generator_alone(engine: Engine) -> None:
    # An app that seeded torch for its own reproducibility keeps its stream of numbers.
    params = SamplingParams(ignore_eos=True, max_tokens=4, temperature=1.0)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    group = finish(engine.stream_choices(PROMPT, params, n=2))
    assert torch.equal(torch.rand(4), expected)
    assert group[0].token_ids and group[1].token_ids
    seeds = {choice_seed(None, 0) for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 1 << 63 for s in seeds)


def test_greedy_choices_match_with_the_prefix_cache_on_and_off(engine: Engine) -> None:
    engine.flush_cache()
    engine.generate(PROMPT[:29], SamplingParams(ignore_eos=True, max_tokens=1))  # warm a prefix
    miss, miss_logs = run_group(engine, 3, use_cache=False)
    hit, hit_logs = run_group(engine, 3, use_cache=True)
    assert hit[0].usage.cached_tokens >= 28 and miss[0].usage.cached_tokens == 0
    for a, la, b, lb in zip(miss, miss_logs, hit, hit_logs, strict=True):
        assert_same_answer((a.token_ids, la), (b.token_ids, lb))
    # Every greedy choice is the same answer (they decode from copies of one prompt KV).
    for other, log in zip(hit[1:], hit_logs[1:], strict=True):
        assert_same_answer((hit[0].token_ids, hit_logs[0]), (other.token_ids, log))
    engine.check_integrity()


def test_closing_one_choice_cancels_it_alone(engine: Engine) -> None:
    streams = engine.stream_choices(PROMPT, SamplingParams(ignore_eos=True, max_tokens=20), n=3)
    next(streams[1])
    streams[1].close()
    done = finish([streams[0], streams[2]])
    assert [len(c.token_ids) for c in done] == [20, 20]
    engine.check_integrity()
    assert engine.scheduler_stats().num_running == 0


def _closes_within(streams: list, timeout_s: float) -> bool:  # type: ignore[type-arg]
    """Close ``streams`` in order on a helper thread; False if that is still blocked after
    ``timeout_s`` (a hang detector: a close of a queued choice must not wait on the loop)."""
    closer = threading.Thread(target=lambda: [s.close() for s in streams], daemon=True)
    closer.start()
    closer.join(timeout_s)
    return not closer.is_alive()


def test_closing_the_choices_of_a_queued_group_returns_at_once(engine: Engine) -> None:
    # NOTE: cancel() took a queued head out of the queue alone, and a queued fork (outside the
    # queue) waited for a release that never came: closing one blocked forever.
    engine.scheduler.pause()
    try:
        streams = engine.stream_choices(PROMPT, SamplingParams(max_tokens=4), n=3)
        assert _closes_within(streams[:0:-1], 10)  # the forks: released at once
        assert engine.scheduler_stats().num_waiting == 1  # the head still waits...
        assert _closes_within(streams[:1], 10)  # ...until it too is cancelled
    finally:
        engine.scheduler.resume()
    assert all(s.request.released.is_set() for s in streams)
    engine.check_integrity()
    assert engine.scheduler_stats().num_waiting == 0


def test_closing_the_head_of_a_queued_group_keeps_its_other_choices(engine: Engine) -> None:
    # NOTE: the head left the queue when cancelled, orphaning the forks it must prefill for.
    engine.scheduler.pause()
    try:
        streams = engine.stream_choices(PROMPT, SamplingParams(ignore_eos=True, max_tokens=5), n=3)
        streams[0].cancel()  # NOTE: close() would wait for the paused loop to admit it
    finally:
        engine.scheduler.resume()
    done: list[list[Completion]] = []
    reader = threading.Thread(target=lambda: done.append(finish(streams[1:])), daemon=True)
    reader.start()
    reader.join(60)
    assert done and [len(c.token_ids) for c in done[0]] == [5, 5]
    streams[0].close()
    engine.check_integrity()


def test_more_choices_than_batch_rows_is_refused(model_path: Path) -> None:
    small = make_engine(model_path, scheduler=SchedulerConfig(max_batch_size=2))
    with pytest.raises(InvalidRequestError, match="n=3"):
        small.stream_choices(PROMPT, SamplingParams(ignore_eos=True, max_tokens=2), n=3)
    assert (
        len(
            finish(small.stream_choices(PROMPT, SamplingParams(ignore_eos=True, max_tokens=2), n=2))
        )
        == 2
    )
    small.close()


def test_n_must_be_positive(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="n must be"):
        engine.stream_choices(PROMPT, n=0)
