"""The batched sampler against a plain per-row reference (numpy), its safety on every accepted
value, SamplingParams validation, and ``ignore_eos`` on an engine.

The reference applies, to one row at a time and in float64: logit_bias, the min_tokens mask, the
repetition penalty (HF/vLLM: positive logits of ids in prompt or output divided, negative ones
multiplied), frequency and presence penalties (OpenAI: subtract per output occurrence / once),
then temperature, min_p, top-k and top-p. Logprobs are the raw model distribution's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import Engine, InvalidRequestError
from runtime.exceptions import SamplingError
from runtime.sampling.params import MIN_TEMPERATURE, SamplingParams
from runtime.sampling.sampler import (
    LogitsProcessor,
    Sampled,
    TokenCounts,
    process_logits,
    sample_batch,
    sampling_probs,
)
from tests.conftest import EOS_ID, VOCAB_SIZE

VOCAB = 12  # the hand-made logits; the engine tests use the tiny models
STOP = frozenset({0, 3})


@dataclass(eq=False)
class Row:
    """A request as the sampler sees it (``runtime.request.state.Request`` in the engine)."""

    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = STOP
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    token_counts: TokenCounts | None = None
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))


def reference_scores(logits: np.ndarray, row: Row) -> np.ndarray:
    """Processed logits of one row, written plainly, in float64."""
    p = row.params
    x = logits.astype(np.float64).copy()
    for tok, bias in p.logit_bias.items():
        x[tok] += bias
    if len(row.output_ids) < p.min_tokens:
        for tok in row.stop_ids:
            x[tok] = -math.inf
    seen = set(row.prompt_ids) | set(row.output_ids)
    for tok in range(len(x)):
        if tok in seen:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        count = row.output_ids.count(tok)
        x[tok] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def reference_probs(scores: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution of one sampled row, written plainly."""
    z = (scores - scores.max()) / max(p.temperature, MIN_TEMPERATURE)
    probs = np.exp(z) / np.exp(z).sum()
    probs[probs < p.min_p * probs.max()] = 0.0
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = order[: p.top_k] if p.top_k else order
    total = sum(probs[t] for t in kept)
    out, mass = np.zeros_like(probs), 0.0
    for tok in kept:
        if mass >= p.top_p:
            break
        out[tok] = probs[tok] / total
        mass += probs[tok] / total
    normalised: np.ndarray = out / out.sum()
    return normalised


