"""Which cached blocks go first: the eviction policies, the lazy heap of evictable leaves, and
the scores the adaptive policies follow.

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
- ``"slru"``: segmented LRU (Karedla et al., "Caching strategies to improve disk system
  performance", IEEE Computer 1994) promoting on sharing instead of on a second hit: a node
  two or more cached sequences extended is protected, and protected leaves go only when no
  unprotected leaf is left, least recently used first within each segment. The protected
  segment is bounded by the pool alone (bounded to 0.9 of the pool it lost 0.6 points on
  average at 1/4 of the agent trace, to 0.75 of it 3.3). No aging: as under ``"shared"``, a stale
  shared prefix stays while younger unshared blocks cycle, which the adaptive policy's LRU
  expert covers (GreedyDual aging replayed worse: +4.3 points over LRU at 1/4, not +9.2).
- ``"adaptive"`` (default): ranks as LRU until ``"slru"`` has shown it hits more, then as
  whichever of the two leads, after ACME (Ari et al., "ACME: Adaptive Caching using Multiple
  Experts", WDAS 2002): each expert also runs as a virtual cache (a metadata-only shadow of the
  same capacity fed the same requests; ``RadixCache`` owns them), ``ExpertScores`` keeps each
  one's hit tokens with exponential forgetting, and the real cache ranks as the leader does. It
  starts as LRU and follows ``"slru"`` only once its score leads by 5% plus half a pool of
  tokens: the caches hold the same blocks until the first evictions, so the first divergent
  choices are made before either has scored a difference, and starting as the sharing-aware
  expert (``"adaptive-shared"``) lost up to 0.6 points to LRU at 1/8 of the agent trace.
- ``"adaptive-shared"``: the previous default, ``"lru"`` and ``"shared"`` as experts, starting
  as ``"shared"``, 10% margin, no floor (1.4 points over LRU on W3 at 1/4, where the new default
  only matches LRU, but below LRU on 8 of 37 replayed cells; README's table).

While an adaptive policy follows ``"lru"``, touches give no bonus, and the switch to it raises
the clock to the highest priority given, so everything touched since ranks above everything
before, in access order (LRU from the switch on); a switch to ``"slru"`` puts its segments above
that level, a switch back to ``"shared"`` resumes the bonuses from the clock. Keeping both
rankings in two heaps and popping from the leader's replayed worse (W3 at 1/4: 16.3% against
18.8% LRU and 19.6% shared): alternating, each undid the other's choices.

Cost: one heap push per node whose evictability or priority changes and one pop per evicted
leaf, O(log n) each; stale entries are skipped when popped and the heap is compacted once it
holds over four entries per node. The adaptive policies add their shadows' work (two more trees,
each with this heap). It knows tree nodes' counters, never tokens or tensors.
"""

from __future__ import annotations

import heapq
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar, get_args

__all__ = [
    "ADAPTIVE_RULES",
    "EVICTION_POLICIES",
    "AdaptiveRule",
    "EvictionHeap",
    "EvictionPolicy",
    "Expert",
    "ExpertScores",
    "RankedNode",
]

