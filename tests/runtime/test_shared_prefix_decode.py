"""Rows that copied the same prefix-cache blocks (``BatchKV.share_prefix``) are read once for
all of them: by the native decode kernel (as one group per block; equal within float32 rounding) and
by the packed prefill's cascade attention (equal within float32 rounding), on Llama and Qwen2
(QKV biases), with the batch's integrity check comparing the shared bytes after every step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from runtime.engine import Engine
from runtime.model import compact_llama
from runtime.model.attention import CASCADE_MIN_SHARED
from runtime.model.batch_kv import BatchKV
from runtime.sampling.params import SamplingParams
from tests.conftest import EOS_ID, VOCAB_SIZE, make_tokenizer
from tests.runtime.kernel_isas import chosen_kernels
from tests.runtime.test_engine_exactness import TOL

PREFIX = [(7 * i + 5) % (VOCAB_SIZE - 3) + 3 for i in range(600)]
TAILS = [[9, 10, 11], [12] * 7, [13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = Path(tmp_path_factory.mktemp(request.param))
    shape: dict[str, Any] = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 1024, "eos_token_id": EOS_ID, "bos_token_id": 1,
    }  # fmt: skip
    torch.manual_seed(11)
    if request.param == "qwen2":
        model: Any = Qwen2ForCausalLM(Qwen2Config(**shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    chosen_kernels()
    eng = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 24, block_size=16)
    assert eng.runner.decode_attention == "native", eng.runner.decode_attention
    eng.debug_integrity = True
    eng.scheduler.debug_integrity = True
    list(eng.run(eng.make_request(PREFIX, SamplingParams(max_tokens=1, ignore_eos=True))))
    return eng


def run_batch(engine: Engine) -> tuple[list[list[int]], list[list[torch.Tensor]], int, int]:
    """The four prompts admitted in one step (one packed prefill) and decoded together,
    stepped by hand.

    Returns:
        Each request's tokens and logits rows, the longest shared prefix a decode step
        declared and the shared length the packed prefill was given.
    """
    batch, shared_seen, packed_shared = engine.scheduler.batch, [0], [-1]
    slots, packed = batch.step_slots, engine.runner.forward_packed

    def spy() -> Any:
        got = slots()
        if got.shared is not None:
            shared_seen[0] = max(shared_seen[0], int(got.shared.max()))
        return got

    def packed_spy(chunks: Any, *, shared_len: int = 0) -> torch.Tensor:
        packed_shared[0] = shared_len
        return packed(chunks, shared_len=shared_len)

    reqs = [
        engine.make_request(PREFIX + tail, SamplingParams(max_tokens=9, ignore_eos=True),
                            record_logits=True)
        for tail in TAILS
    ]  # fmt: skip
    engine.scheduler.pause()
    batch.step_slots = spy  # type: ignore[method-assign]
    engine.runner.forward_packed = packed_spy  # type: ignore[method-assign]
    try:
        for req in reqs:
            engine.scheduler.submit(req)
        while any(r.status.value in ("waiting", "running") for r in reqs):
            engine.scheduler.step()
    finally:
        del batch.step_slots, engine.runner.forward_packed
        engine.scheduler.resume()
    assert all(r.logits_log is not None for r in reqs)
    logits = [list(r.logits_log or []) for r in reqs]
    return [r.output_ids for r in reqs], logits, shared_seen[0], packed_shared[0]


def no_decode_sharing(batch: BatchKV) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(batch.num_rows), torch.zeros(batch.num_rows, dtype=torch.long)


def test_shared_prefix_decode_matches_unshared(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, logits, shared, packed = run_batch(engine)
    # 600 cached positions in blocks of 16: 592 copied, two whole kernel blocks of 256 shared
    assert shared == 592 and packed == 592, (shared, packed)
    with monkeypatch.context() as m:
        m.setattr(BatchKV, "share_plan", no_decode_sharing)
        plain_tokens, plain_logits, plain_shared, _ = run_batch(engine)
    assert plain_shared == 0
    assert tokens == plain_tokens and all(len(t) == 9 for t in tokens)
    for mine, theirs in zip(logits, plain_logits, strict=True):
        assert all((a - b).abs().max().item() <= TOL for a, b in zip(mine, theirs, strict=True))


def test_cascade_prefill_matches_per_segment_attention(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed prefill over the 592 shared positions, attended once (cascade, the shared
    part in the native ``prefix_attention``, used here whatever this ISA's default) or per
    segment: every step's logits within the suite's tolerance, the same greedy tokens."""
    calls, native_calls = [], []
    cascade = compact_llama.CompactLlama._attend_cascade
    compact = engine.runner.compact
    assert compact is not None and compact.native is not None
    prefix_attention = compact.native.prefix_attention

    def spy(self: Any, *args: Any) -> torch.Tensor:
        calls.append(args[2])  # shared_len
        return cascade(self, *args)

    def native_spy(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> Any:
        native_calls.append(k.shape[1])  # keys: the shared positions
        return prefix_attention(q, k, *rest)

    with monkeypatch.context() as m:
        m.setattr(compact_llama.CompactLlama, "_attend_cascade", spy)
        m.setattr(compact, "native", compact.native._replace(prefix_attention=native_spy))
        m.setattr(compact, "native_prefix_attention", True)
        tokens, logits, _, packed = run_batch(engine)
    assert packed >= CASCADE_MIN_SHARED and calls == [packed] * 2  # two layers
    assert native_calls == [packed] * 2
    with monkeypatch.context() as m:
        m.setattr(compact_llama, "CASCADE_MIN_SHARED", 10**9)
        plain_tokens, plain_logits, _, _ = run_batch(engine)
    assert tokens == plain_tokens
    for mine, theirs in zip(logits, plain_logits, strict=True):
        assert len(mine) == len(theirs) == 9
        for a, b in zip(mine, theirs, strict=True):
            assert (a - b).abs().max().item() <= TOL


def test_the_choices_of_one_prompt_share_its_cached_prefix(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``n = 3`` greedy choices: the forks copied the head's prompt, so its cached prefix too;
    their decode reads it from the head's row, with the same numbers within float32 rounding."""

    def run() -> tuple[list[list[int]], list[list[torch.Tensor]], list[list[int]]]:
        plans: list[list[int]] = []
        batch, slots = engine.scheduler.batch, engine.scheduler.batch.step_slots

        def spy() -> Any:
            got = slots()
            plans.append([] if got.shared is None else got.shared.tolist())
            return got

        req = engine.make_request(PREFIX + [30, 31], SamplingParams(max_tokens=5, ignore_eos=True),
                                  record_logits=True, n=3)  # fmt: skip
        engine.scheduler.pause()
        batch.step_slots = spy  # type: ignore[method-assign]
        try:
            engine.scheduler.submit(req)
            while any(m.status.value in ("waiting", "running") for m in (req, *req.forks)):
                engine.scheduler.step()
        finally:
            del batch.step_slots
            engine.scheduler.resume()
        members = [req, *req.forks]
        return [m.output_ids for m in members], [list(m.logits_log or []) for m in members], plans

    tokens, logits, plans = run()
    assert [0, 592, 592] in plans, plans
    with monkeypatch.context() as m:
        m.setattr(BatchKV, "share_plan", no_decode_sharing)
        plain_tokens, plain_logits, _ = run()
    assert tokens == plain_tokens and all(len(t) == 5 for t in tokens)
    for mine, theirs in zip(logits, plain_logits, strict=True):
        assert len(mine) == 5
        assert all((a - b).abs().max().item() <= TOL for a, b in zip(mine, theirs, strict=True))
