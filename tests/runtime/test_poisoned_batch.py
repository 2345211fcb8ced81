"""Contract 8 at the engine: a request that cannot be sampled fails alone, the batch goes on.

The model is a tiny random Llama whose embedding of one token (``POISON``) is NaN, as a broken
checkpoint would be: a request that is made to emit that token (``logit_bias``) gets NaN logits
at its next decode step, inside a batch with healthy requests. Healthy requests must produce the
same tokens as when run alone (within the engine's tolerance rules), before and after the
poisoned row's KV slot is reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime import SamplingParams
from runtime.engine import Engine
from runtime.exceptions import SamplingError
from runtime.request.state import Request
from tests.conftest import VOCAB_SIZE, save_tiny_model
from tests.runtime.test_engine_exactness import assert_same_answer

POISON = 50
HEALTHY = [
    [t for t in ((5 * i + 7) % (VOCAB_SIZE - 3) + 3 for i in range(12)) if t != POISON],
    [9, 10, 11, 12, 13],
    [t for t in ((3 * i + 8) % (VOCAB_SIZE - 3) + 3 for i in range(21)) if t != POISON],
]
AVOID = {POISON: -100.0}  # NOTE: healthy requests never emit the poisoned token themselves.


def save_poisoned_model(path: Path) -> Path:
    """The tiny Llama with a NaN embedding row for ``POISON``."""
    save_tiny_model("llama", path)
    model = AutoModelForCausalLM.from_pretrained(path)
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    with torch.no_grad():
        embeddings.weight[POISON] = float("nan")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = save_poisoned_model(Path(tmp_path_factory.mktemp("poisoned")))
    return Engine.from_pretrained(str(path), kv_cache_bytes=1 << 20, block_size=4)


def healthy_params(i: int) -> SamplingParams:
    if i == 2:  # a seeded sampled request: its draws must not move either
        return SamplingParams(
            max_tokens=8, ignore_eos=True, temperature=0.8, seed=11, logit_bias=AVOID
        )
    return SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=AVOID)


def outcome(req: Request) -> list[int] | BaseException:
    while True:
        item = req.outbox.get(timeout=60)
        if isinstance(item, BaseException):
            return item
        if item.completion is not None:
            return item.completion.token_ids


def run_together(engine: Engine, reqs: Sequence[Request]) -> list[list[int] | BaseException]:
    """Submit every request at once, so they are admitted into one batch."""
    engine.scheduler.submit_all(reqs)
    return [outcome(req) for req in reqs]


class FailAtStep:
    """A logits processor that raises on its ``step``-th call."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> None:
        if len(output_ids) == self.step:
            raise RuntimeError("processor broke")


def test_poisoned_rows_fail_alone_and_healthy_rows_are_unchanged(engine: Engine) -> None:
    alone = [
        engine.make_request(p, healthy_params(i), record_logits=True, use_prefix_cache=False)
        for i, p in enumerate(HEALTHY)
    ]
    for req in alone:
        assert isinstance(outcome_of_run(engine, req), list)
    healthy = [
        engine.make_request(p, healthy_params(i), record_logits=True) for i, p in enumerate(HEALTHY)
    ]
    nan_row = engine.make_request(
        [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={POISON: 100})
    )
    broken = engine.make_request(
        [7, 8], SamplingParams(max_tokens=8, ignore_eos=True), logits_processors=[FailAtStep(3)]
    )
    extreme = engine.make_request(
        [7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-30, top_p=1e-30)
    )
    got = run_together(engine, [healthy[0], nan_row, healthy[1], broken, extreme, healthy[2]])
    assert isinstance(got[1], SamplingError) and "non-finite logits" in str(got[1])
    assert nan_row.output_ids == [POISON]
    assert isinstance(got[3], SamplingError) and "processor broke" in str(got[3])
    assert len(broken.output_ids) == 3
    assert isinstance(got[4], list) and len(got[4]) == 8  # extreme but valid: it just works
    for ref, req in zip(alone, healthy, strict=True):
        assert len(req.output_ids) == 8
        assert_same_answer(
            (ref.output_ids, ref.logits_log or []), (req.output_ids, req.logits_log or [])
        )
    engine.check_integrity()
    assert engine.prefix_cache.radix.num_in_use_blocks == 0


def test_a_failed_rows_slot_is_clean_for_the_next_request(engine: Engine) -> None:
    """The NaN KV a failed row wrote must not leak into a row that later takes its slot.

    Row 0 fails at position 18; the short row 2 then moves into slot 0, where positions past
    its length still hold that KV, and the long row 1 makes every step attend up to 30+
    positions, so row 2's masked padding covers the NaN position.
    """
    long_prompt, short_prompt = HEALTHY[2] + HEALTHY[1], [9, 10]
    refs = [
        engine.make_request(p, healthy_params(0), record_logits=True, use_prefix_cache=False)
        for p in (long_prompt, short_prompt)
    ]
    for ref in refs:
        outcome_of_run(engine, ref)
    nan_row = engine.make_request(
        [4, 5, 6] * 6, SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={POISON: 100})
    )
    batch = [
        engine.make_request(p, healthy_params(0), record_logits=True)
        for p in (long_prompt, short_prompt)
    ]
    got = run_together(engine, [nan_row, *batch])
    assert isinstance(got[0], SamplingError)
    for ref, req, result in zip(refs, batch, got[1:], strict=True):
        assert isinstance(result, list), result
        assert_same_answer(
            (ref.output_ids, ref.logits_log or []), (req.output_ids, req.logits_log or [])
        )
    engine.check_integrity()


def outcome_of_run(engine: Engine, req: Request) -> list[int] | BaseException:
    return run_together(engine, [req])[0]