EvictionPolicy = Literal["adaptive", "adaptive-shared", "slru", "shared", "lru"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
Expert = Literal["lru", "shared", "slru"]
"""A policy an adaptive policy can follow (each runs as a virtual cache)."""


class AdaptiveRule(NamedTuple):
    """How an adaptive policy picks its leader (``ExpertScores``)."""

    experts: tuple[Expert, Expert]
    start: Expert
    """The leader before any score: the choice for the first evictions."""
    margin: float
    """How much more (a factor, >= 1) the other expert must score before it leads."""
    floor_pools: float
    """And by how many more tokens, in pools' worth of tokens, to lead away from ``"lru"``."""


ADAPTIVE_RULES: dict[str, AdaptiveRule] = {
    "adaptive": AdaptiveRule(("lru", "slru"), "lru", 1.05, 0.5),
    "adaptive-shared": AdaptiveRule(("lru", "shared"), "shared", 1.1, 0.0),
}
"""The adaptive policies' rules. ``"adaptive"``'s margin and floor were chosen on replays
(``runtime.bench._replay``) of the agent-sessions trace, seeds 2-13 at 1/8, 1/4 and 1/2 of its
blocks, and W3 at 1/4: margins 1.0-1.15 and floors 0.3-2 pools tried; 1.05 and 0.5 kept the most
of the gain at 1/4 with no cell below LRU (README). Held-out seeds 14-29 were not tuned on."""


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
    """Hit tokens of each expert's virtual cache, exponentially forgotten; the leader is followed.

    Each scored request first decays both scores by ``0.5 ** (prompt tokens / half_life)``, then
    adds each expert's hit tokens, so a score weighs about the last ``1.44 * half_life`` prompt
    tokens. The leader starts as ``rule.start`` and changes when the other expert scores more
    than ``margin`` times as much (follow the leader, as ACME's weights do without its
    randomness; the margin is hysteresis, since each switch to ``"lru"`` forfeits every bonus
    earned) and, when leaving ``"lru"``, ``floor`` tokens more.

    Args:
        half_life: Prompt tokens after which a hit counts half (``RadixCache`` passes 8 times its
            capacity in tokens).
        rule: The experts, the first leader, the margin (``floor_pools`` is not read here).
        floor: Tokens the other expert must lead by to take over from ``"lru"`` (``RadixCache``
            passes ``rule.floor_pools`` times its capacity in tokens).

    The half-life was chosen on replays (``runtime.bench._replay``) of the agent-sessions trace
    (seeds 2-13 at 1/8, 1/4 and 1/2 of its blocks) and W3 at 1/4, 1-128 capacities tried:
    shorter memories flipped often enough to lose up to 3 points to the better expert at 1/4;
    with ``"adaptive"``'s rule, 6 capacities put 5 cells below LRU, 8 and 12 none.

    Raises:
        ValueError: ``half_life < 1``, ``margin < 1`` or ``floor < 0``.
    """

    def __init__(self, half_life: int, rule: AdaptiveRule, *, floor: float = 0.0) -> None:
        if half_life < 1 or not rule.margin >= 1 or not floor >= 0:
            raise ValueError(
                f"need half_life >= 1, margin >= 1 and floor >= 0, got {half_life!r}, "
                f"{rule.margin!r}, {floor!r}"
            )
        self.half_life = half_life
        self.rule = rule
        self.floor = floor
        self.scores: dict[Expert, float] = dict.fromkeys(rule.experts, 0.0)
        self.leader: Expert = rule.start
        """The expert the real cache ranks as now."""

    def record(self, num_tokens: int, hits: dict[Expert, int]) -> Expert:
        """Score one request of ``num_tokens`` prompt tokens; returns the (new) leader."""
        keep = 0.5 ** (num_tokens / self.half_life)
        for expert in self.rule.experts:
            self.scores[expert] = self.scores[expert] * keep + hits[expert]
        first, second = self.rule.experts
        other = first if self.leader == second else second
        floor = self.floor if self.leader == "lru" else 0.0
        if self.scores[other] > self.scores[self.leader] * self.rule.margin + floor:
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
        rule = ADAPTIVE_RULES.get(policy)
        self._follow: Expert = rule.start if rule is not None else policy  # type: ignore[assignment]
        self._base = 0
        """The unprotected segment's priority under ``"slru"`` (the protected one's is + 1)."""
        self._top = 0
        """The highest priority given so far."""
        self._heap: list[tuple[int, int, int, N]] = []
        self._seq = 0

    @property
    def follow(self) -> Expert:
        """How touches rank now: ``"shared"`` adds the branch bonus, ``"slru"`` puts shared nodes
        in the protected segment, ``"lru"`` ranks by access alone."""
        return self._follow

    @follow.setter
    def follow(self, expert: Expert) -> None:
        """Switch ranking (adaptive policies only). Switching to ``"lru"`` raises the clock to the
        highest priority given, so every later touch ranks above every earlier one (LRU from
        here on; without it, bonuses earned before would never age while nothing with a bonus is
        evicted, and a loop that fits LRU would miss forever); switching to ``"slru"`` puts its
        segments at that level, so earlier nodes rank with its unprotected ones."""
        assert self.policy in ADAPTIVE_RULES, "only an adaptive policy switches"
        if expert != self._follow and expert in ("lru", "slru"):
            self.clock = self._base = max(self.clock, self._top)
        self._follow = expert

    def touch(self, node: N, tick: int) -> None:
        """Record an access of ``node`` at ``tick`` and rerank it (no push: see ``update``)."""
        node.last_access = tick
        if self.policy == "lru":
            return
        if self._follow == "slru":
            node.priority = self._base + (node.num_branches >= 2)
        else:
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
