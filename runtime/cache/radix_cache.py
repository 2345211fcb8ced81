"""Radix tree over token ids: which blocks hold the KV of which prefix, with refcounts and eviction.

It maps tokens to block ids and never touches tensors (``kv_pool`` does). Edges hold whole blocks
(``block_size`` tokens each), so every split lands on a block boundary. Each namespace (model,
revision, dtype, cache_salt) has its own root: two namespaces never share a node. Every block
also carries a chained hash (``block_hash``) that names it outside the tree (the disk tier).
Eviction is block-granular: it trims the tail of the leaf that ``eviction`` ranks first; under
an adaptive policy (``"adaptive"``, ``"adaptive-shared"``) the tree also runs one metadata-only
virtual cache per expert (a shadow ``RadixCache``, no block ids of the pool) and follows the one
that hits more.
A root exists only while its namespace holds blocks: a lookup never creates one, and
eviction (so ``flush``) drops a root whose last block went, so unique salts or keys cannot
grow memory for good.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from runtime.cache.blocks import BlockHash, EvictedBlock, Namespace, block_hash, root_hash
from runtime.cache.eviction import (
    ADAPTIVE_RULES,
    EvictionHeap,
    EvictionPolicy,
    Expert,
    ExpertScores,
)

__all__ = [
    "BlockHash",
    "EvictedBlock",
    "MatchResult",
    "Namespace",
    "RadixCache",
    "TreeNode",
    "block_hash",
    "root_hash",
]


@dataclass(slots=True, eq=False)
class TreeNode:
    """One edge of the tree: ``key`` tokens whose KV lives in ``block_ids`` (one per block)."""

    key: tuple[int, ...]
    block_ids: list[int]
    parent: TreeNode | None
    namespace: Namespace = Namespace("")
    hashes: list[BlockHash] = field(default_factory=list)
    """Chained hash of each block (same length as ``block_ids``)."""
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    ref_count: int = 0
    """Requests pinning this node or a descendant; 0 means evictable."""
    last_access: int = 0
    num_branches: int = 0
    """Children ever attached here: distinct cached sequences that extend this node."""
    priority: int = 0
    """Eviction rank (lowest first, then least recent); see ``runtime.cache.eviction``."""
    heap_seq: int = -1
    """Sequence number of this node's live eviction-heap entry (-1: none)."""

    @property
    def last_hash(self) -> BlockHash | None:
        """Hash of the node's last block (None for a root)."""
        return self.hashes[-1] if self.hashes else None


class MatchResult(NamedTuple):
    """Longest cached prefix: ``cached_len`` tokens held by ``block_ids``, ending at ``node``."""

    cached_len: int
    node: TreeNode
    block_ids: list[int]


