"""Continuous batching never changes the answer (Llama, Qwen2 incl. mixed sliding, GPT-2, Mistral).

Requests of different lengths, some sharing a prefix, join the running batch at different times;
every step's logits agree within 1e-4 with the same request run alone with force-miss, and greedy
tokens match except at near-ties. A decode spy proves the steps really ran batched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from runtime.engine import Engine
from runtime.model.batch_kv import BatchKV
from runtime.outputs import StreamDelta
from runtime.request.state import Request
from runtime.sampling.params import SamplingParams
from runtime.stream import RequestStream
from tests.conftest import ARCHS, EOS_ID, VOCAB_SIZE, make_tokenizer, save_tiny_model
from tests.runtime.test_engine_exactness import TOL, assert_same_answer

SHARED = [(11 * i + 4) % (VOCAB_SIZE - 3) + 3 for i in range(20)]
PROMPTS = [
    SHARED + [5, 6, 7],
    [9, 10, 11, 12, 13],
    SHARED[:13] + [40, 41],
    [(3 * i + 8) % (VOCAB_SIZE - 3) + 3 for i in range(37)],
    SHARED + [70] * 9,
]
NUM_TOKENS = 14


def save_qwen2_mixed(path: Path) -> Path:
    """Qwen2 with one full and one sliding layer (a per-layer-type mask mapping)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, bos_token_id=1, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        max_position_embeddings=256, use_sliding_window=True, sliding_window=6,
        max_window_layers=1,
    )  # fmt: skip
    assert config.layer_types is not None
    assert set(config.layer_types) == {"full_attention", "sliding_attention"}
    # NOTE: transformers leaves from_config unannotated.
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # type: ignore[no-untyped-call]
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[*ARCHS, "qwen2_mixed", "llama-kv16"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """``llama-kv16``: Llama with an fp16 KV cache (``kv_dtype``)."""
    path = Path(tmp_path_factory.mktemp(request.param))
    arch, _, kv = request.param.partition("-")
    if arch == "qwen2_mixed":
        save_qwen2_mixed(path)
    else:
        save_tiny_model(arch, path)
    kv_dtype = "float16" if kv else "auto"
    eng = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4, kv_dtype=kv_dtype)
    return eng


def start(
    engine: Engine, ids: list[int], *, use_cache: bool
) -> tuple[Request, Iterator[StreamDelta]]:
    req = engine.make_request(
        ids,
        SamplingParams(ignore_eos=True, max_tokens=NUM_TOKENS),
        use_prefix_cache=use_cache,
        record_logits=True,
    )
    return req, engine.run(req)


def submit(engine: Engine, ids: list[int], *, use_cache: bool) -> tuple[Request, RequestStream]:
    """``start``, but submitted now (``run_choices``), not at the stream's first read: with the
    scheduler paused, requests submitted this way join at an iteration the test chooses, however
    fast the machine runs the loop (read at the stream's first ``next``, a fast loop finished
    one request before the test submitted the next, and the batch never formed)."""
    req = engine.make_request(
        ids,
        SamplingParams(ignore_eos=True, max_tokens=NUM_TOKENS),
        use_prefix_cache=use_cache,
        record_logits=True,
    )
    (stream,) = engine.run_choices(req)
    return req, stream


def assert_matches_full_forward(engine: Engine, req: Request, model: Any = None) -> None:
    """Each step's logits equal the model's own cache-free forward (its own masks) within TOL;
    ``model``: another holding the same weights (when the engine's own freed them)."""
    assert req.logits_log is not None
    full = req.prompt_ids + req.output_ids[:-1]
    with torch.no_grad():
        model = engine.runner.model if model is None else model
        ref = model(torch.tensor([full])).logits[0, len(req.prompt_ids) - 1 :]
    for step, (want, got, token) in enumerate(
        zip(ref, req.logits_log, req.output_ids, strict=True)
    ):
        assert (want - got).abs().max().item() <= TOL, f"step {step}: logits differ"
        top2 = torch.topk(want, 2).values
        assert token == int(want.argmax()) or (top2[0] - top2[1]).item() < TOL, f"step {step}"


def test_batched_decode_matches_alone_force_miss(engine: Engine) -> None:
    assert engine.runner.mask_plan is not None, engine.runner.batch_blocker
    alone = []
    for ids in PROMPTS:
        req, it = start(engine, ids, use_cache=False)
        list(it)
        assert req.logits_log is not None
        alone.append((req.output_ids, req.logits_log))
    batch_sizes: list[int] = []
    decode = engine.runner.decode

    def spy(token_ids: Sequence[int | None], batch: BatchKV) -> torch.Tensor:
        batch_sizes.append(len(token_ids))
        return decode(token_ids, batch)

    engine.runner.decode = spy  # type: ignore[method-assign]
    try:
        # Two join at once, a third two iterations later, the rest four after that: the loop
        # is paused and stepped by hand, so the joins do not depend on the machine's speed.
        engine.scheduler.pause()
        try:
            streams = [submit(engine, ids, use_cache=True) for ids in PROMPTS[:2]]
            for _ in range(2):
                engine.scheduler.step()
            streams.append(submit(engine, PROMPTS[2], use_cache=True))
            for _ in range(4):
                engine.scheduler.step()
            streams += [submit(engine, ids, use_cache=True) for ids in PROMPTS[3:]]
        finally:
            engine.scheduler.resume()
        for _, it in streams:
            list(it)
    finally:
        del engine.runner.decode
    assert max(batch_sizes) >= 3, batch_sizes
    for (ref_tokens, ref_logits), (req, _) in zip(alone, streams, strict=True):
        assert req.logits_log is not None and len(req.output_ids) == NUM_TOKENS
        assert_same_answer((ref_tokens, ref_logits), (req.output_ids, req.logits_log))
        if engine.kv_dtype == "float32":  # NOTE: the model's own forward keeps fp32 K/V
            assert_matches_full_forward(engine, req)
    assert any(req.cached_len > 0 for req, _ in streams)  # prefixes were shared mid-batch
    assert engine.scheduler_stats().num_blocks_pinned == 0
    engine.check_integrity()
