"""RopeTable: a model's rotary ``cos`` / signed ``sin`` per position, computed once and looked up.

A one-token step (a decode step, a one-token prefill) needs one row per sequence; calling the
model's ``rotary_emb`` module for it cost ~0.1 ms of a ~7 ms SmolLM2-135M Q4_1 decode step (ten
small ops). The table holds the module's own output for every position up to the furthest seen,
so a lookup returns the same numbers. It knows the rotary module, never the layers or requests.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RopeTable"]

_CHUNK = 256
"""Positions per call of the rotary module while filling the table. NOTE: ``[256, 1, D]`` is
computed exactly as a step's ``[B, 1, D]``: rows of ``D`` elements from the start of a contiguous
tensor, one thread (below torch's 32,768-element grain), so every position takes the same
vectorized path as when a step asks for it alone."""


class RopeTable:
    """``(cos, signed_sin)`` rows of positions ``[0, length)`` from ``rotary(h, positions)``.

    Args:
        rotary: The model's rotary module (transformers' ``*RotaryEmbedding``):
            ``rotary(x, position_ids [B, q]) -> (cos, sin)``, each ``[B, q, D]`` in ``x``'s dtype.
    """

    def __init__(self, rotary: Any) -> None:
        self._rotary = rotary
        self._cos = torch.empty(0)  # [length, D]
        self._sin = torch.empty(0)  # [length, D], rotate-half's sign applied (see ``signed``)

    @staticmethod
    def is_static(rotary: Any) -> bool:
        """Whether ``rotary``'s output for a position never changes: not transformers' dynamic
        or long-rope scaling, whose frequencies follow the longest position seen
        (``dynamic_rope_update``), nor per-layer-type rotary (a dict of rope types)."""
        kind = getattr(rotary, "rope_type", None)
        return isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"

    def lookup(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)``, each ``[B, 1, 1, D]`` in ``h``'s dtype, for one token per row.

        Args:
            h: ``[B, 1, hidden]`` hidden states (their dtype and device are the table's).
            positions: ``[B, 1]`` int64 absolute positions.
        """
        flat = positions.view(-1)  # [B]
        furthest = int(flat.max())
        if (
            furthest >= self._cos.shape[0]
            or self._cos.dtype != h.dtype
            or self._cos.device != h.device
        ):
            self._grow(h, furthest + 1)
        b, d = flat.shape[0], self._cos.shape[1]
        return self._cos[flat].view(b, 1, 1, d), self._sin[flat].view(b, 1, 1, d)

    def _grow(self, h: torch.Tensor, needed: int) -> None:
        """Rebuild the table for at least ``needed`` positions (doubling: O(log) rebuilds)."""
        length = max(needed, 2 * self._cos.shape[0], _CHUNK)
        cos, sin = [], []
        for start in range(0, length, _CHUNK):
            pos = torch.arange(start, min(start + _CHUNK, length), device=h.device).unsqueeze(1)
            c, s = self._rotary(h[:1, :1].expand(pos.shape[0], 1, -1), pos)  # [n, 1, D] each
            cos.append(c[:, 0])
            sin.append(signed(s[:, 0]))
        self._cos, self._sin = torch.cat(cos), torch.cat(sin)  # [length, D] each


def signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` (``[..., D]``) with rotate-half's sign: ``-sin`` on the first half, so rotating is
    ``x * cos + x.roll(D / 2) * signed``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
