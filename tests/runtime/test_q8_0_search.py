"""Q8_0's per-block scale search (``runtime.model.kernels._q8_0``): never a larger squared error
than ggml's reference rounding (``gguf.quants``, computed here), on Gaussian blocks and on
blocks of Q4_1 values (our float32 SmolLM2 is its Q4_1 file dequantized); blocks dequantized
and quantized again come back byte for byte; the bytes stay GGUF's Q8_0 (``|q| <= 127``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from runtime.model.kernels import dequantize_weight, quantize_weight
from runtime.model.kernels._q8_0 import quantize_q8_0, reference_q8_0

Q8, Q4 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1
Maker = Callable[[int, int], np.ndarray]


def gaussian(rows: int, seed: int) -> np.ndarray:
    """``[rows, 256]`` float32, rows of different magnitudes (as a layer's weights)."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.001, 0.2, (rows, 1))
    return (rng.standard_normal((rows, 256)) * scale).astype(np.float32)


def q4_1_values(rows: int, seed: int) -> np.ndarray:
    """Gaussian rows rounded to Q4_1 by gguf (each block ``m + d i``, ``i`` in 0..15)."""
    return dequantize(quantize(gaussian(rows, seed), Q4), Q4).astype(np.float32)


def block_errors(values: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """``[blocks]`` float64 squared error of each 32-value block's Q8_0 values."""
    held = dequantize(blocks, Q8).astype(np.float64)
    errors: np.ndarray = ((held - values.astype(np.float64)) ** 2).reshape(-1, 32).sum(1)
    return errors


@pytest.mark.parametrize("make", [gaussian, q4_1_values])
def test_error_is_never_above_the_reference(make: Maker) -> None:
    """Per block at most gguf's reference error, in total strictly less."""
    values = make(96, 1)
    ours = block_errors(values, quantize_q8_0(values))
    reference = block_errors(values, quantize(values, Q8))
    assert (ours <= reference).all()
    assert ours.sum() < reference.sum()


def test_q4_1_values_gain_more_than_gaussian_ones() -> None:
    """Blocks of 16 evenly spaced values leave room that Gaussian blocks do not: the search's
    grid-aligned scales reduce their error further (ratios against the reference)."""
    ratios = []
    for values in (gaussian(96, 2), q4_1_values(96, 2)):
        ours = block_errors(values, quantize_q8_0(values)).sum()
        ratios.append(ours / block_errors(values, quantize(values, Q8)).sum())
    assert ratios[1] < ratios[0] < 1.0


def test_reference_is_ggufs_bit_for_bit() -> None:
    """``reference_q8_0`` (the search's starting point, kept on ties) equals gguf's bytes, also
    where ``x / d`` lands on a half (rounded away from zero)."""
    rng = np.random.default_rng(4)
    values = rng.standard_normal((64, 32)).astype(np.float32)
    values[:8] = (rng.integers(-127, 127, (8, 32)) + 0.5).astype(np.float32)
    values[:8, 0] = 127.0
    d, q = reference_q8_0(torch.from_numpy(values))
    raw = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], 1)
    assert np.array_equal(raw.numpy(), quantize(values, Q8))


@pytest.mark.parametrize("make", [gaussian, q4_1_values])
def test_blocks_quantized_again_are_the_same(make: Maker) -> None:
    values = make(64, 3)
    blocks = quantize_q8_0(values)
    held = dequantize(blocks, Q8).astype(np.float32)
    assert np.array_equal(quantize_q8_0(held), blocks)


def test_reference_blocks_stay_as_they_are() -> None:
    """Blocks written by gguf / llama.cpp's converter (reference rounding) quantize to
    themselves: a GGUF file's Q8_0 values keep the file's bytes."""
    blocks = quantize(gaussian(64, 5), Q8)
    held = dequantize(blocks, Q8).astype(np.float32)
    assert np.array_equal(quantize_q8_0(held), blocks)


def test_blocks_with_a_common_factor_and_zeros() -> None:
    """Values ``d q`` whose integers share a factor (13; 3 with an odd fp16 ``d``), a zero block
    and a block of one value, and the first two again with four leading zeros: exact, and the
    same bytes the second time."""
    d = np.float32(np.float16(0.0029))
    rng = np.random.default_rng(6)
    values = np.zeros((4, 32), dtype=np.float32)
    values[0] = d * 13 * rng.integers(-9, 10, 32)
    values[1] = np.float32(np.float16(0.0011)) * 3 * rng.integers(-42, 43, 32)
    values[3] = 0.25
    values = np.concatenate([values, values[:2]])
    values[4:, :4] = 0  # NOTE: a row's first four values bound its divisor unless all are 0
    blocks = quantize_q8_0(values)
    assert np.array_equal(dequantize(blocks, Q8).astype(np.float32), values)
    assert np.array_equal(quantize_q8_0(dequantize(blocks, Q8).astype(np.float32)), blocks)


def test_integers_stay_in_ggmls_range() -> None:
    """``|q| <= 127`` (never -128), the scale an fp16 number; what llama.cpp reads the same."""
    values = np.concatenate([gaussian(32, 7), q4_1_values(32, 7), -gaussian(32, 7)])
    raw = quantize_q8_0(values).reshape(-1, 34)
    q = raw[:, 2:].view(np.int8)
    assert q.min() >= -127 and q.max() <= 127
    assert np.isfinite(raw[:, :2].copy().view(np.float16)).all()


def test_quantize_weight_uses_the_search() -> None:
    weight = torch.from_numpy(q4_1_values(16, 8))
    blocks = quantize_weight(weight, "q8_0")
    assert np.array_equal(blocks.reshape(16, -1).numpy(), quantize_q8_0(weight.numpy()))
    assert not np.array_equal(blocks.reshape(16, -1).numpy(), quantize(weight.numpy(), Q8))
    assert torch.equal(quantize_weight(dequantize_weight(blocks), "q8_0"), blocks)


def test_threads_are_restored() -> None:
    """The search runs on one thread and gives torch its thread count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        quantize_q8_0(gaussian(4, 9))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
