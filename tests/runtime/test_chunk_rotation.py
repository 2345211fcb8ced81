"""Re-rotation is exact: a chunk computed alone at position 0 and moved equals the same chunk
computed alone at its target position (no cross-chunk attention, so only positions differ).

RoPE attention depends on relative positions only, so every layer's hidden states of a chunk run
on its own are the same at any offset; its keys differ by one rotation and its values not at all.
Models without RoPE (GPT-2) are refused with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import CacheLayerMixin

from runtime.chunks.rotation import rerotate, rotation_blocker
from tests.conftest import save_tiny_model

TOL = 1e-4
CHUNK = [5, 17, 23, 42, 8, 8, 61, 30, 12, 77, 3, 90]


def _kv_at(model: torch.nn.Module, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``([1, H_kv, n, D], [1, H_kv, n, D])`` K/V of CHUNK run alone at ``start``."""
    cache = DynamicCache()
    positions = torch.arange(start, start + len(CHUNK)).unsqueeze(0)
    with torch.no_grad():
        model(input_ids=torch.tensor([CHUNK]), position_ids=positions, cache=cache, use_cache=True)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        assert isinstance(layer, CacheLayerMixin), "an attention layer's cache"
        assert layer.keys is not None and layer.values is not None
        kv.append((layer.keys, layer.values))
    return kv


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("target", [1, 37, 1500])
def test_moved_chunk_equals_chunk_computed_at_target(
    arch: str, target: int, tmp_path: Path
) -> None:
    # NOTE: transformers leaves PreTrainedModel.eval unannotated.
    path = save_tiny_model(arch, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # type: ignore[no-untyped-call]
    assert rotation_blocker(model) is None
    at_zero, at_target = _kv_at(model, 0), _kv_at(model, target)
    for layer, ((k0, v0), (kt, vt)) in enumerate(zip(at_zero, at_target, strict=True)):
        moved = rerotate(model, k0, target)
        assert (moved - kt).abs().max().item() <= TOL, f"layer {layer}: keys"
        assert (v0 - vt).abs().max().item() <= TOL, f"layer {layer}: values"
        assert (rerotate(model, moved, -target) - k0).abs().max().item() <= TOL  # and back
    # NOTE: the test can fail: unmoved keys differ from the target's by far more than TOL.
    assert (at_zero[0][0] - at_target[0][0]).abs().max().item() > 100 * TOL


def test_model_without_rope_is_refused(tmp_path: Path) -> None:
    path = save_tiny_model("gpt2", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # type: ignore[no-untyped-call]
    why = rotation_blocker(model)
    assert why is not None and "no rotary position embedding" in why
    with pytest.raises(ValueError, match="cannot re-rotate keys"):
        rerotate(model, torch.zeros(1, 2, 3, 8), 5)