class RadixCache:
    """Token-id radix tree with per-node refcounts and block-granular eviction of unpinned leaves.

    Under an adaptive policy (``runtime.cache.eviction.ADAPTIVE_RULES``) two shadow trees, one
    per expert, see every insert and every request's lookup (``match(..., is_request=True)``) and
    keep at most ``capacity_blocks`` blocks each (making room before each insert as the prefix
    cache does, the cached part pinned meanwhile; no other pins); their hit tokens on each lookup
    are scored and the ranking here follows the leader. Cost per request: a few more walks of
    the prompt (a lookup and, per insert, a match and an insert in each shadow) and the shadows'
    O(log n) heap work; memory: the shadows' nodes (keys and hashes, no KV), at most
    ``capacity_blocks`` blocks each.

    Args:
        block_size: Tokens per block.
        policy: One of ``runtime.cache.eviction.EVICTION_POLICIES``.
        capacity_blocks: Blocks the cache can hold (the pool's); sizes the shadows. None: the
            most blocks this tree has held so far.

    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(
        self,
        block_size: int,
        *,
        policy: EvictionPolicy = "adaptive",
        capacity_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self._roots: dict[Namespace, TreeNode] = {}
        self._tick = 0
        self._heap: EvictionHeap[TreeNode] = EvictionHeap(policy)
        self.capacity_blocks = capacity_blocks
        self._peak_blocks = 0
        self._shadows: dict[Expert, RadixCache] = {}
        self.scores: ExpertScores | None = None
        """An adaptive policy's forgetful hit scores of the shadows and the leader (else None)."""
        rule = ADAPTIVE_RULES.get(policy)
        if rule is not None:
            self._shadows = {e: RadixCache(block_size, policy=e) for e in rule.experts}
            pool_tokens = max(1, capacity_blocks or 1) * block_size
            self.scores = ExpertScores(8 * pool_tokens, rule, floor=rule.floor_pools * pool_tokens)
        self._num_shadow_ids = 0
        self._num_nodes = 0
        self.num_blocks = 0
        """Blocks referenced by the tree (in use + evictable)."""
        self.num_in_use_blocks = 0
        """Blocks in nodes with ref_count > 0."""

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (``runtime.cache.eviction``)."""
        return self._heap.policy

    @property
    def num_namespaces(self) -> int:
        """Namespaces holding at least one block (each has a root)."""
        return len(self._roots)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks in unpinned nodes (evictable leaf by leaf)."""
        return self.num_blocks - self.num_in_use_blocks

    def match(
        self, namespace: Namespace, tokens: Sequence[int], *, is_request: bool = False
    ) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` made of whole blocks.

        Args:
            is_request: A request's prompt lookup (once per request): under an adaptive policy the
                shadows look it up too and are scored on their hits.

        Side effects: bumps the access time (and eviction priority) of every node on the path,
        and splits a node when the match ends inside it (so the returned node covers exactly the
        matched tokens). A namespace with
        nothing cached gets no root: its (empty) match ends at a detached node.
        """
        if is_request and self.scores is not None:
            hits = {e: t.match(namespace, tokens).cached_len for e, t in self._shadows.items()}
            leader = self.scores.record(len(tokens), hits)
            if leader != self._heap.follow:
                self._heap.follow = leader
        node = self._roots.get(namespace) or TreeNode(
            key=(), block_ids=[], parent=None, namespace=namespace
        )
        self._tick += 1
        node.last_access = self._tick
        pos, block_ids = 0, []
        while pos + self.block_size <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + self.block_size]))
            if child is None:
                break
            n = self._shared_blocks(child.key, tokens, pos)
            if n < len(child.block_ids):
                child = self._split(child, n)
            self._heap.touch(child, self._tick)
            self._heap.update(child)
            block_ids.extend(child.block_ids)
            pos += len(child.key)
            node = child
        return MatchResult(pos, node, block_ids)

    def peek(self, namespace: Namespace, tokens: Sequence[int]) -> tuple[int, BlockHash]:
        """Longest cached whole-block prefix of ``tokens``, with no side effects.

        Unlike ``match`` it neither splits nodes nor bumps access times (the scheduler scores
        waiting requests with it).

        Returns:
            ``(cached_len, hash of the last matched block)`` (``root_hash`` when none matched),
            so a lower tier can continue the chain.
        """
        node, pos = self._roots.get(namespace), 0
        last = root_hash(namespace)
        while node is not None and pos + self.block_size <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + self.block_size]))
            if child is None:
                break
            n = self._shared_blocks(child.key, tokens, pos)
            pos += n * self.block_size
            last = child.hashes[n - 1]
            node = child if n == len(child.block_ids) else None
        return pos, last

    def insert(
        self, namespace: Namespace, tokens: Sequence[int], block_ids: list[int]
    ) -> tuple[TreeNode, list[int]]:
        """Record that ``block_ids`` hold the KV of ``tokens`` (whole blocks only).

        Where a prefix is already cached, the tree keeps its own blocks and the caller's blocks
        for that part are returned unused (the caller frees them).

        Returns:
            ``(node covering all of tokens, unused caller block ids)``.
        """
        assert len(tokens) == len(block_ids) * self.block_size, "tokens must be whole blocks"
        if tokens:
            self._root(namespace)
        matched = self.match(namespace, tokens)
        node, pos = matched.node, matched.cached_len
        unused = block_ids[: pos // self.block_size]
        if pos < len(tokens):
            new = TreeNode(
                key=tuple(tokens[pos:]),
                block_ids=block_ids[pos // self.block_size :],
                parent=node,
                namespace=namespace,
                hashes=self._chain(node, tokens, pos),
                last_access=self._tick,
            )
            self._heap.touch(new, self._tick)
            node.children[new.key[: self.block_size]] = new
            node.num_branches += 1
            self._heap.touch(node, self._tick)
            self.num_blocks += len(new.block_ids)
            self._num_nodes += 1
            self._heap.update(node)
            self._heap.update(new)
            node = new
        self._peak_blocks = max(self._peak_blocks, self.num_blocks)
        self._insert_shadows(namespace, tokens)
        return node, unused

    def _insert_shadows(self, namespace: Namespace, tokens: Sequence[int]) -> None:
        """Mirror an insert into the shadows as the prefix cache does it: the cached part pinned
        while room is made (its own tail first evicted when nothing else is left), then as many
        new blocks as fit, with fresh ids."""
        capacity = self.capacity_blocks or self._peak_blocks
        for shadow in self._shadows.values():
            found = shadow.match(namespace, tokens)
            num_new = len(tokens) // self.block_size - found.cached_len // self.block_size
            shadow.lock(found.node)
            shadow.evict(shadow.num_blocks + num_new - capacity)
            shadow.unlock(found.node)
            num_new = min(num_new, capacity - shadow.num_blocks)
            if num_new <= 0:
                continue
            end = found.cached_len + num_new * self.block_size
            ids = list(range(self._num_shadow_ids, self._num_shadow_ids + num_new))
            self._num_shadow_ids += num_new
            shadow.insert(namespace, tokens[:end], found.block_ids + ids)

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors so eviction skips them."""
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            if cur.ref_count == 0:
                self.num_in_use_blocks += len(cur.block_ids)
                cur.heap_seq = -1
            cur.ref_count += 1
            cur = cur.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``."""
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            assert cur.ref_count > 0, "unlock without lock"
            cur.ref_count -= 1
            if cur.ref_count == 0:
                self.num_in_use_blocks -= len(cur.block_ids)
                self._heap.update(cur)
            cur = cur.parent

    def evict(self, num_blocks: int) -> list[EvictedBlock]:
        """Free ``num_blocks`` blocks, tail first, from the leaves the policy ranks lowest.

        A leaf with more blocks than still needed loses only its last blocks (its head, often
        a shared system prompt, stays cached); a leaf emptied this way is removed and its
        parent may become the next candidate. O(log n) per leaf visited.

        Side effect: a namespace left without blocks loses its root.

        Returns:
            The freed blocks (maybe fewer than asked when too much is pinned), in eviction order.
        """
        freed: list[EvictedBlock] = []
        while len(freed) < num_blocks:
            leaf = self._heap.pop()
            if leaf is None:
                break
            take = min(num_blocks - len(freed), len(leaf.block_ids))
            keep = len(leaf.block_ids) - take
            base = self._depth_of(leaf)
            for i in reversed(range(keep, len(leaf.block_ids))):
                freed.append(EvictedBlock(leaf.block_ids[i], leaf.hashes[i], leaf.namespace,
                                          base + i))  # fmt: skip
            self.num_blocks -= take
            if keep:
                leaf.key = leaf.key[: keep * self.block_size]
                del leaf.block_ids[keep:], leaf.hashes[keep:]
                self._heap.update(leaf)
            else:
                self._remove_leaf(leaf)
        self._heap.compact(self._num_nodes)
        return freed

    def evict_all(self) -> list[EvictedBlock]:
        """Free every unpinned block (a reset, not a policy choice: the shadows are emptied too,
        so the policies are compared from the same empty start). Returns them as ``evict``."""
        for shadow in self._shadows.values():
            shadow.evict_all()
        return self.evict(self.num_blocks)

    def nodes_by_depth(self) -> list[tuple[TreeNode, int]]:
        """Every node but the roots, breadth first (a parent before its children), each with
        the depth of its first block (blocks before it in its chain)."""
        out: list[tuple[TreeNode, int]] = []
        level = [(c, 0) for root in self._roots.values() for c in root.children.values()]
        while level:
            out.extend(level)
            level = [(c, d + len(n.block_ids)) for n, d in level for c in n.children.values()]
        return out

    def _depth_of(self, node: TreeNode) -> int:
        """Blocks before ``node``'s first block in its chain (O(nodes on the path))."""
        depth, cur = 0, node.parent
        while cur is not None:
            depth += len(cur.block_ids)
            cur = cur.parent
        return depth

    def evict_namespace(self, namespace: Namespace) -> list[EvictedBlock]:
        """Free every unpinned block of one namespace (a tenant's cache reset); others untouched.

        A node nobody pins has no pinned descendant (a pin locks every ancestor), so each
        unpinned subtree goes whole. Side effect: the root goes when nothing stays pinned.

        Returns:
            The freed blocks (in no particular order).
        """
        for shadow in self._shadows.values():
            shadow.evict_namespace(namespace)
        root = self._roots.get(namespace)
        freed: list[EvictedBlock] = []
        stack = [root] if root is not None else []
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.ref_count > 0:
                    stack.append(child)
                    continue
                self._drop_subtree(child, freed)
                del node.children[child.key[: self.block_size]]
                self._heap.update(node)
        if root is not None and not root.children:
            del self._roots[namespace]
        self._heap.compact(self._num_nodes)
        return freed

    def _drop_subtree(self, top: TreeNode, freed: list[EvictedBlock]) -> None:
        """Forget ``top`` and its descendants (all unpinned), listing their blocks in ``freed``."""
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            freed.extend(EvictedBlock(b, h, node.namespace)
                         for b, h in zip(node.block_ids, node.hashes, strict=True))  # fmt: skip
            self.num_blocks -= len(node.block_ids)
            self._num_nodes -= 1
            node.heap_seq = -1
        top.parent = None

    def check_integrity(self) -> None:
        """Assert keys match blocks, hashes chain, refcounts and counters add up."""
        seen: set[int] = set()
        num_in_use, num_nodes, num_evictable_leaves = 0, 0, 0
        stack = list(self._roots.values())
        assert all(root.children for root in stack), "an empty namespace root is kept"
        while stack:
            node = stack.pop()
            self._check_node(node)
            assert not seen.intersection(node.block_ids), "a block is owned by two nodes"
            seen.update(node.block_ids)
            if node.ref_count > 0:
                num_in_use += len(node.block_ids)
            if node.parent is not None:
                num_nodes += 1
                is_evictable_leaf = not node.children and node.ref_count == 0
                num_evictable_leaves += is_evictable_leaf
                assert (node.heap_seq != -1) == is_evictable_leaf, "eviction heap entry drifted"
            stack.extend(node.children.values())
        assert len(seen) == self.num_blocks, f"block count {len(seen)} != {self.num_blocks}"
        assert num_in_use == self.num_in_use_blocks, "in-use block count drifted"
        assert num_nodes == self._num_nodes, "node count drifted"
        assert self._heap.num_live() == num_evictable_leaves, "heap misses an evictable leaf"
        for shadow in self._shadows.values():
            shadow.check_integrity()
            assert shadow.num_blocks <= (self.capacity_blocks or self._peak_blocks), "shadow size"

    def _check_node(self, node: TreeNode) -> None:
        bs = self.block_size
        assert len(node.key) == len(node.block_ids) * bs, "key/blocks mismatch"
        assert len(node.hashes) == len(node.block_ids), "one hash per block"
        child_refs = sum(c.ref_count for c in node.children.values())
        assert node.parent is None or node.ref_count >= child_refs, "refcount below children"
        if node.parent is not None:
            assert node.hashes == self._chain(node.parent, node.key, 0), "hash chain broken"
        for first, child in node.children.items():
            assert child.parent is node and child.key[:bs] == first, "edge"

    def _root(self, namespace: Namespace) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(
                key=(), block_ids=[], parent=None, namespace=namespace
            )
        return root

    def chain_start(self, node: TreeNode) -> BlockHash:
        """Hash the block after ``node`` chains from (``root_hash`` for a root)."""
        return node.last_hash or root_hash(node.namespace)

    def _chain(self, parent: TreeNode, tokens: Sequence[int], pos: int) -> list[BlockHash]:
        """Chained hashes of the whole blocks of ``tokens[pos:]`` following ``parent``."""
        h, out, bs = self.chain_start(parent), [], self.block_size
        for start in range(pos, len(tokens) - bs + 1, bs):
            h = block_hash(h, tokens[start : start + bs])
            out.append(h)
        return out

    def _shared_blocks(self, key: tuple[int, ...], tokens: Sequence[int], pos: int) -> int:
        """Number of whole blocks of ``key`` equal to ``tokens[pos:]``."""
        bs, n = self.block_size, 0
        end = min(len(key), len(tokens) - pos) // bs * bs
        if tuple(tokens[pos : pos + end]) == key[:end]:
            return end // bs  # NOTE: one slice compare for the common case, a whole-edge match.
        while (n + 1) * bs <= len(key) and pos + (n + 1) * bs <= len(tokens):
            if key[n * bs : (n + 1) * bs] != tuple(tokens[pos + n * bs : pos + (n + 1) * bs]):
                break
            n += 1
        return n

    def _split(self, child: TreeNode, num_blocks: int) -> TreeNode:
        """Cut ``child`` after ``num_blocks`` blocks; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < num_blocks < len(child.block_ids), "bad split"
        cut = num_blocks * self.block_size
        mid = TreeNode(
            key=child.key[:cut],
            block_ids=child.block_ids[:num_blocks],
            parent=parent,
            namespace=child.namespace,
            hashes=child.hashes[:num_blocks],
            ref_count=child.ref_count,
            last_access=child.last_access,
            num_branches=1,
            priority=child.priority,
        )
        parent.children[mid.key[: self.block_size]] = mid
        child.key, child.block_ids, child.hashes, child.parent = (
            child.key[cut:],
            child.block_ids[num_blocks:],
            child.hashes[num_blocks:],
            mid,
        )
        mid.children[child.key[: self.block_size]] = child
        self._num_nodes += 1
        return mid

    def _remove_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None, "roots are never evicted"
        del parent.children[leaf.key[: self.block_size]]
        leaf.parent = None
        self._num_nodes -= 1
        self._heap.update(parent)
        if parent.parent is None and not parent.children:
            del self._roots[parent.namespace]  # NOTE: an empty namespace costs no memory.