params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.just(8),
    temperature=st.sampled_from([0.0, 1e-30, 0.3, 1.0, 2.0]),
    top_p=st.sampled_from([1.0, 0.5, 1e-9]),
    top_k=st.sampled_from([0, 1, 3]),
    min_p=st.sampled_from([0.0, 0.1, 1.0]),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
    min_tokens=st.integers(0, 4),
)
row_strategy = st.builds(
    Row,
    params=params_strategy,
    prompt_ids=st.lists(st.integers(0, VOCAB - 1), max_size=6),
    output_ids=st.lists(st.integers(0, VOCAB - 1), max_size=6),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_batched_processing_matches_the_per_row_reference(rows: list[Row], seed: int) -> None:
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    scores, errors = process_logits(logits, rows)
    assert not errors
    for i, row in enumerate(rows):
        want = reference_scores(logits[i].numpy(), row)
        np.testing.assert_allclose(scores[i].numpy(), want, rtol=1e-5, atol=1e-4)
        if row.params.is_greedy:
            continue
        got = sampling_probs(scores[i : i + 1], [row.params])[0].numpy()
        np.testing.assert_allclose(got, reference_probs(want, row.params), atol=1e-5)


def test_greedy_rows_take_the_argmax_of_the_processed_logits() -> None:
    logits = torch.tensor([[1.0, 5.0, 4.9, 0.0], [1.0, 5.0, 4.9, 0.0], [1.0, 5.0, 4.9, 0.0]])
    rows = [
        Row(SamplingParams()),
        Row(SamplingParams(logit_bias={3: 100.0})),
        Row(SamplingParams(frequency_penalty=1.0), output_ids=[1]),
    ]
    picks = sample_batch(logits, rows)
    assert [p.token_id for p in picks if isinstance(p, Sampled)] == [1, 3, 2]


def test_penalty_counts_follow_the_output_incrementally() -> None:
    row = Row(SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0), prompt_ids=[5])
    logits = torch.zeros(1, VOCAB) + 1.0
    for output in ([], [1], [1, 1, 2]):
        row.output_ids = list(output)
        scores, _ = process_logits(logits, [row])
        want = reference_scores(logits[0].numpy(), row)
        np.testing.assert_allclose(scores[0].numpy(), want, rtol=1e-6)
    assert row.token_counts is not None and row.token_counts.num_counted == 3


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 50.0  # the stop id 0 would win
    rows = [
        Row(SamplingParams(min_tokens=2), output_ids=[7]),
        Row(SamplingParams(min_tokens=2), output_ids=[7, 7]),
    ]
    first, second = sample_batch(logits, rows)
    assert isinstance(first, Sampled) and first.token_id not in STOP
    assert isinstance(second, Sampled) and second.token_id == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1e-300},
        {"temperature": 1e-40},
        {"temperature": 5e-3},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1e-30, "top_p": 1e-30, "top_k": 1},
        {"temperature": 2.0, "min_p": 1.0},
        {"temperature": 1e-30, "logit_bias": {4: 100.0, 5: -100.0}},
    ],
)
def test_every_accepted_extreme_value_samples_safely(kwargs: dict[str, object]) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 1e4
    logits[1, 2] = float("-inf")
    rows = [Row(SamplingParams(**kwargs)) for _ in range(3)]  # type: ignore[arg-type]
    for pick in sample_batch(logits, rows):
        assert isinstance(pick, Sampled) and 0 <= pick.token_id < VOCAB


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-39, 2e-38, 1e38, 1e39, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_accepted_repetition_penalty_samples_safely(
    penalty: float, temperature: float
) -> None:
    # NOTE: issue 35: a small penalty divided positive logits past float32's range (+inf); a
    # large one took negative logits to -inf (all of them in row 2), or became inf itself in
    # float32 (0 * inf = NaN): the row failed, a 500 over HTTP.
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 1e4
    logits[0, 5] = 0.0
    logits[1, 2] = float("-inf")
    logits[2] = -logits[2].abs() - 1.0  # every logit negative
    seen = list(range(VOCAB))
    params = SamplingParams(repetition_penalty=penalty, temperature=temperature)
    rows = [Row(params, prompt_ids=seen) for _ in range(3)]
    scores, errors = process_logits(logits, rows)
    assert not errors and bool(torch.isfinite(scores[:, [0, 1, 3, 4]]).all())
    for pick, row in zip(sample_batch(logits, rows), logits, strict=True):
        assert isinstance(pick, Sampled) and 0 <= pick.token_id < VOCAB
        if temperature == 0.0:  # the penalty keeps the order of a row's logits
            assert pick.token_id == int(row.argmax())


def test_repetition_penalty_is_exact_wherever_float32_holds_the_result() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    rows = [
        Row(SamplingParams(repetition_penalty=1e-30), prompt_ids=[1, 2, 3, 4, 5, 6]),
        Row(SamplingParams(repetition_penalty=1e30), prompt_ids=[1, 2, 3, 4, 5, 6]),
    ]
    scores, errors = process_logits(logits, rows)
    assert not errors
    for i, row in enumerate(rows):
        want = reference_scores(logits[i].numpy(), row)
        np.testing.assert_allclose(scores[i].numpy(), want, rtol=1e-6)


def test_tiny_temperatures_sample_as_the_minimum_temperature() -> None:
    logits = torch.tensor([[0.0, 0.004, -1.0, -1.0]])
    tiny = sampling_probs(logits, [SamplingParams(temperature=1e-30)])
    floor = sampling_probs(logits, [SamplingParams(temperature=MIN_TEMPERATURE)])
    assert torch.equal(tiny, floor) and bool(torch.isfinite(tiny).all())


class Raises:
    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> None:
        raise ValueError("bad grammar state")


