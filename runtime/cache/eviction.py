"""Which cached blocks go first: the eviction policies, the lazy heap of evictable leaves, and
the scores ``"adaptive"`` follows.

Policies (``EVICTION_POLICIES``):

- ``"lru"``: least recently used leaf first.
- ``"shared"``: sharing-aware with dynamic aging (GreedyDual with unit cost, as in LFU-DA). A
  node's priority is ``clock + branches - 1``, set whenever a request touches it, where
  ``branches`` counts the distinct cached sequences that ever extended the node (children attached
  to it: a system prompt used by six sessions has six, a conversation tail one) and ``clock`` is
  the priority of the last evicted entry. The lowest priority goes first, least recently used
  among equals, so shared prefixes outlive single-use tails touched at the same time, and the
  rising clock ages out shared prefixes nobody touches any more. Counting branches rather than
  hits keeps a long session's own history (hit by each of its turns) from looking shared.
- ``"adaptive"`` (default): follows whichever of the two wins on the current workload, after
  ACME (Ari et al., "ACME: Adaptive Caching using Multiple Experts", WDAS 2002): each policy also
  runs as a virtual cache (a metadata-only shadow of the same capacity fed the same requests;
  ``RadixCache`` owns them), ``ExpertScores`` keeps each one's hit tokens with exponential
  forgetting, and the real cache ranks as the leader does. The heap is ``"shared"``'s either
  way: while ``"lru"`` leads, touches give no branch bonus, and the switch to it raises the
  clock to the highest priority given, so everything touched since ranks above everything
  before, in access order (LRU from the switch on); a switch back to ``"shared"`` resumes the
  bonuses from that clock. Keeping both rankings in two heaps and popping from the leader's
  replayed worse (W3 at 1/4: 16.3% against 18.8% LRU and 19.6% shared): alternating, each undid
  the other's choices. ``"lru"`` leads when protected prefixes no longer fit and starve the
  sessions' own histories (small budgets) or sharing stops (a loop that fits the cache, which
  ``"shared"`` misses forever: the clock never rises past a bonus while nothing with one is
  evicted), ``"shared"`` when shared prefixes pay.

Cost: one heap push per node whose evictability or priority changes and one pop per evicted
leaf, O(log n) each; stale entries are skipped when popped and the heap is compacted once it
holds over four entries per node. ``"adaptive"`` adds its shadows' work (two more trees, each with
this heap). It knows tree nodes' counters, never tokens or tensors.
"""

from __future__ import annotations

import heapq
from typing import Any, Generic, Literal, Protocol, TypeVar, get_args

__all__ = [
    "EVICTION_POLICIES",
    "EXPERTS",
    "EvictionHeap",
    "EvictionPolicy",
    "Expert",
    "ExpertScores",
    "RankedNode",
]

EvictionPolicy = Literal["adaptive", "shared", "lru"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
Expert = Literal["lru", "shared"]
"""A policy ``"adaptive"`` can follow (each runs as a virtual cache)."""
EXPERTS: tuple[Expert, ...] = get_args(Expert)


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


class ExpertScores:
    """Hit tokens of each policy's virtual cache, exponentially forgotten; the leader is followed.

    Each scored request first decays both scores by ``0.5 ** (prompt tokens / half_life)``, then
    adds each policy's hit tokens, so a score weighs about the last ``1.44 * half_life`` prompt
    tokens. The leader starts as ``"shared"`` and changes when the other policy scores more than
    ``margin`` times as much (follow the leader, as ACME's weights do without its randomness;
    the margin is hysteresis, since each switch to ``"lru"`` forfeits every bonus earned).

    Args:
        half_life: Prompt tokens after which a hit counts half (``RadixCache`` passes 8 times its
            capacity in tokens).
        margin: How much more the other policy must score before it leads (>= 1).

    Both defaults were chosen on replays (``runtime.bench._replay``) of the agent-sessions
    trace (seeds 2-13 at 1/8, 1/4 and 1/2 of its blocks) and W3 at 1/4, half-lives of 1-128
    capacities and margins 1-1.3 tried: shorter memories or no margin flipped often enough to
    lose up to 3 points to the better policy at 1/4; 8 capacities and 1.1 lost none there.

    Raises:
        ValueError: ``half_life < 1`` or ``margin < 1``.
    """

    def __init__(self, half_life: int, *, margin: float = 1.1) -> None:
        if half_life < 1 or not margin >= 1:
            raise ValueError(f"need half_life >= 1 and margin >= 1, got {half_life!r}, {margin!r}")
        self.half_life = half_life
        self.margin = margin
        self.scores: dict[Expert, float] = dict.fromkeys(EXPERTS, 0.0)
        self.leader: Expert = "shared"
        """The policy the real cache ranks as now."""

    def record(self, num_tokens: int, hits: dict[Expert, int]) -> Expert:
        """Score one request of ``num_tokens`` prompt tokens; returns the (new) leader."""
        keep = 0.5 ** (num_tokens / self.half_life)
        for expert in EXPERTS:
            self.scores[expert] = self.scores[expert] * keep + hits[expert]
        other: Expert = "lru" if self.leader == "shared" else "shared"
        if self.scores[other] > self.scores[self.leader] * self.margin:
            self.leader = other
        return self.leader


class EvictionHeap(Generic[N]):
    """Min-heap of evictable leaves keyed by ``(priority, last_access)``, lazily invalidated.

    A node's live entry is the one whose sequence number equals ``node.heap_seq``; every other
    entry of that node is stale. ``update`` must be called after any change to a node's
    children, pin count or access counters.

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; valid: {EVICTION_POLICIES}")
        self.policy = policy
        self.clock = 0
        """Priority of the last evicted entry (the aging floor of ``"shared"``)."""
        self._follow: Expert = "lru" if policy == "lru" else "shared"
        self._top = 0
        """The highest priority given so far."""
        self._heap: list[tuple[int, int, int, N]] = []
        self._seq = 0

    @property
    def follow(self) -> Expert:
        """How touches rank now: ``"shared"`` adds the branch bonus, ``"lru"`` does not."""
        return self._follow

    @follow.setter
    def follow(self, expert: Expert) -> None:
        """Switch ranking (``"adaptive"`` only). Switching to ``"lru"`` raises the clock to the
        highest priority given, so every later touch ranks above every earlier one (LRU from
        here on; without it, bonuses earned before would never age while nothing with a bonus is
        evicted, and a loop that fits LRU would miss forever)."""
        assert self.policy == "adaptive", "only the adaptive policy switches"
        if expert == "lru" and self._follow != "lru":
            self.clock = max(self.clock, self._top)
        self._follow = expert

    def touch(self, node: N, tick: int) -> None:
        """Record an access of ``node`` at ``tick`` and rerank it (no push: see ``update``)."""
        node.last_access = tick
        if self.policy != "lru":
            bonus = max(node.num_branches - 1, 0) if self._follow == "shared" else 0
            node.priority = self.clock + bonus
            self._top = max(self._top, node.priority)

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
