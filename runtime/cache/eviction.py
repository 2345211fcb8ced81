"""Which cached blocks go first: the eviction policies and the lazy heap of evictable leaves.

Policies (``EVICTION_POLICIES``):

- ``"lru"``: least recently used leaf first.
- ``"shared"`` (default): sharing-aware with dynamic aging (GreedyDual with unit cost, as in
  LFU-DA). A node's priority is ``clock + branches - 1``, set whenever a request touches it, where
  ``branches`` counts the distinct cached sequences that ever extended the node (children attached
  to it: a system prompt used by six sessions has six, a conversation tail one) and ``clock`` is
  the priority of the last evicted entry. The lowest priority goes first, least recently used
  among equals, so shared prefixes outlive single-use tails touched at the same time, and the
  rising clock ages out shared prefixes nobody touches any more. Counting branches rather than
  hits keeps a long session's own history (hit by each of its turns) from looking shared.

Cost: one heap push per node whose evictability or priority changes and one pop per evicted
leaf, O(log n) each; stale entries are skipped when popped and the heap is compacted once it
holds over four entries per node. It knows tree nodes' counters, never tokens or tensors.
"""

from __future__ import annotations

import heapq
from typing import Any, Generic, Literal, Protocol, TypeVar, get_args

__all__ = ["EVICTION_POLICIES", "EvictionHeap", "EvictionPolicy", "RankedNode"]

EvictionPolicy = Literal["shared", "lru"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)


class RankedNode(Protocol):
    """What the heap reads and writes on a tree node (``radix_cache.TreeNode`` has it all).

    A Protocol, so this module never imports the tree that uses it.
    """

    @property
    def parent(self) -> Any: ...
    @property
    def children(self) -> dict[Any, Any]: ...
    @property
    def ref_count(self) -> int: ...
    @property
    def num_branches(self) -> int: ...

    last_access: int
    priority: int
    heap_seq: int


N = TypeVar("N", bound=RankedNode)


class EvictionHeap(Generic[N]):
    """Min-heap of evictable leaves keyed by ``(priority, last_access)``, lazily invalidated.

    A node's live entry is the one whose sequence number equals ``node.heap_seq``; every other
    entry of that node is stale. ``update`` must be called after any change to a node's
    children, pin count or access counters.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; valid: {EVICTION_POLICIES}")
        self.policy = policy
        self.clock = 0
        """Priority of the last evicted entry (the aging floor of ``"shared"``)."""
        self._heap: list[tuple[int, int, int, N]] = []
        self._seq = 0

    def touch(self, node: N, tick: int) -> None:
        """Record an access of ``node`` at ``tick`` and rerank it (no push: see ``update``)."""
        node.last_access = tick
        if self.policy == "shared":
            node.priority = self.clock + max(node.num_branches - 1, 0)

    def update(self, node: N) -> None:
        """Give ``node`` a live entry if it is an evictable leaf, else invalidate its entries."""
        if node.parent is None or node.children or node.ref_count > 0:
            node.heap_seq = -1
            return
        self._seq += 1
        node.heap_seq = self._seq
        heapq.heappush(self._heap, (node.priority, node.last_access, self._seq, node))

    def pop(self) -> N | None:
        """Remove and return the evictable leaf to go first (None when there is none)."""
        while self._heap:
            priority, _, seq, node = heapq.heappop(self._heap)
            if seq == node.heap_seq:
                node.heap_seq = -1
                self.clock = max(self.clock, priority)
                return node
        return None

    def compact(self, num_nodes: int) -> None:
        """Drop stale entries once they outnumber live nodes four to one (amortized O(1))."""
        if len(self._heap) > 4 * num_nodes + 64:
            self._heap = [e for e in self._heap if e[2] == e[3].heap_seq]
            heapq.heapify(self._heap)

    def num_live(self) -> int:
        """Live entries (evictable leaves); O(heap size), for integrity checks."""
        return sum(1 for e in self._heap if e[2] == e[3].heap_seq)