class MaskAllBut:
    def __init__(self, keep: int) -> None:
        self.keep = keep

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> None:
        keep = logits[self.keep].item()
        logits.fill_(float("-inf"))
        logits[self.keep] = keep


def test_a_bad_row_fails_alone_and_the_others_pick_as_if_alone() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[1, 4] = float("nan")
    rows = [
        Row(SamplingParams()),
        Row(SamplingParams()),  # NaN from the model
        Row(SamplingParams(temperature=0.7), generator=torch.Generator().manual_seed(5)),
        Row(SamplingParams(), logits_processors=[Raises()]),
        Row(SamplingParams(), logits_processors=[MaskAllBut(7), MaskAllBut(8)]),  # nothing left
        Row(SamplingParams(), logits_processors=[MaskAllBut(9)]),
    ]
    picks = sample_batch(logits, rows)
    assert isinstance(picks[1], SamplingError) and "non-finite logits" in str(picks[1])
    assert isinstance(picks[3], SamplingError) and "bad grammar state" in str(picks[3])
    assert isinstance(picks[4], SamplingError) and "every token was masked" in str(picks[4])
    assert picks[5] == Sampled(9, None)
    for i in (0, 2):
        alone = Row(rows[i].params, generator=torch.Generator().manual_seed(5))
        assert picks[i] == sample_batch(logits[i : i + 1], [alone])[0]


def test_logprobs_are_the_raw_model_distribution() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [
        Row(
            SamplingParams(logprobs=3, logit_bias={0: 50.0}, repetition_penalty=1.5), prompt_ids=[1]
        ),
        Row(SamplingParams(logprobs=0)),
    ]
    picks = sample_batch(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, pick in enumerate(picks):
        assert isinstance(pick, Sampled) and pick.logprob is not None
        assert pick.logprob.token_id == pick.token_id
        assert pick.logprob.logprob == pytest.approx(raw[i, pick.token_id].item(), abs=1e-5)
        want = torch.topk(raw[i], rows[i].params.logprobs or 0)
        assert [t for t, _ in pick.logprob.top] == want.indices.tolist()
        assert [lp for _, lp in pick.logprob.top] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert picks[0].token_id == 0  # type: ignore[union-attr]  # the bias chose it; logprob is raw


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {3: 101.0}}, "logit_bias[3]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
def test_out_of_range_values_are_refused_by_name(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field.replace("[", r"\[")):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


# --- single rows on hand-made logits ---------------------------------------------------------

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One row through the batched sampler."""
    (picked,) = sample_batch(logits.unsqueeze(0), [Row(params, generator=generator)])
    assert isinstance(picked, Sampled)
    return picked.token_id


def test_greedy_is_argmax() -> None:
    assert pick(LOGITS, SamplingParams(), gen()) == 1


def test_greedy_ties_take_the_first_id_as_argmax_does() -> None:
    # NOTE: a vocabulary the size of SmolLM2's, so the reduction runs the way a real step's does.
    logits = torch.zeros(3, 49_152)
    logits[0, [40_000, 7, 30_000]] = 2.0
    logits[1, [49_151, 12_345]] = -0.5
    logits[1, logits[1] == 0.0] = -1.0
    logits[2, 3:] = 1.0
    picks = sample_batch(logits, [Row(SamplingParams()) for _ in range(3)])
    assert [p.token_id for p in picks if isinstance(p, Sampled)] == [7, 12_345, 3]
    assert [p.token_id for p in picks if isinstance(p, Sampled)] == logits.argmax(-1).tolist()


def test_top_k_one_and_a_tiny_top_p_keep_only_the_best_token() -> None:
    for params in (
        SamplingParams(temperature=5.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
    ):
        assert {pick(LOGITS, params, gen(s)) for s in range(20)} == {1}


def test_top_k_two_samples_only_the_two_best_tokens() -> None:
    params = SamplingParams(temperature=10.0, top_k=2)
    assert {pick(LOGITS, params, gen(s)) for s in range(40)} == {1, 2}


def test_the_same_seed_draws_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.0)
    first = [pick(LOGITS, params, g) for g in [gen(7)] * 10]
    again = [pick(LOGITS, params, g) for g in [gen(7)] * 10]
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
