"""An fp16 KV cache (``kv_dtype``): K/V rounded when written, attended as their rounded values.

A hit agrees with a miss (both attend over rounded values; on these tiny models within the
suite's 1e-4: test_engine_exactness's ``llama-kv16``; a real model's larger activations agree
only within fp16 rounding, so fp16 is opt-in), batched decode equals a request alone
(test_batch_exactness's) and blocks survive the disk tier (test_disk_tier_engine's). The answers
are another model's within fp16 rounding of K/V: close to the fp32 cache's, not equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.chunks.spans import ChunkReuse
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model import compact_llama
from runtime.model.kv_cache import RequestKVCache
from runtime.serve.cli import _runs
from tests.conftest import VOCAB_SIZE, save_tiny_model
from tests.runtime.kernel_isas import chosen_kernels
from tests.runtime.test_engine_exactness import assert_same_answer, run
from tests.runtime.test_quantized_weights import _tiny


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Engine, Engine]:
    """The same tiny model with an fp16 and an fp32 KV cache."""
    path = str(save_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param))))
    half = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, kv_dtype="float16")
    full = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, kv_dtype="float32")
    return half, full


def test_every_kv_store_holds_fp16(engines: tuple[Engine, Engine]) -> None:
    half, full = engines
    assert half.kv_dtype == "float16" and full.kv_dtype == "float32"
    assert half.prefix_cache.pool.data.dtype == torch.float16
    assert half.scheduler.batch.buffer.dtype == torch.float16
    assert half.chunk_store.pool.data.dtype == torch.float16
    assert isinstance(half.runner.new_cache(4), RequestKVCache)
    assert half.runner.new_cache(4).buffer.dtype == torch.float16
    # half the bytes per cached block: twice the blocks in the same budget
    assert half.prefix_cache.pool.num_blocks == 2 * full.prefix_cache.pool.num_blocks
    assert ", float16 KV cache" in _runs(half) and "KV cache" not in _runs(full)
    # the namespace names the KV dtype (the same model id, revision and dtype otherwise)
    assert half.model_id == full.model_id
    assert half.make_request([3, 4]).namespace != full.make_request([3, 4]).namespace


def test_fp16_answers_are_close_to_fp32_not_equal(engines: tuple[Engine, Engine]) -> None:
    """Rounding K/V to fp16 moves the logits (so the KV really is rounded) by about fp16's
    relative precision (2^-11) of their scale, no more."""
    half, full = engines
    ids = [(7 * i + 3) % (VOCAB_SIZE - 3) + 3 for i in range(40)]
    got, want = run(half, ids, 1, use_cache=False), run(full, ids, 1, use_cache=False)
    diff = (got[1][0] - want[1][0]).abs().max().item()
    assert 0 < diff < 1e-2, diff


def test_auto_is_the_models_dtype_and_fp16_serves_quantized_weights(tmp_path: Path) -> None:
    """fp16 K/V are opt-in (a hit equals a miss only within fp16 rounding), also for quantized
    weights; with them, a quantized engine's hit still agrees with its miss."""
    path = str(save_tiny_model("llama", tmp_path / "m"))
    assert Engine.from_pretrained(path).kv_dtype == "float32"
    assert Engine.from_pretrained(path, dtype="bfloat16").kv_dtype == "bfloat16"
    wide = _tiny("llama", tmp_path / "w")
    assert Engine.from_pretrained(wide, weights="q8_0").kv_dtype == "float32"
    q8 = Engine.from_pretrained(wide, weights="q8_0", kv_dtype="float16", block_size=4)
    assert q8.kv_dtype == "float16" and q8.weights == "q8_0"
    reads_blocks = q8.runner.compact is not None and q8.runner.compact.packed_products
    assert reads_blocks == chosen_kernels().is_vectorized
    ids = [(11 * i + 5) % 90 + 3 for i in range(37)]
    run(q8, ids[:20], 1, use_cache=True)
    miss, hit = run(q8, ids, 6, use_cache=False), run(q8, ids, 6, use_cache=True)
    assert hit[2] > 0
    assert_same_answer(miss[:2], hit[:2])
    q8.close()


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    path = str(save_tiny_model("llama", tmp_path / "m"))
    with pytest.raises(ValueError, match="kv_dtype float16 needs dtype float32"):
        EngineConfig(kv_dtype="float16", dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_dtype='float16' needs the compact forward"):
        Engine.from_pretrained(path, forward="transformers", kv_dtype="float16")
    gpt2 = str(save_tiny_model("gpt2", tmp_path / "g"))
    with pytest.raises(ValueError, match="needs the compact forward"):
        Engine.from_pretrained(gpt2, kv_dtype="float16")


def test_chunk_reuse_moves_fp16_chunks(engines: tuple[Engine, Engine]) -> None:
    """Chunks stored as fp16 are moved (keys re-rotated in fp32, rounded back) and reused; the
    answer stays within fp16 rounding of the fp32 cache's (one more rounding of moved keys)."""
    from tests.runtime.test_chunk_reuse import rag_prompt
    from tests.runtime.test_chunk_reuse import run as run_chunks

    half, full = engines
    half.flush_cache()
    first, first_spans = rag_prompt([0, 1, 2])
    run_chunks(half, first, ChunkReuse(first_spans, "exact"), n=1)
    ids, spans = rag_prompt([2, 0, 1])
    got, logits = run_chunks(half, ids, ChunkReuse(spans, "exact"), n=1)
    assert got.usage.chunk_reuse is not None and got.usage.chunk_reuse.missed_tokens == 0
    want = run_chunks(full, ids, ChunkReuse(spans, "exact"), n=1)[1]
    assert (want[0] - logits[0]).abs().max().item() < 1e-2
    half.check_integrity()


def test_native_fp16_prefill_and_decode_match_the_widened_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed prefill of two requests (``segment_attention``, head dim 16) and the batched
    decode steps (the C++ layer loop) read and write the fp16 buffers natively (the kernels
    widen what they load); each request alone on the torch path, which attends over widened
    copies of the same values, gives the same answer."""
    from tests.runtime.test_batch_exactness import submit

    path = _tiny("llama", tmp_path)  # 4 heads of 16
    half = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, kv_dtype="float16")
    assert half.runner.decode_attention == "native"
    calls: list[torch.dtype] = []
    forward_segments = compact_llama.CompactLlama._forward_segments

    def spy(self: Any, h: Any, cos: Any, sin: Any, segments: Any) -> torch.Tensor:
        calls.extend(s.buffer.dtype for s in segments)
        return forward_segments(self, h, cos, sin, segments)

    prompts = [[(5 * i + 7) % (VOCAB_SIZE - 3) + 3 for i in range(n)] for n in (29, 17)]
    monkeypatch.setattr(compact_llama.CompactLlama, "_forward_segments", spy)
    half.scheduler.pause()
    try:
        streams = [submit(half, ids, use_cache=False) for ids in prompts]
    finally:
        half.scheduler.resume()
    for _, stream in streams:
        list(stream)
    native = half.runner.compact.native  # type: ignore[union-attr]
    assert native is not None
    # one packed forward of both prompts (the scalar kernels have no segment_attention)
    assert calls == ([torch.float16] * 2 if native.is_vectorized else [])
    monkeypatch.setattr(compact_llama, "NATIVE_KV_DTYPES", (torch.float32,))
    for ids, (req, _) in zip(prompts, streams, strict=True):
        assert req.logits_log is not None
        alone = run(half, ids, len(req.output_ids), use_cache=False)
        assert_same_answer(alone[:2], (req.output_ids, req.logits_log))
    half.close()
