"""Batch KV: one preallocated buffer whose rows are the KV caches of the running requests.

llama.cpp-style slots: running request ``i`` owns row ``i`` (rows stay compact). Prefill writes
one row through a ``RequestKVCache`` row view; a decode step writes every row's new K/V at that
row's own position and reads all rows at once. It knows nothing about tokens, the tree or policy.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache

from runtime.model.attention import StepSlots
from runtime.model.kv_cache import OwnedLayer, RequestKVCache

__all__ = ["BatchKV"]

_log = logging.getLogger(__name__)


class _CachedPrefix(NamedTuple):
    """A row's leading positions ``[0, length)`` as copied from prefix-cache pool blocks."""

    blocks: tuple[int, ...]
    block_size: int
    length: int

    def common(self, other: _CachedPrefix) -> int:
        """Positions both rows copied from the same blocks (0 when none)."""
        if self.block_size != other.block_size:
            return 0
        same = 0
        for mine, theirs in zip(self.blocks, other.blocks, strict=False):
            if mine != theirs:
                break
            same += 1
        return min(same * self.block_size, self.length, other.length)


_NO_PREFIX = _CachedPrefix((), 0, 0)


class _StepLayer(OwnedLayer):  # type: ignore[no-untyped-call]
    """One layer of a decode step over rows ``[0, n)`` (each row writes one position)."""

    def __init__(self, owner: BatchKV, layer_idx: int) -> None:
        super().__init__(layer_idx)
        self.owner = owner

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.write_step(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.step_kv_len - 1


class _StepCache(Cache):
    """The transformers ``Cache`` a batched decode step runs on."""

    def __init__(self, owner: BatchKV, num_layers: int) -> None:
        self.owner = owner
        super().__init__(layers=[_StepLayer(owner, i) for i in range(num_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # NOTE: positions before this step (what a model asks when it builds its own mask).
        return self.owner.step_kv_len - 1


class BatchKV:
    """KV rows of all running requests in one tensor, bounded by a byte budget.

    ``buffer`` has shape ``[L, 2 (K/V), max_rows, H_kv, capacity, D]``; rows ``[0, num_rows)``
    are live and row ``i``'s positions ``[0, rows[i].length)`` are valid. A decode step reads
    every live row up to the longest one, the rest masked, so masked padding must be finite (a
    NaN there would leak through ``0 * v``): before each step, a row that was added, moved or
    reallocated since the last one has its positions ``[length, capacity)`` zeroed
    (``begin_step``). The buffer itself is allocated uninitialized, so the pages of rows never
    used are never touched (``bytes_allocated`` is address space; resident memory follows the
    rows in use).

    Args:
        budget_bytes: the buffer never holds more than this many bytes.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int,
    ) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        self.position_bytes = num_layers * 2 * num_kv_heads * head_dim * elem
        """Bytes of one position of one row across every layer."""
        self.budget_bytes = budget_bytes
        # buffer: [L, 2, max_rows, H_kv, capacity, D]
        self.buffer = torch.zeros(
            (num_layers, 2, 0, num_kv_heads, 0, head_dim), dtype=dtype, device=device
        )
        self.rows: list[RequestKVCache] = []
        self._reserved: list[int] = []
        self._prefixes: list[_CachedPrefix] = []
        """Per row: the prefix-cache blocks its leading positions were copied from."""
        self._padded: list[bool] = []
        """Per row: whether its positions past its length are known zero (``begin_step``)."""
        self._sharing: tuple[torch.Tensor, torch.Tensor] | None = None
        """``share_plan``'s ``(src, shared)`` for the rows now (None: not computed yet)."""
        self._is_any_shared = False
        """Whether some row shares a prefix in ``_sharing`` (read by ``step_slots``)."""
        self.num_grows = 0
        self.num_shrinks = 0
        """Times ``release_idle`` handed a burst's buffer back."""
        self.step_kv_len = 0
        self._step_rows = torch.zeros(0, dtype=torch.long)
        self._step_pos = torch.zeros(0, dtype=torch.long)
        self.step_cache = _StepCache(self, num_layers)

    @property
    def num_rows(self) -> int:
        """Live rows (running requests)."""
        return len(self.rows)

    @property
    def bytes_allocated(self) -> int:
        """Bytes of the buffer now (always <= ``budget_bytes``)."""
        return self.buffer.numel() * self.buffer.element_size()

    def can_fit(self, total_len: int, *, num_rows: int = 1) -> bool:
        """Whether ``num_rows`` more rows of ``total_len`` positions fit next to the others."""
        need_cap = max([total_len, *self._reserved])
        return (self.num_rows + num_rows) * need_cap * self.position_bytes <= self.budget_bytes

    def add_row(self, total_len: int) -> RequestKVCache:
        """A new row able to hold ``total_len`` positions; call ``can_fit`` first.

        Returns:
            A ``RequestKVCache`` viewing the row (length 0), for prefill and the prefix cache.
        """
        assert self.can_fit(total_len), "add_row over the KV budget"
        self._ensure(self.num_rows + 1, max([total_len, *self._reserved]))
        row = self.num_rows
        kv = RequestKVCache(
            num_layers=self.buffer.shape[0],
            num_kv_heads=self.buffer.shape[3],
            head_dim=self.buffer.shape[5],
            capacity=0,
            dtype=self.buffer.dtype,
            device=self.buffer.device,
            buffer=self.buffer[:, :, row],
            grow=self._grow_row,
        )
        self.rows.append(kv)
        self._reserved.append(total_len)
        self._prefixes.append(_NO_PREFIX)
        self._padded.append(False)
        self._sharing = None
        return kv

    def reserve(self, num_rows: int, total_len: int, *, up_to: int | None = None) -> None:
        """Make room for ``num_rows`` rows in all (live ones included) of up to ``total_len``
        positions in one reallocation, when that fits the budget (else nothing: rows are then
        added as the budget allows, ``can_fit``); with ``up_to``, room for up to that many rows
        where the budget allows (requests still arriving), never fewer than ``num_rows``.

        Raises:
            RuntimeError: the allocator refused even ``num_rows`` rows (torch's out-of-memory
                error); a refused headroom falls back to ``num_rows`` rows instead.
        """
        need_cap = max([total_len, *self._reserved])
        per_row = need_cap * self.position_bytes
        if num_rows <= self.num_rows or num_rows * per_row > self.budget_bytes:
            return
        rows = max(num_rows, min(up_to or num_rows, self.budget_bytes // per_row))
        try:
            self._ensure(rows, need_cap)
        except RuntimeError:
            # NOTE: the headroom is address space the requests in hand do not need (under
            # strict overcommit, or a budget above free memory, it can be refused).
            if rows == num_rows:
                raise
            _log.warning("agentcache: batch KV headroom of %d rows refused; reserving %d",
                         rows, num_rows)  # fmt: skip
            self._ensure(num_rows, need_cap)

    def share_prefix(self, kv: RequestKVCache, blocks: Sequence[int], block_size: int,
                     length: int) -> None:  # fmt: skip
        """Record that ``kv``'s positions ``[0, length)`` were copied from the prefix cache's
        pool blocks ``blocks`` (in order, ``block_size`` positions each) and stay as copied.

        Rows that copied the same leading blocks hold the same bytes there for as long as both
        live (their requests pin the blocks: nothing evicts or rewrites them), so a decode step
        reads those positions once for all of them (``step_slots``; the native kernel), with
        the same result within float32 rounding. The caller must not record positions it will
        overwrite (the prompt's last position, which prefill recomputes).
        """
        index = next(i for i, row in enumerate(self.rows) if row is kv)
        usable = min(length, len(blocks) * block_size)
        self._prefixes[index] = _CachedPrefix(tuple(blocks), block_size, usable)
        self._sharing = None

    def share_like(self, kv: RequestKVCache, source: RequestKVCache) -> None:
        """Record for ``kv`` what ``share_prefix`` recorded for ``source``, after ``source``'s
        positions were copied into ``kv`` (the choices of one prompt, ``n > 1``)."""
        index = {id(row): i for i, row in enumerate(self.rows)}
        self._prefixes[index[id(kv)]] = self._prefixes[index[id(source)]]
        self._sharing = None

    def common_prefix(self, rows: Sequence[RequestKVCache]) -> int:
        """Leading positions that all of ``rows`` copied from the same prefix-cache blocks
        (``share_prefix``): the same bytes in each row; 0 for fewer than two rows."""
        if len(rows) < 2:
            return 0
        index = {id(kv): i for i, kv in enumerate(self.rows)}
        first = self._prefixes[index[id(rows[0])]]
        return min(first.common(self._prefixes[index[id(kv)]]) for kv in rows[1:])

    def share_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, shared)``, ``[num_rows]`` int64 each: row ``i``'s positions
        ``[0, shared[i])`` hold the same bytes as row ``src[i]``'s (``share_prefix``).

        Each row points at the earliest row with which it shares the longest run of leading
        blocks (itself and 0 when none), so rows sharing one system prompt all point at the
        first of them. A trie over block ids: O(rows x blocks) dict steps, recomputed only when
        rows come or go (NOTE: comparing every pair took 7.4 ms for 64 rows of 81 blocks, about
        a whole 64-row decode step of the bundled tiny model).
        """
        if self._sharing is None:
            src, shared = [], []
            tries: dict[int, dict[int, tuple[int, dict[Any, Any]]]] = {}
            for i, mine in enumerate(self._prefixes):
                kids = tries.setdefault(mine.block_size, {})
                best, depth = i, 0
                for d, block in enumerate(mine.blocks):
                    node = kids.get(block)
                    if node is None:
                        node = kids[block] = (i, {})
                    else:
                        best, depth = node[0], d + 1
                    kids = node[1]
                n = min(depth * mine.block_size, mine.length, self._prefixes[best].length)
                src.append(best if n else i)
                shared.append(n)
            self._sharing = (torch.tensor(src, dtype=torch.long),
                             torch.tensor(shared, dtype=torch.long))  # fmt: skip
            self._is_any_shared = any(shared)
        return self._sharing

    def remove_row(self, index: int) -> None:
        """Free row ``index``; the last row moves into it (same swap as the caller's list).

        Nothing is zeroed here: the moved row's positions past its length (the freed request's
        data there, possibly non-finite if it failed) are zeroed before the next decode step,
        as is a later row added in a freed slot (``begin_step``).
        """
        last = self.num_rows - 1
        if index != last:
            moved = self.rows[last]
            # NOTE: only the valid positions move; one row copy per finished request.
            live_len = moved.length
            self.buffer[:, :, index, :, :live_len].copy_(self.buffer[:, :, last, :, :live_len])
            moved.buffer = self.buffer[:, :, index]
            self.rows[index], self._reserved[index] = moved, self._reserved[last]
            self._prefixes[index] = self._prefixes[last]
            self._padded[index] = False
        self.rows.pop()
        self._reserved.pop()
        self._prefixes.pop()
        self._padded.pop()
        self._sharing = None

    def empty_like(self) -> BatchKV:
        """A new, empty batch with this one's geometry, dtype, device and budget."""
        _, _, _, h, _, d = self.buffer.shape
        return BatchKV(num_layers=self.buffer.shape[0], num_kv_heads=h, head_dim=d,
                       dtype=self.buffer.dtype, device=self.buffer.device,
                       budget_bytes=self.budget_bytes)  # fmt: skip

    def release_idle(self) -> bool:
        """Hand a burst's buffer back once no row is live (the scheduler calls this after it
        has been idle ``SchedulerConfig.idle_release_s``); True when it was released.

        The buffer only grows while requests run, so a concurrency peak would otherwise hold its
        bytes for good. It is not released the moment the last row leaves: under steady load
        every wave of requests would regrow it row by row (1, 2, 4, ... rows, each a zeroed
        copy: 19% of the scheduler thread at 16 clients in ``bench load``). A one-row buffer
        stays, so one-by-one use never reallocates.
        """
        if not self.holds_idle_rows:
            return False
        l_, two, _, h, _, d = self.buffer.shape
        self.buffer = self.buffer.new_zeros((l_, two, 0, h, 0, d))
        self.num_shrinks += 1
        return True

    @property
    def holds_idle_rows(self) -> bool:
        """Whether ``release_idle`` would release something now."""
        return not self.rows and self.buffer.shape[2] > 1

    def begin_step(self, positions: torch.Tensor, kv_len: int | None = None) -> None:
        """Prepare a decode step: row ``i`` writes its new K/V at ``positions[i]`` (``[n]``).

        Args:
            kv_len: keys ``[0, kv_len)`` are read (default: through the furthest position); an
                idle row's scratch write may lie past it.
        """
        n = int(positions.shape[0])
        assert n == self.num_rows, "a decode step covers every live row"
        self._zero_padding()
        if self._step_rows.shape[0] != n:  # NOTE: kept while the batch size holds (read only)
            self._step_rows = torch.arange(n, device=self.buffer.device)
        self._step_pos = positions.to(self.buffer.device)
        self.step_kv_len = int(positions.max().item()) + 1 if kv_len is None else kv_len

    def _zero_padding(self) -> None:
        """Zero positions ``[length, capacity)`` of each row not known to be zero there."""
        for i, kv in enumerate(self.rows):
            if not self._padded[i]:
                self.buffer[:, :, i, :, kv.length :].zero_()
                self._padded[i] = True

    def end_step(self, idle: Collection[int] = ()) -> None:
        """Commit the decode step: every row but the ``idle`` ones grew by one position."""
        for i, kv in enumerate(self.rows):
            if i not in idle:
                kv.advance(1)

    def step_slots(self) -> StepSlots:
        """Where ``write_step`` writes this step (for the C++ layer loop; see ``StepSlots``)."""
        src, shared = self.share_plan()
        if not self._is_any_shared:
            return StepSlots(self.buffer, self._step_rows, self._step_pos, self.step_kv_len)
        # NOTE: a step reads keys [0, step_kv_len) only; an idle row (mid-prefill) may have
        # shared positions past it, which the kernel would refuse, failing the whole batch.
        shared = shared.clamp(max=self.step_kv_len)
        return StepSlots(
            self.buffer, self._step_rows, self._step_pos, self.step_kv_len, src, shared
        )

    def write_step(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[n, H_kv, 1, D]`` keys/values of one layer, each row at its own position.

        Returns:
            ``[n, H_kv, step_kv_len, D]`` views of every row's keys and values (no copy).
        """
        n, end = keys.shape[0], self.step_kv_len
        k_buf, v_buf = self.buffer[layer_idx, 0], self.buffer[layer_idx, 1]
        # NOTE: an fp16 buffer rounds here (to nearest even), as every other write does
        k_buf[self._step_rows, :, self._step_pos] = keys[:, :, 0].to(k_buf.dtype)
        v_buf[self._step_rows, :, self._step_pos] = values[:, :, 0].to(v_buf.dtype)
        return k_buf[:n, :, :end], v_buf[:n, :, :end]

    def check_integrity(self) -> None:
        """Assert the budget holds and every live row fits its reservation."""
        assert self.bytes_allocated <= self.budget_bytes, "batch KV over its byte budget"
        assert len(self.rows) == len(self._reserved) <= self.buffer.shape[2], "row table"
        for kv, reserved in zip(self.rows, self._reserved, strict=True):
            assert kv.length <= reserved <= self.buffer.shape[4], "row past its reservation"
        assert len(self._prefixes) == len(self._padded) == len(self.rows), "prefix table"
        src, shared = self.share_plan()
        for i, (j, n) in enumerate(zip(src.tolist(), shared.tolist(), strict=True)):
            mine, theirs = self.buffer[:, :, i, :, :n], self.buffer[:, :, j, :, :n]
            assert n <= self.rows[i].length and torch.equal(mine, theirs), "shared prefix drifted"

    def _grow_row(self, total_len: int) -> None:
        raise AssertionError(f"row grew to {total_len} positions past its admission reservation")

    def _ensure(self, num_rows: int, capacity: int) -> None:
        """Reallocate (geometrically where the budget allows) to hold rows x capacity."""
        _, _, max_rows, _, cap, _ = self.buffer.shape
        if num_rows <= max_rows and capacity <= cap:
            return
        grow_rows = max(num_rows, max_rows, 2 * max_rows if num_rows > max_rows else 0)
        grow_cap = max(capacity, cap, 2 * cap if capacity > cap else 0)
        # NOTE: when doubling both does not fit the budget, rows come first (a burst), then
        # capacity, each grown as far toward doubling as the budget allows, never below what
        # was asked (the caller checked that it fits). Growing to the exact size reallocated
        # again at the very next row or position, each time a zeroed copy of every live row:
        # a burst of 16 long prompts grew row by row (3.1 s of a 4.9 s first step on W1 at
        # 1,300 tokens), and with a 1 GiB budget at 1,378 tokens (16 rows fit, 18 do not) 9 ->
        # 10 -> ... -> 16 rows, 0.7-1.0 s each, then 1,378 -> 1,379 positions for one prompt.
        rows, length, per_position = grow_rows, grow_cap, self.position_bytes
        if rows * length * per_position > self.budget_bytes:
            rows = max(num_rows, min(grow_rows, self.budget_bytes // (capacity * per_position)))
            length = max(capacity, min(grow_cap, self.budget_bytes // (rows * per_position)))
        l_, two, _, h, _, d = self.buffer.shape
        # NOTE: uninitialized (no page is touched until a row uses it); the live rows' new
        # padding is zeroed before the next step (begin_step).
        new = torch.empty(
            (l_, two, rows, h, length, d), dtype=self.buffer.dtype, device=self.buffer.device
        )
        for i, kv in enumerate(self.rows):
            new[:, :, i, :, : kv.length].copy_(self.buffer[:, :, i, :, : kv.length])
            kv.buffer = new[:, :, i]
            kv.num_grows += 1
            self._padded[i] = False
        self.buffer = new
        self.num_grows += 1
