"""``weights="bfloat16"``: linear weights rounded to bfloat16, activations, KV cache and arithmetic
in float32, and decode steps reading packed bf16 copies (``linear_bf16``).

The packed product is checked against a float64 product over the same rounded weights for every
shape class it has code for; the decode step is shown to read the packed copies (it follows the
rounded weights, not the fp32 ones it was built beside); and an engine's batched decode, with
and without prefix-cache hits, gives the rounded model's own transformers forward within the
suite's float32 tolerance on Llama and Qwen2 (QKV biases)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime import compact_llama
from runtime.compact_llama import CompactLlama, StepSlots, prefill_mask
from runtime.engine import Engine
from runtime.kernels import pack_bf16
from runtime.model_runner import round_weights_bf16
from runtime.serve.cli import _runs
from tests.conftest import save_tiny_model
from tests.runtime.test_batch_exactness import assert_matches_full_forward, start
from tests.runtime.test_compact_forward import PROMPTS, assert_close_bf16, required_native_kernels
from tests.runtime.test_engine_exactness import run
from tests.runtime.test_native_kernels import _model


@pytest.mark.parametrize(
    ("n", "k", "rows"),
    [(960, 576, 16), (100, 70, 3), (33, 5, 9), (1, 1, 1), (64, 3, 70), (32, 129, 8), (47, 300, 2)],
)
def test_linear_bf16_matches_float64_over_the_rounded_weights(n: int, k: int, rows: int) -> None:
    """Column counts with and without a partial last block of 32, K shorter and longer than the
    kernel's unrolled steps, 1 to 70 rows (several row tiles of 8, and their remainders), a
    bias, and a ``[B, q, K]`` input."""
    kernels = required_native_kernels()
    torch.manual_seed(n * 7 + k + rows)
    weight, bias = torch.randn(n, k), torch.randn(n)
    rounded = weight.to(torch.bfloat16).double()
    x = torch.randn(rows, 1, k)
    for b in (None, bias):
        got = kernels.linear_bf16(x, pack_bf16(weight), b, n)
        want = F.linear(x.double(), rounded, None if b is None else b.double())
        assert got.shape == (rows, 1, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5 * k**0.5, rtol=1e-5)
    # NOTE: against the unrounded weights it differs: the packed copy really is bf16
    exact = F.linear(x.double(), weight.double())
    got = kernels.linear_bf16(x, pack_bf16(weight), None, n).double()
    assert not torch.allclose(got, exact, atol=0.0, rtol=1e-6)


def test_linear_bf16_refuses_bad_input() -> None:
    kernels = required_native_kernels()
    packed, x = pack_bf16(torch.randn(40, 16)), torch.randn(3, 16)
    assert packed.shape == (2, 16, 32) and packed.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="x must be fp32"):
        kernels.linear_bf16(x.double(), packed, None, 40)
    with pytest.raises(RuntimeError, match="x has 15 inputs, the weight 16"):
        kernels.linear_bf16(torch.randn(3, 15), packed, None, 40)
    for n in (0, 32, 65):
        with pytest.raises(RuntimeError, match="does not match 2 packed blocks"):
            kernels.linear_bf16(x, packed, None, n)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        kernels.linear_bf16(x, packed, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="packed must be contiguous bf16"):
        kernels.linear_bf16(x, packed.float(), None, 40)
    with pytest.raises(RuntimeError, match="packed must be contiguous bf16"):
        kernels.linear_bf16(x, packed.transpose(0, 1).contiguous().transpose(0, 1), None, 40)


def _step(compact: CompactLlama, rows: int) -> torch.Tensor:
    """One native decode step of ``rows`` rows (positions 9, 10, ...) over zero K/V."""
    buffer = torch.zeros(len(compact.layers), 2, rows, compact.num_kv_heads, 32, compact.head_dim)
    pos = torch.arange(9, 9 + rows)
    ids = torch.arange(3, 3 + rows).unsqueeze(1)
    slots = StepSlots(buffer, torch.arange(rows), pos, int(pos.max()) + 1)
    allowed = (torch.arange(slots.kv_len) <= pos.unsqueeze(1)).view(rows, 1, 1, -1)
    return compact.forward(ids, pos.unsqueeze(1), None, allowed, slots=slots)  # type: ignore[arg-type]


def _prefill(compact: CompactLlama, n: int) -> torch.Tensor:
    """The Python path: ``n`` tokens from position 0, no cache, every position's logits."""
    ids, positions = torch.arange(3, 3 + n).unsqueeze(0), torch.arange(n).unsqueeze(0)

    def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    mask = prefill_mask(0, n, torch.device("cpu"))
    return compact.forward(ids, positions, write, mask, logits_to_keep=n)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_steps_of_few_rows_read_the_packed_copies(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built beside weights that were NOT rounded (so the two copies differ), a step of at most
    ``BF16_MAX_ROWS`` rows follows the rounded model and a larger one the fp32 weights: the
    packed copies are what small steps read, the LM head included; so does a short prefill on
    the Python path."""
    kernels = required_native_kernels()
    monkeypatch.setattr(compact_llama, "BF16_MAX_ROWS", 2)
    model = _model(arch, 4, 2, 16)
    rounded = copy.deepcopy(model)
    round_weights_bf16(rounded)
    mixed = CompactLlama(copy.deepcopy(model), native=kernels, bf16_weights=True)
    assert mixed.bf16_products
    want_rounded = CompactLlama(rounded, native=kernels)
    want_fp32 = CompactLlama(model, native=kernels)
    small, large = _step(mixed, 2), _step(mixed, 3)
    torch.testing.assert_close(small, _step(want_rounded, 2), atol=1e-5, rtol=1e-5)
    assert (small - _step(want_fp32, 2)).abs().max() > 1e-4
    torch.testing.assert_close(large, _step(want_fp32, 3), atol=1e-5, rtol=1e-5)
    assert (large - _step(want_rounded, 3)).abs().max() > 1e-4
    # the Python path (prefill, chunk rows) too: a 2-token prefill reads the packed copies
    small, large = _prefill(mixed, 2), _prefill(mixed, 3)
    torch.testing.assert_close(small, _prefill(want_rounded, 2), atol=1e-5, rtol=1e-5)
    assert (small - _prefill(want_fp32, 2)).abs().max() > 1e-4
    torch.testing.assert_close(large, _prefill(want_fp32, 3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_weights_engine_matches_the_rounded_model(arch: str, tmp_path: Path) -> None:
    """Three requests decoded together (a prefix-cache miss, then hits): every step's logits are
    the rounded model's own transformers forward within float32 tolerance; the model's linear
    weights hold bf16 values, and they differ from the saved fp32 ones."""
    required_native_kernels()
    path = save_tiny_model(arch, tmp_path)
    engine = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4,
                                    weights="bfloat16")  # fmt: skip
    reference = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4)
    runner = engine.runner
    assert runner.weights == "bfloat16" and runner.compact is not None
    assert runner.compact.bf16_products and runner.decode_attention == "native"
    assert "(float32, bfloat16 weights, compact forward, native decode attention)" in _runs(engine)
    head = runner.model.lm_head.weight
    assert torch.equal(head, head.to(torch.bfloat16).float())
    assert not torch.equal(head, reference.runner.model.lm_head.weight)
    prompts = [[(5 * i + 3) % 90 + 3 for i in range(n)] for n in (21, 34, 9)]
    rows: list[int] = []
    decode = runner.decode

    def spy(token_ids: list[int], batch: object) -> torch.Tensor:
        rows.append(len(token_ids))
        return decode(token_ids, batch)  # type: ignore[arg-type]

    runner.decode = spy  # type: ignore[method-assign]
    cached = 0
    for use_cache in (False, True, True):
        runs = [start(engine, ids, use_cache=use_cache) for ids in prompts]
        for _, stream in runs:  # NOTE: all three are submitted before any finishes
            next(stream)
        for _, stream in runs:
            list(stream)
        for req, _ in runs:
            assert_matches_full_forward(engine, req)
            cached += req.cached_len
    del runner.decode
    assert max(rows) == 3 and cached > 0, (rows, cached)
    engine.close()
    reference.close()


def test_bf16_weights_need_a_float32_model(tmp_path: Path) -> None:
    path = str(save_tiny_model("llama", tmp_path))
    with pytest.raises(ValueError, match="needs a float32 model"):
        Engine.from_pretrained(path, dtype="bfloat16", weights="bfloat16")
    with pytest.raises(ValueError, match="unknown weights 'float16'"):
        Engine.from_pretrained(path, weights="float16")  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_weights_within_the_bf16_tolerance_of_the_fp32_model(
    arch: str, tmp_path: Path
) -> None:
    """Against the unrounded float32 model the difference is the weights' rounding: within the
    suite's bf16 tolerance (``BF16_TOL``, 1% of the step's largest logit), tokens equal except
    at near-ties. NOTE: measured on the bundled ``tiny`` (5 prompts, 48 greedy tokens each):
    240 of 240 tokens equal, logit differences 1.8e-3 (median) to 2.7e-3 (max) of the largest."""
    path = str(save_tiny_model(arch, tmp_path))
    fp32 = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4)
    bf16 = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, weights="bfloat16")
    for ids in PROMPTS:
        assert_close_bf16(
            run(fp32, ids, 8, use_cache=False)[:2], run(bf16, ids, 8, use_cache=False)[:2]
        )
    fp32.close()
    bf16.close()
