"""Move a chunk's cached keys to new positions: the exact re-rotation under rotary embeddings.

Under RoPE a key at position ``p`` is ``R(p) k`` where ``R`` rotates each pair of dimensions by
``p * inv_freq``; rotations compose, ``R(p + d) = R(d) R(p)``, so keys stored at ``p`` become keys
at ``p + d`` by one more rotation by ``d``; values carry no position. This holds when
``inv_freq`` is fixed and cos/sin are not rescaled (``default``, ``linear`` and ``llama3`` RoPE in
transformers); it does not for ``dynamic`` (``inv_freq`` depends on the length) or types with an
attention scaling factor (``yarn``, ``longrope``), nor for models without RoPE: for those
``rotation_blocker`` names the reason. This is the first piece of chunk reuse beyond the prefix
(issue 17); it knows tensors and the model's rotary module, never requests or caches.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["rerotate", "rotation_blocker"]

_COMPOSABLE = frozenset({"default", "linear", "llama3"})


def _rotary(model: Any) -> Any:
    inner = getattr(model, "model", None)
    return getattr(inner, "rotary_emb", None)


def rotation_blocker(model: Any) -> str | None:
    """Why stored keys of ``model`` cannot be moved exactly to other positions, or None."""
    rotary = _rotary(model)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        kind = getattr(getattr(model, "config", None), "model_type", None)
        return f"model type {kind!r} has no rotary position embedding (model.model.rotary_emb)"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in _COMPOSABLE:
        supported = sorted(_COMPOSABLE)
        return f"rope_type {rope_type!r} does not compose by rotation (supported: {supported})"
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return f"RoPE attention scaling {rotary.attention_scaling} rescales cos/sin"
    return None


@torch.no_grad()
def rerotate(model: Any, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys stored at positions ``p`` as keys at ``p + delta`` (every position moves by ``delta``).

    Args:
        model: The transformers model whose rotary module produced ``keys``.
        keys: ``[..., n, head_dim]`` rotated keys (any leading dims: layers, heads).
        delta: Position shift in tokens (may be negative).

    Returns:
        A new tensor, same shape and dtype; the rotation is computed in fp32.

    Raises:
        ValueError: ``rotation_blocker(model)`` names a reason.
    """
    why = rotation_blocker(model)
    if why is not None:
        raise ValueError(f"cannot re-rotate keys: {why}")
    inv_freq = _rotary(model).inv_freq.to(device=keys.device, dtype=torch.float32)  # [D/2]
    # NOTE: the angle in float64, as delta * inv_freq loses digits in fp32 for large shifts.
    angle = (torch.tensor(float(delta), dtype=torch.float64) * inv_freq.double()).float()
    emb = torch.cat((angle, angle))  # [D], the rotate-half layout of transformers' Llama
    cos, sin = emb.cos(), emb.sin()
    k = keys.float()
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return (k * cos + rotated * sin).to(keys.dtype)
