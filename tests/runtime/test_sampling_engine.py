"""Sampling parameters through the engine: min_tokens, logprobs against the model's own logits,
and penalties / logit_bias with the prefix cache on vs off (contract 1's tolerance rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.sampling.sampler import LogitsProcessor, TokenCounts, process_logits
from tests.conftest import ARCHS, EOS_ID, VOCAB_SIZE, save_tiny_model
from tests.runtime.test_engine_exactness import TOL

PROMPT = [(3 * i + 5) % (VOCAB_SIZE - 3) + 3 for i in range(30)]
PENALTIES = [
    SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(
        max_tokens=10, ignore_eos=True, logit_bias={7: 3.0, 8: -100.0, 9: 1.5}, min_p=0.2
    ),
]


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine.from_pretrained(str(llama_path), kv_cache_bytes=1 << 20, block_size=4)


def test_min_tokens_masks_eos_and_stop_ids(engine: Engine) -> None:
    biased = {EOS_ID: 100.0}  # the model would stop at once
    assert engine.generate(PROMPT, SamplingParams(logit_bias=biased)).token_ids == [EOS_ID]
    done = engine.generate(PROMPT, SamplingParams(max_tokens=9, min_tokens=4, logit_bias=biased))
    assert done.token_ids[-1] == EOS_ID and len(done.token_ids) == 5
    assert EOS_ID not in done.token_ids[:4] and done.finish_reason == "stop"
    by_id = SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=[20], logit_bias={20: 100})
    got = engine.generate(PROMPT, by_id).token_ids
    assert len(got) == 4 and got[3:] == [20] and 20 not in got[:3]


def test_min_tokens_holds_stop_strings_until_reached(engine: Engine) -> None:
    free = engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    words = free.text.split()
    stop = words[0]  # the first generated word would stop at once
    cut = engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, stop=[stop]))
    assert cut.text == "" and len(cut.token_ids) == 1
    held = engine.generate(
        PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, stop=[stop], min_tokens=3)
    )
    later = [i for i, w in enumerate(words) if w == stop and i >= 3]
    assert len(held.token_ids) == (later[0] + 1 if later else 8)
    assert held.text.startswith(" ".join(words[:3]))


def test_logprobs_are_the_log_softmax_of_the_models_own_logits(engine: Engine) -> None:
    params = SamplingParams(
        max_tokens=6, ignore_eos=True, logprobs=4, temperature=0.9, seed=5, presence_penalty=1.0
    )
    completion = engine.generate(PROMPT, params)
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    full = PROMPT + completion.token_ids[:-1]
    with torch.no_grad():
        logits = engine.runner.model(torch.tensor([full])).logits[0, len(PROMPT) - 1 :]
    ref = torch.log_softmax(logits.double(), dim=-1)  # [6, vocab]: raw, before the penalty
    for step, entry in enumerate(completion.logprobs):
        assert entry.token_id == completion.token_ids[step]
        assert entry.logprob == pytest.approx(ref[step, entry.token_id].item(), abs=1e-4)
        top = torch.topk(ref[step], 4)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_stream_deltas_carry_the_logprobs_of_their_tokens(engine: Engine) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)
    deltas = list(engine.stream(PROMPT, params))
    assert [lp.token_id for d in deltas for lp in d.logprobs] == deltas[-1].completion.token_ids  # type: ignore[union-attr]
    assert engine.generate(PROMPT, SamplingParams(max_tokens=2)).logprobs is None


@dataclass(eq=False)
class _Row:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int] = frozenset()
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    token_counts: TokenCounts | None = None
    generator: torch.Generator = field(default_factory=torch.Generator)


def run(
    engine: Engine, ids: list[int], params: SamplingParams, *, use_cache: bool
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Greedy tokens, raw logits per step, and the processed logits the argmax was taken of."""
    req = engine.make_request(ids, params, use_prefix_cache=use_cache, record_logits=True)
    completion = list(engine.run(req))[-1].completion
    assert completion is not None and req.logits_log is not None
    tokens, scores = completion.token_ids, []
    for step, raw in enumerate(req.logits_log):
        row = _Row(params, ids, tokens[:step])
        processed, errors = process_logits(raw.unsqueeze(0), [row])
        assert not errors
        scores.append(processed[0])
    return tokens, req.logits_log, scores


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", PENALTIES, ids=["repetition", "presence_frequency", "bias"])
def test_penalties_and_bias_give_the_same_greedy_answer_with_the_cache_on_or_off(
    arch: str, params: SamplingParams, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Raw logits within TOL at every step; greedy tokens equal except at a near-tie of the
    processed logits (the repetition penalty scales a raw difference by at most its value)."""
    eng = Engine.from_pretrained(
        str(_model(arch, tmp_path_factory)), kv_cache_bytes=1 << 22, block_size=4
    )
    ids = PROMPT[:23]
    eng.generate(ids[:17], SamplingParams(max_tokens=1))  # warm the cache with a prefix
    miss = run(eng, ids, params, use_cache=False)
    hit = run(eng, ids, params, use_cache=True)
    assert eng.cache_stats().hit_tokens >= 16
    tie = TOL * max(1.0, params.repetition_penalty)
    for step in range(len(miss[0])):
        diff = (miss[1][step] - hit[1][step]).abs().max().item()
        assert diff <= TOL, f"step {step}: logits differ by {diff:.2e}"
        if miss[0][step] != hit[0][step]:
            top2 = torch.topk(miss[2][step], 2).values
            assert (top2[0] - top2[1]).item() < tie, f"step {step}: tokens differ, no near-tie"
            break
    else:
        assert miss[0] == hit[0]
    eng.close()


_PATHS: dict[str, Path] = {}


def _model(arch: str, factory: pytest.TempPathFactory) -> Path:
    if arch not in _PATHS:
        _PATHS[arch] = save_tiny_model(arch, factory.mktemp(arch))
    return _PATHS[arch]


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_are_the_models_own_and_skip_the_cache(
    engine: Engine, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every prompt position's logprob (chunked prefill or not); cached_tokens stays honest."""
    monkeypatch.setattr("runtime.scheduler.scoring._SCORED_CHUNK", chunk)
    engine.generate(PROMPT, SamplingParams(max_tokens=1))  # the prompt is now cached
    params = SamplingParams(max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    completion = engine.generate(PROMPT, params)
    assert completion.usage.cached_tokens == 0  # NOTE: every position had to be computed
    entries = completion.prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
    with torch.no_grad():
        logits = engine.runner.model(torch.tensor([PROMPT])).logits[0]
    ref = torch.log_softmax(logits.double(), dim=-1)  # [len, vocab]
    for pos, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.token_id == PROMPT[pos]
        assert entry.logprob == pytest.approx(ref[pos - 1, PROMPT[pos]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(ref[pos - 1], 2).indices.tolist()
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert plain.token_ids == completion.token_ids and plain.usage.cached_tokens > 0
    engine.check_integrity()
