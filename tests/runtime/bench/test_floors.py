"""The floors' arithmetic, checked against hand-computed cases."""

from __future__ import annotations

import itertools

import pytest

from runtime.bench.floors import Hardware, W1Shape, batching_floor_ratio

# One of everything: layer weights 1 * (1 + 2) + 1 + 3 = 7, with the logits matrix 8 weights;
# a decode step at context c reads 8 + 2c bytes and does 16 + 4c FLOPs per row.
UNIT = W1Shape(num_layers=1, hidden=1, q_width=1, kv_width=1, intermediate=1, vocab=1,
               bytes_per_value=1, bytes_per_weight=1)  # fmt: skip
BANDWIDTH_BOUND = Hardware(gemm_gflops=1e12, read_gb_s=1.0)  # FLOPs (nearly) free
COMPUTE_BOUND = Hardware(gemm_gflops=1.0, read_gb_s=1e12)  # bytes (nearly) free


def test_unit_shape_counts() -> None:
    assert UNIT.decode_bytes(3) == 14 and UNIT.decode_flops(3) == 28
    assert UNIT.prefill_flops(1, 1) == 2 * 7 + 4 * 2 + 2  # one new token seeing two keys


def test_a_bandwidth_bound_step_reads_the_weights_and_shared_prefix_once() -> None:
    # prompt 2 (1 cached), two tokens: one decode step at context 3. Alone 14 bytes per request;
    # four together read the weights and the cached key once (10) and 4 bytes per row (16).
    ratio = batching_floor_ratio(UNIT, BANDWIDTH_BOUND, clients=4, prompt=2, cached=1, completion=2)
    assert ratio == pytest.approx(4 * 14 / 26, rel=1e-6)


def test_batching_gains_nothing_where_every_part_is_compute_bound() -> None:
    ratio = batching_floor_ratio(UNIT, COMPUTE_BOUND, clients=8, prompt=5, cached=2, completion=9)
    assert ratio == pytest.approx(1.0, rel=1e-6)


def test_one_client_or_no_decode_step_is_a_ratio_of_one() -> None:
    hw = Hardware(gemm_gflops=100.0, read_gb_s=10.0)
    alone = batching_floor_ratio(UNIT, hw, clients=1, prompt=9, cached=4, completion=30)
    assert alone == pytest.approx(1.0, rel=1e-9)
    no_step = batching_floor_ratio(UNIT, hw, clients=16, prompt=9, cached=4, completion=1)
    assert no_step == pytest.approx(1.0, rel=1e-9)


def test_longer_completions_move_the_ratio_toward_the_decode_steps_ratio() -> None:
    w1 = W1Shape(30, 576, 576, 192, 1536, 49152, 4, 4)  # SmolLM2-135M's shape
    hw = Hardware(gemm_gflops=194.0, read_gb_s=36.6)
    ratios = [batching_floor_ratio(w1, hw, clients=16, prompt=1375, cached=1344, completion=c)
              for c in (1, 16, 64, 256)]  # fmt: skip
    assert ratios[0] == pytest.approx(1.0) and all(a < b for a, b in itertools.pairwise(ratios))
    assert ratios[-1] < 16  # 16 rows' step never costs what one row's does here


@pytest.mark.parametrize(
    ("clients", "prompt", "cached", "completion"),
    [(0, 2, 1, 2), (2, 0, 0, 2), (2, 2, 2, 2), (2, 2, -1, 2), (2, 2, 1, 0)],
)
def test_impossible_turns_are_refused(
    clients: int, prompt: int, cached: int, completion: int
) -> None:
    with pytest.raises(ValueError, match="need clients >= 1"):
        batching_floor_ratio(UNIT, COMPUTE_BOUND, clients=clients, prompt=prompt, cached=cached,
                             completion=completion)  # fmt: skip


def _llama() -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("weights", "kv_dtype", "layer", "head", "kv"),
    [("float32", "auto", 4, 4, 4), ("float32-packed", "float16", 4, 4, 2),
     ("bfloat16", "auto", 2, 2, 4), ("q8_0", "auto", 34 / 32, 34 / 32, 4),
     ("q4_1", "float16", 20 / 32, 34 / 32, 2), ("q4_1", "float32", 20 / 32, 34 / 32, 4),
     ("float32", "bfloat16", 4, 4, 2)],
)  # fmt: skip
def test_shape_counts_the_bytes_the_weights_are_stored_in(
    weights: str, kv_dtype: str, layer: float, head: float, kv: int
) -> None:
    """A decode step reads the layers and the logits matrix as the engine stores them (Q4_1's
    head is Q8_0, as llama.cpp's converter keeps a tied embedding) and K/V as the KV cache does."""
    shape = W1Shape.of(_llama(), weights=weights, kv_dtype=kv_dtype)
    layer_weights = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96  # q/k/v (2 KV heads of 16), o, MLP
    assert shape.layer_weights == layer_weights
    context = 10
    want = 2 * layer_weights * layer + 64 * 128 * head + 2 * 2 * 32 * context * kv
    assert shape.decode_bytes(context) == pytest.approx(want, rel=1e-12)


def test_shape_refuses_unknown_options() -> None:
    with pytest.raises(ValueError, match="unknown weights 'q4_0'"):
        W1Shape.of(_llama(), weights="q4_0")
    with pytest.raises(ValueError, match="unknown kv_dtype 'int8'"):
        W1Shape.of(_llama(), kv_dtype="int8")
