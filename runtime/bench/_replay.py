"""Replay a request trace against the prefix cache without a model: hit rates per policy and Belady.

A trace is the ``(prompt ids, prompt + generated ids)`` of each request in order. ``replay`` drives
the real ``PrefixCache`` (radix tree, eviction policy, pool; optionally the disk tier) on a toy
one-number-per-token pool, as the scheduler would for sequential requests; ``belady`` computes the
offline-optimal hit rate for the same trace and capacity. Knows no model, threads or HTTP.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from runtime.cache.disk_tier import DISK_HEADER_BYTES, DiskPolicy, DiskTier
from runtime.cache.eviction import EvictionPolicy
from runtime.cache.kv_pool import KVPool
from runtime.cache.prefix_cache import PrefixCache, namespace_of
from runtime.cache.radix_cache import BlockHash, block_hash, root_hash

__all__ = [
    "ReplayResult",
    "Step",
    "agent_sessions",
    "belady",
    "distinct_blocks",
    "make_disk",
    "replay",
    "toy_pool",
]

Step = tuple[list[int], list[int]]
"""One request: (prompt token ids, prompt + generated token ids)."""
_NS = namespace_of("replay", None, "float32", None)


class ReplayResult(NamedTuple):
    """Hit rate (cached / prompt tokens), disk share of it, mean pool fill (used / total)."""

    hit_rate: float
    disk_hit_rate: float
    mean_fill: float


class _Buffer:
    """The smallest ``KVBuffer``: one float per position per (layer, K/V, head, dim) of 1."""

    def __init__(self, capacity: int) -> None:
        self.data = torch.zeros((1, 2, 1, capacity, 1))  # [L, 2, H, T, D]
        self.length = 0

    def reserve(self, total_len: int) -> None:
        assert total_len <= self.data.shape[3], "replay buffer too small"

    def span(self, start: int, end: int) -> torch.Tensor:
        return self.data[:, :, :, start:end]


def toy_pool(capacity_blocks: int, block_size: int) -> KVPool:
    """A pool of ``capacity_blocks`` blocks of one fp32 number per token (K and V)."""
    return KVPool(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size,
                  budget_bytes=capacity_blocks * 2 * block_size * 4, dtype=torch.float32,
                  device=torch.device("cpu"))  # fmt: skip


def replay(
    steps: Sequence[Step],
    *,
    capacity_blocks: int,
    block_size: int,
    policy: EvictionPolicy,
    disk: DiskTier | None = None,
    disk_policy: DiskPolicy = "write-through",
) -> ReplayResult:
    """Run ``steps`` one after another through a real ``PrefixCache`` of ``capacity_blocks``
    (with ``disk`` below it under ``disk_policy``, when given)."""
    pc = PrefixCache(toy_pool(capacity_blocks, block_size), is_enabled=True,
                     disabled_reason=None, policy=policy, disk=disk,
                     disk_policy=disk_policy)  # fmt: skip
    cached, total, fills = 0, 0, []
    for prompt, full in steps:
        kv = _Buffer(len(full) + block_size)
        hit = pc.match(_NS, prompt, kv, use_cache=True)
        kv.length = len(prompt)
        node = pc.insert(_NS, prompt, kv, hit.node)
        kv.length = len(full)
        pc.release(pc.insert(_NS, full, kv, node))
        if disk is not None:
            disk.drain()
        cached, total = cached + hit.cached_len, total + len(prompt)
        fills.append(pc.radix.num_blocks / max(1, pc.pool.num_blocks))
        pc.check_integrity() if len(fills) % 64 == 0 else None
    pc.check_integrity()
    disk_rate = pc.disk_hit_tokens / total if total else 0.0
    return ReplayResult(cached / total, disk_rate, sum(fills) / len(fills))


def _chain(ids: Sequence[int], block_size: int) -> list[BlockHash]:
    h, out = root_hash(_NS), []
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = block_hash(h, ids[start : start + block_size])
        out.append(h)
    return out


def distinct_blocks(steps: Sequence[Step], block_size: int) -> int:
    """Whole blocks the trace stores in all (a budget of this many never evicts)."""
    return len({h for _, full in steps for h in _chain(full, block_size)})


def belady(steps: Sequence[Step], *, capacity_blocks: int, block_size: int) -> float:
    """Offline-optimal token hit rate: evict the block whose next use is furthest (or never).

    A block is a hit only when its whole prefix is cached; a child is never used before its
    parent, so evicting furthest-next-use first (deeper first on ties) keeps the cache
    prefix-closed, and the rule is optimal per block (Belady, with bypass of useless blocks).
    """
    prompts = [_chain(p, block_size) for p, _ in steps]
    uses: dict[BlockHash, list[int]] = defaultdict(list)
    for i, chain in enumerate(prompts):
        for h in chain:
            uses[h].append(i)
    never = len(steps)
    cache: dict[BlockHash, tuple[int, int]] = {}  # hash -> (next use, depth)
    cached, total = 0, 0
    for i, (prompt, full) in enumerate(steps):
        n = 0
        while n < len(prompts[i]) and prompts[i][n] in cache:
            n += 1
        cached += min(n * block_size, len(prompt) - 1)
        total += len(prompt)
        for depth, h in enumerate(_chain(full, block_size)):
            times = uses.get(h, [])
            k = bisect.bisect_right(times, i)
            cache[h] = (times[k] if k < len(times) else never, depth)
        excess = len(cache) - capacity_blocks
        if excess > 0:
            drop = heapq.nlargest(excess, cache.items(), key=lambda kv: kv[1])
            for h, _ in drop:
                del cache[h]
    return cached / total if total else 0.0


def make_disk(path: Path, capacity_blocks: int, block_size: int) -> DiskTier:
    """A disk tier of ``capacity_blocks`` toy blocks under ``path`` (for ``replay``)."""
    pool = toy_pool(1, block_size)
    return DiskTier(path, budget_bytes=capacity_blocks * (pool.block_bytes + DISK_HEADER_BYTES),
                    fingerprint="replay", block_shape=pool.block_shape,
                    dtype=torch.float32)  # fmt: skip


def agent_sessions(
    *, num_agents: int = 4, prefix_len: int = 1500, sessions: int = 6, turns: int = 6, seed: int = 2
) -> list[Step]:
    """A multi-session agent trace: several agents, each with a long shared system + tools prefix.

    Sessions of every agent run interleaved (a random live session takes each next turn); a
    turn appends a user message (20-60 tokens), often a tool result (50-200), and the reply
    (10-40 generated tokens) to that session's history, append-only.
    """
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    prefixes = [toks(prefix_len) for _ in range(num_agents)]
    histories = [list(prefixes[a]) for a in range(num_agents) for _ in range(sessions)]
    left = [turns] * len(histories)
    steps: list[Step] = []
    while any(left):
        i = rng.choice([i for i, n in enumerate(left) if n])
        history = histories[i]
        history += toks(rng.randrange(20, 60))
        if rng.random() < 0.6:
            history += toks(rng.randrange(50, 200))
        prompt = list(history)
        history += toks(rng.randrange(10, 40))
        steps.append((prompt, list(history)))
        left[i] -= 1
    return steps
