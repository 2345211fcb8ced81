"""Attention masks for batched decode: which models can batch rows of different lengths, and how.

Each row's query sits at its own position, so the 4D mask hides that row's padding (and what is
out of a sliding window). Models whose layers need masks this module cannot build exactly get
no plan, and the scheduler runs them at batch size 1. It knows nothing about caches or requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MaskPlan", "mask_plan"]

# NOTE: model types that apply ``config.sliding_window`` to every layer without ``layer_types``
# (transformers 5.x MistralModel picks create_sliding_window_causal_mask for all layers).
_ALL_SLIDING_TYPES = {"mistral", "mixtral"}
_MASK_DTYPES = {"sdpa": "bool", "eager": "float"}


@dataclass(frozen=True, slots=True)
class MaskPlan:
    """How to mask a batched decode step for one model."""

    window: int | None
    """Sliding window of every layer (None: full attention), when ``per_layer_type`` is False."""
    per_layer_type: bool
    """True: pass ``{"full_attention": ..., "sliding_attention": ...}`` (mixed layers)."""
    sliding_window: int | None
    """The window of ``sliding_attention`` layers when ``per_layer_type``."""
    is_bool: bool
    """SDPA takes a bool mask (True = attend); eager takes an additive float mask."""

    def build(self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype) -> Any:
        """Mask(s) for queries at ``positions`` (``[n]``) over keys ``[0, kv_len)``.

        Returns:
            ``[n, 1, 1, kv_len]`` mask, or a dict of them keyed by layer type.
        """
        if self.per_layer_type:
            return {
                "full_attention": self._one(positions, kv_len, None, dtype),
                "sliding_attention": self._one(positions, kv_len, self.sliding_window, dtype),
            }
        return self._one(positions, kv_len, self.window, dtype)

    def _one(
        self, positions: torch.Tensor, kv_len: int, window: int | None, dtype: torch.dtype
    ) -> torch.Tensor:
        keys = torch.arange(kv_len, device=positions.device).unsqueeze(0)  # [1, kv]
        query = positions.unsqueeze(1)  # [n, 1]
        allowed = keys <= query  # [n, kv]; positions past a row's length are its padding
        if window is not None:
            # Same rule as transformers' sliding_window_overlay: kv_idx > q_idx - window.
            allowed &= keys > query - window
        allowed = allowed[:, None, None, :]  # [n, 1, 1, kv]
        if self.is_bool:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )


def mask_plan(model: Any) -> tuple[MaskPlan | None, str | None]:
    """A ``MaskPlan`` for ``model``, or ``(None, why)`` when it must decode at batch size 1."""
    config = model.config
    text = config.get_text_config(decoder=True)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _MASK_DTYPES:
        return None, f"attention implementation {impl!r} takes no 4D padding mask here"
    is_bool = _MASK_DTYPES[impl] == "bool"
    window = getattr(text, "sliding_window", None)
    kinds = set(getattr(text, "layer_types", None) or [])
    if kinds and kinds <= {"full_attention"}:
        return MaskPlan(None, False, None, is_bool), None
    if kinds == {"full_attention", "sliding_attention"} or kinds == {"sliding_attention"}:
        plan = MaskPlan(None, True, window, is_bool)
        if not isinstance(window, int) or not _honours_mask_mapping(model, plan):
            return None, f"layer types {sorted(kinds)} without a per-type mask mapping"
        return plan, None
    if kinds:
        return None, f"layer types {sorted(kinds)} need masks this runtime does not build"
    if window is None:
        return MaskPlan(None, False, None, is_bool), None
    if getattr(text, "model_type", "") in _ALL_SLIDING_TYPES and isinstance(window, int):
        return MaskPlan(window, False, None, is_bool), None
    return None, f"sliding_window={window!r} on model type {text.model_type!r} is not understood"


@torch.no_grad()
def _honours_mask_mapping(model: Any, plan: MaskPlan) -> bool:
    """Probe: does ``model`` apply a dict of masks keyed by layer type (two 2-token forwards)?

    Runs tokens ``[0, 1]`` once with causal masks and once with token 0 hidden from token 1 in
    every layer type. A model that applies the mapping gives token 1 different logits; one that
    rejects a dict raises, and one that ignores it gives the same logits: both mean "no".
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = torch.tensor([[0, 1]], device=device)
    causal = torch.tensor([[True, False], [True, True]], device=device)  # [q, kv]
    hidden = torch.tensor([[True, False], [False, True]], device=device)  # token 1 sees itself
    logits = []
    for allowed in (causal, hidden):
        mask = allowed[None, None]  # [1, 1, q, kv]
        if not plan.is_bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        mapping = {"full_attention": mask, "sliding_attention": mask}
        try:
            out = model(input_ids=ids, attention_mask=mapping, use_cache=False)
        except Exception:  # noqa: BLE001 - any failure means the mapping is not supported
            return False
        logits.append(out.logits[0, 1].float())
    return not torch.allclose(logits[0], logits[1])
