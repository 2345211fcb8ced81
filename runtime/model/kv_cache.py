"""Per-request KV cache: one preallocated buffer for all layers, written in place, read as views.

A transformers ``Cache`` so any HF causal LM can run on it. Unlike ``DynamicCache`` (one
``torch.cat`` per layer per step), decoding N tokens writes N slices and copies the whole cache
only when the buffer grows (geometrically). It knows nothing about the prefix cache or the tree.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["OwnedLayer", "RequestKVCache"]


class OwnedLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A transformers cache layer whose tensors live in an owner's preallocated buffer.

    Never lazily allocates, resets or crops: subclasses route ``update`` to their owner.
    """

    def __init__(self, layer_idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def reset(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} is never reset; make a new cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not crop")


class _BufferLayer(OwnedLayer):  # type: ignore[no-untyped-call]
    """One model layer's view into the request buffer (full attention semantics).

    NOTE: sliding-window layers also use this class: the whole KV is kept and the model's own
    sliding mask hides what is out of the window, so resuming from any prefix stays exact.
    """

    def __init__(self, owner: RequestKVCache, layer_idx: int) -> None:
        super().__init__(layer_idx)
        # NOTE: a weak reference, so a released cache is freed by reference counting at once.
        # A strong one made a cycle (cache -> layers -> owner) that only the cyclic GC breaks,
        # and until it ran each dead row view kept a whole batch KV buffer alive (after a
        # 64-client burst: 215 MB of the tiny model's rows, still resident seconds later).
        self.owner: RequestKVCache = weakref.proxy(owner)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = self.owner.write(self.layer_idx, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.length


class RequestKVCache(Cache):
    """KV of one sequence (batch 1) for every layer.

    ``buffer`` has shape ``[num_layers, 2 (K/V), num_kv_heads, capacity, head_dim]``; positions
    ``[0, length)`` are valid. A forward step writes its ``q`` new positions at ``[length,
    length + q)`` in every layer, then the caller commits them with ``advance(q)``, so every layer
    of one step sees the same offset.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        buffer: torch.Tensor | None = None,
        grow: Callable[[int], None] | None = None,
    ) -> None:
        # buffer: [L, 2, H_kv, capacity, D]; a row view of a BatchKV when ``buffer`` is given.
        if buffer is None:
            shape = (num_layers, 2, num_kv_heads, max(1, capacity), head_dim)
            buffer = torch.empty(shape, dtype=dtype, device=device)
        self.buffer = buffer
        self._grow = grow
        """Set for a row view: growing is the owner's job (it rebinds ``buffer``)."""
        self.length = 0
        self.num_grows = 0
        super().__init__(layers=[_BufferLayer(self, i) for i in range(num_layers)])

    @property
    def capacity(self) -> int:
        """Positions the buffer holds before it must grow."""
        return int(self.buffer.shape[3])

    def reserve(self, total_len: int) -> None:
        """Make room for ``total_len`` positions, at least doubling when it grows."""
        if total_len <= self.capacity:
            return
        if self._grow is not None:
            self._grow(total_len)
            return
        new_cap = max(total_len, 2 * self.capacity)
        shape = (*self.buffer.shape[:3], new_cap, self.buffer.shape[4])
        grown = torch.empty(shape, dtype=self.buffer.dtype, device=self.buffer.device)
        grown[:, :, :, : self.length].copy_(self.buffer[:, :, :, : self.length])
        self.buffer = grown
        self.num_grows += 1

    def write(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[1, H_kv, q, D]`` keys/values at the current offset of one layer.

        Returns:
            ``[1, H_kv, length + q, D]`` views of that layer's keys and values (no copy).
        """
        start, end = self.length, self.length + keys.shape[-2]
        assert end <= self.capacity, "reserve() before the forward step"
        layer = self.buffer[layer_idx]
        layer[0, :, start:end].copy_(keys[0])
        layer[1, :, start:end].copy_(values[0])
        return layer[0, :, :end].unsqueeze(0), layer[1, :, :end].unsqueeze(0)

    def advance(self, num_tokens: int) -> None:
        """Commit the positions written by the last forward step."""
        assert self.length + num_tokens <= self.capacity, "advance past the buffer"
        self.length += num_tokens

    def span(self, start: int, end: int) -> torch.Tensor:
        """``[L, 2, H_kv, end - start, D]`` view of positions ``[start, end)`` (no copy)."""
        return self.buffer[:, :, :, start:end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length
