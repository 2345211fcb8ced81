"""KV pool: fixed-size block tensors for the prefix cache, a free list and byte accounting.

It knows block ids and tensor layout, never tokens or the tree (that is ``radix_cache``).
Blocks are written once when a prefix is inserted and only read afterwards (copy-out), so a
request that reuses a block can never mutate it.
"""

from __future__ import annotations

import torch

__all__ = ["KVPool", "contiguous_runs"]


def contiguous_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Group block ids into runs of consecutive ids.

    Returns:
        ``(position_in_list, first_block_id, run_len)`` per run, so one copy serves a whole run.
    """
    runs: list[tuple[int, int, int]] = []
    for i, bid in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == bid:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, bid, 1))
    return runs


class KVPool:
    """Preallocated block storage for all layers at once.

    ``data`` has shape ``[num_layers, 2 (K/V), num_kv_heads, num_blocks, block_size, head_dim]``
    so a run of consecutive blocks is one strided slice across every layer: gathering a matched
    prefix costs one ``copy_`` per run, not one per layer per block.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        budget_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_size = block_size
        self.block_bytes = num_layers * 2 * num_kv_heads * block_size * head_dim * elem
        self.num_blocks = max(0, budget_bytes // self.block_bytes)
        # data: [L, 2, H_kv, num_blocks, block_size, D]; torch.empty so untouched pages stay lazy.
        self.data = torch.empty(
            (num_layers, 2, num_kv_heads, self.num_blocks, block_size, head_dim),
            dtype=dtype,
            device=device,
        )
        assert self.data.numel() * elem == self.num_blocks * self.block_bytes, "byte accounting"
        self._free: list[int] = list(range(self.num_blocks))
        self._is_free = [True] * self.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not holding any cached tokens."""
        return len(self._free)

    @property
    def bytes_total(self) -> int:
        """Bytes of the whole pool tensor."""
        return self.num_blocks * self.block_bytes

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` free blocks exist right now."""
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` free blocks, lowest ids first so runs stay contiguous.

        Returns:
            The block ids, or None when not enough are free (nothing is taken then).
        """
        if num_blocks > len(self._free):
            return None
        self._free.sort(reverse=True)
        taken = [self._free.pop() for _ in range(num_blocks)]
        for bid in taken:
            self._is_free[bid] = False
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the free list."""
        for bid in block_ids:
            assert not self._is_free[bid], f"double free of block {bid}"
            self._is_free[bid] = True
            self._free.append(bid)

    def read_into(self, block_ids: list[int], dst: torch.Tensor) -> None:
        """Copy blocks into a request buffer.

        Args:
            block_ids: blocks in token order.
            dst: ``[L, 2, H_kv, len(block_ids) * block_size, D]`` view to fill.
        """
        blocks = self._as_blocks(dst, len(block_ids))
        for pos, first, n in contiguous_runs(block_ids):
            blocks[:, :, :, pos : pos + n].copy_(self.data[:, :, :, first : first + n])

    def write_from(self, block_ids: list[int], src: torch.Tensor) -> None:
        """Fill freshly allocated blocks from a request buffer.

        Args:
            block_ids: blocks in token order.
            src: ``[L, 2, H_kv, len(block_ids) * block_size, D]`` view to store.
        """
        blocks = self._as_blocks(src, len(block_ids))
        for pos, first, n in contiguous_runs(block_ids):
            self.data[:, :, :, first : first + n].copy_(blocks[:, :, :, pos : pos + n])

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block as ``read_block`` returns it: ``[L, 2, H_kv, block_size, D]``."""
        l_, two, h, _, bs, d = self.data.shape
        return (l_, two, h, bs, d)

    def read_block(self, block_id: int) -> torch.Tensor:
        """A copy of one block, ``[L, 2, H_kv, block_size, D]`` (safe to keep after a free)."""
        return self.data[:, :, :, block_id].clone()

    def write_block(self, block_id: int, block: torch.Tensor) -> None:
        """Fill an allocated block from a ``[L, 2, H_kv, block_size, D]`` tensor."""
        self.data[:, :, :, block_id].copy_(block)

    def _as_blocks(self, span: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """``[L, 2, H, n * bs, D]`` -> ``[L, 2, H, n, bs, D]`` view (a split never copies)."""
        l_, two, h, _, d = span.shape
        return span.view(l_, two, h, num_blocks, self.block_size, d)

    def check_integrity(self) -> None:
        """Assert the free list and the free flags agree and hold no duplicates."""
        assert len(set(self._free)) == len(self._free), "duplicate ids in the free list"
        assert sum(self._is_free) == len(self._free), "free flags disagree with the free list"
        assert all(self._is_free[b] for b in self._free), "a listed free block is marked used"
