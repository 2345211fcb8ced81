"""Rows that copied the same prefix-cache blocks read them once per decode step (the native
kernel's shared prefix, ``BatchKV.share_prefix``): the same bits as every row reading its own
copy, on Llama and Qwen2 (QKV biases), with the batch's integrity check comparing the shared
bytes after every step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from runtime.batch_kv import BatchKV
from runtime.engine import Engine
from runtime.sampling import SamplingParams
from tests.conftest import EOS_ID, VOCAB_SIZE, make_tokenizer
from tests.runtime.test_compact_forward import required_native_kernels

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
    required_native_kernels()
    eng = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 24, block_size=16)
    assert eng.runner.decode_attention == "native", eng.runner.decode_attention
    eng.debug_integrity = True
    eng.scheduler.debug_integrity = True
    list(eng.run(eng.make_request(PREFIX, SamplingParams(max_tokens=1, ignore_eos=True))))
    return eng


def run_batch(engine: Engine) -> tuple[list[list[int]], list[list[torch.Tensor]], int]:
    """The four prompts admitted in one step and decoded together, stepped by hand.

    Returns:
        Each request's tokens and logits rows, and the longest shared prefix a step declared.
    """
    batch, shared_seen = engine.scheduler.batch, [0]
    slots = batch.step_slots

    def spy() -> Any:
        got = slots()
        if got.shared is not None:
            shared_seen[0] = max(shared_seen[0], int(got.shared.max()))
        return got

    reqs = [
        engine.make_request(PREFIX + tail, SamplingParams(max_tokens=9, ignore_eos=True),
                            record_logits=True)
        for tail in TAILS
    ]  # fmt: skip
    engine.scheduler.pause()
    batch.step_slots = spy  # type: ignore[method-assign]
    try:
        for req in reqs:
            engine.scheduler.submit(req)
        while any(r.status.value in ("waiting", "running") for r in reqs):
            engine.scheduler.step()
    finally:
        del batch.step_slots
        engine.scheduler.resume()
    assert all(r.logits_log is not None for r in reqs)
    return [r.output_ids for r in reqs], [list(r.logits_log or []) for r in reqs], shared_seen[0]


def test_shared_prefix_decode_is_bit_identical(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, logits, shared = run_batch(engine)
    # 600 cached positions in blocks of 16: 592 copied, two whole kernel blocks of 256 shared
    assert shared == 592, shared
    with monkeypatch.context() as m:
        m.setattr(BatchKV, "share_prefix", lambda *args, **kwargs: None)
        plain_tokens, plain_logits, plain_shared = run_batch(engine)
    assert plain_shared == 0
    assert tokens == plain_tokens and all(len(t) == 9 for t in tokens)
    for mine, theirs in zip(logits, plain_logits, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
