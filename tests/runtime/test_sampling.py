"""SamplingParams validation and the sampler on hand-made logits; ``ignore_eos`` on an engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import InvalidRequestError, SamplingParams
from runtime.engine import Engine
from runtime.sampling import sample
from tests.conftest import EOS_ID, VOCAB_SIZE

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax() -> None:
    assert sample(LOGITS, SamplingParams(), gen()) == 1


def test_top_k_one_and_a_tiny_top_p_keep_only_the_best_token() -> None:
    for params in (
        SamplingParams(temperature=5.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
    ):
        assert {sample(LOGITS, params, gen(s)) for s in range(20)} == {1}


def test_top_k_two_samples_only_the_two_best_tokens() -> None:
    params = SamplingParams(temperature=10.0, top_k=2)
    assert {sample(LOGITS, params, gen(s)) for s in range(40)} == {1, 2}


def test_the_same_seed_draws_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.0)
    first = [sample(LOGITS, params, g) for g in [gen(7)] * 10]
    again = [sample(LOGITS, params, g) for g in [gen(7)] * 10]
    assert first == again and len(set(first)) > 1


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_k": -1}, {"stop": [""]}],
)
def test_out_of_range_values_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_ignore_eos_keeps_generating_past_eos_but_stop_ids_still_stop(llama_path: Path) -> None:
    engine = Engine.from_pretrained(str(llama_path), kv_cache_bytes=1 << 20, block_size=4)
    assert engine.eos_ids == {EOS_ID}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    # Random weights: find a prompt whose greedy output reaches EOS before token 40.
    prompts = [[(k * i + 5) % (VOCAB_SIZE - 3) + 3 for i in range(12)] for k in range(1, 30)]
    prompt, long = next(
        (p, c) for p in prompts if EOS_ID in (c := engine.generate(p, params)).token_ids[:-1]
    )
    assert long.finish_reason == "length" and len(long.token_ids) == 40
    plain = engine.generate(prompt, SamplingParams(max_tokens=40))
    cut = long.token_ids.index(EOS_ID) + 1
    assert plain.token_ids == long.token_ids[:cut] and plain.finish_reason == "stop"
    by_id = engine.generate(
        prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[EOS_ID])
    )
    assert by_id.token_ids == plain.token_ids and by_id.finish_reason == "stop"
    engine.close()
