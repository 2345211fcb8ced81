"""RopeTable: a one-token step's rotary rows, looked up, equal the rotary module's own output.

The table is filled by the model's ``rotary_emb`` module in chunks of positions; a step asks for
one position per row. The two must give the same bits (the decode path's RoPE, cache on or off),
for every static RoPE kind, in fp32 and bf16, across the table's growth; kinds whose frequencies
follow the sequence length (dynamic NTK, long-rope) are never tabled.
"""

from __future__ import annotations

from typing import Unpack

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from runtime.model.rope_table import RopeTable, signed
from tests.conftest import ModelShape

SHAPE: ModelShape = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 2048}


def rotary(**rope: Unpack[RopeParameters]) -> LlamaRotaryEmbedding:
    """transformers' Llama rotary module with ``rope_parameters`` ``rope`` (theta 10,000)."""
    params: RopeParameters = {"rope_theta": 1e4, **rope}
    return LlamaRotaryEmbedding(LlamaConfig(**SHAPE, rope_parameters=params))


STATIC: dict[str, RopeParameters] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(STATIC))
def test_lookup_equals_the_rotary_module(kind: str, dtype: torch.dtype) -> None:
    module = rotary(**STATIC[kind])
    assert RopeTable.is_static(module)
    table = RopeTable(module)
    # NOTE: 0, then past the first chunk (growth), then a batch of rows at scattered positions.
    for rows in ([[0]], [[300]], [[5], [1023], [77]], [[1500], [1500]]):
        positions = torch.tensor(rows)  # [B, 1]
        h = torch.zeros(len(rows), 1, SHAPE["hidden_size"], dtype=dtype)
        cos, sin = module(h, positions)  # [B, 1, D] each
        got_cos, got_sin = table.lookup(h, positions)
        assert got_cos.dtype == dtype and got_cos.shape == (len(rows), 1, 1, cos.shape[-1])
        assert torch.equal(got_cos, cos.unsqueeze(2))
        assert torch.equal(got_sin, signed(sin).unsqueeze(2))


def test_signed_flips_the_first_half() -> None:
    assert signed(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-1.0, -2.0, 3.0, 4.0]


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_kinds_are_not_tabled(kind: str) -> None:
    module = rotary(rope_type="default")
    module.rope_type = kind  # NOTE: only the kind is read; building these needs more parameters
    assert not RopeTable.is_static(module)
