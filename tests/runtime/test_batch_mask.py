"""Batch masks: the per-row 4D masks, and the probe that decides whether a model takes a mapping."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from runtime.model.batch_mask import MaskPlan, mask_plan
from tests.conftest import VOCAB_SIZE, ModelShape

TINY: ModelShape = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64,
}  # fmt: skip


def test_each_row_sees_its_own_prefix_and_window() -> None:
    plan = MaskPlan(window=None, per_layer_type=True, sliding_window=2, is_bool=True)
    masks = plan.build(torch.tensor([1, 3]), kv_len=4, dtype=torch.float32)
    assert masks["full_attention"].shape == (2, 1, 1, 4)
    assert masks["full_attention"][:, 0, 0].tolist() == [
        [True, True, False, False],  # row 0 is at position 1: positions 2, 3 are its padding
        [True, True, True, True],
    ]
    assert masks["sliding_attention"][:, 0, 0].tolist() == [
        [True, True, False, False],
        [False, False, True, True],  # window 2: keys 2 and 3 only
    ]


def test_float_masks_are_additive() -> None:
    plan = MaskPlan(window=None, per_layer_type=False, sliding_window=None, is_bool=False)
    mask = plan.build(torch.tensor([0]), kv_len=2, dtype=torch.float32)
    assert mask[0, 0, 0, 0] == 0 and mask[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_mixed_layer_model_that_applies_the_mapping_batches() -> None:
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    for impl in ("sdpa", "eager"):
        # NOTE: transformers leaves from_config unannotated.
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation=impl
        )
        plan, why = mask_plan(model)
        assert why is None and plan is not None and plan.per_layer_type
        assert plan.is_bool == (impl == "sdpa")


def test_mixed_layer_types_on_a_model_that_ignores_the_mapping_stay_at_batch_one() -> None:
    # Llama's forward takes no mask mapping; give its config mixed layer types to reach the probe.
    config = LlamaConfig(**TINY)
    config.layer_types = ["full_attention", "sliding_attention"]
    config.sliding_window = 4
    # NOTE: transformers leaves from_config unannotated.
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    plan, why = mask_plan(model)
    assert plan is None and why is not None and "mask mapping" in why
