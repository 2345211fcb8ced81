"""Radix tree over token ids: which blocks hold the KV of which prefix, with refcounts and LRU.

It maps tokens to block ids and never touches tensors (``kv_pool`` does). Edges hold whole blocks
(``block_size`` tokens each), so every split lands on a block boundary. Each namespace (model,
revision, dtype, cache_salt) has its own root: two namespaces never share a node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

__all__ = ["MatchResult", "Namespace", "RadixCache", "TreeNode"]

Namespace = NewType("Namespace", str)
"""Hex digest of (model id, revision, dtype, cache_salt); see ``prefix_cache.namespace_of``."""


@dataclass(slots=True, eq=False)
class TreeNode:
    """One edge of the tree: ``key`` tokens whose KV lives in ``block_ids`` (one per block)."""

    key: tuple[int, ...]
    block_ids: list[int]
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    ref_count: int = 0
    """Requests pinning this node or a descendant; 0 means evictable."""
    last_access: int = 0


class MatchResult(NamedTuple):
    """Longest cached prefix: ``cached_len`` tokens held by ``block_ids``, ending at ``node``."""

    cached_len: int
    node: TreeNode
    block_ids: list[int]


class RadixCache:
    """Token-id radix tree with per-node refcounts and LRU eviction of unpinned leaves.

    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._roots: dict[Namespace, TreeNode] = {}
        self._tick = 0
        self.num_blocks = 0
        """Blocks referenced by the tree (in use + evictable)."""
        self.num_in_use_blocks = 0
        """Blocks in nodes with ref_count > 0."""

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks in unpinned nodes (evictable leaf by leaf)."""
        return self.num_blocks - self.num_in_use_blocks

    def match(self, namespace: Namespace, tokens: list[int]) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` made of whole blocks.

        Side effects: bumps the LRU time of every node on the path, and splits a node when the
        match ends inside it (so the returned node covers exactly the matched tokens).
        """
        node = self._root(namespace)
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
            child.last_access = self._tick
            block_ids.extend(child.block_ids)
            pos += len(child.key)
            node = child
        return MatchResult(pos, node, block_ids)

    def peek(self, namespace: Namespace, tokens: list[int]) -> int:
        """Length of the longest cached whole-block prefix of ``tokens``, with no side effects.

        Unlike ``match`` it neither splits nodes nor bumps LRU times (the scheduler scores
        waiting requests with it).
        """
        node, pos = self._roots.get(namespace), 0
        while node is not None and pos + self.block_size <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + self.block_size]))
            if child is None:
                break
            n = self._shared_blocks(child.key, tokens, pos)
            pos += n * self.block_size
            node = child if n == len(child.block_ids) else None
        return pos

    def insert(
        self, namespace: Namespace, tokens: list[int], block_ids: list[int]
    ) -> tuple[TreeNode, list[int]]:
        """Record that ``block_ids`` hold the KV of ``tokens`` (whole blocks only).

        Where a prefix is already cached, the tree keeps its own blocks and the caller's blocks
        for that part are returned unused (the caller frees them).

        Returns:
            ``(node covering all of tokens, unused caller block ids)``.
        """
        assert len(tokens) == len(block_ids) * self.block_size, "tokens must be whole blocks"
        matched = self.match(namespace, tokens)
        node, pos = matched.node, matched.cached_len
        unused = block_ids[: pos // self.block_size]
        if pos < len(tokens):
            new = TreeNode(
                key=tuple(tokens[pos:]),
                block_ids=block_ids[pos // self.block_size :],
                parent=node,
                last_access=self._tick,
            )
            node.children[new.key[: self.block_size]] = new
            self.num_blocks += len(new.block_ids)
            node = new
        return node, unused

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors so eviction skips them."""
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            if cur.ref_count == 0:
                self.num_in_use_blocks += len(cur.block_ids)
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
            cur = cur.parent

    def evict(self, num_blocks: int) -> list[int]:
        """Drop least recently used unpinned leaves until ``num_blocks`` blocks are freed.

        Returns:
            The freed block ids (maybe fewer than asked when too much is pinned), in eviction order.
        """
        heap = [(n.last_access, i, n) for i, n in enumerate(self._leaves()) if n.ref_count == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        counter = len(heap)
        while heap and len(freed) < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None, "roots are never evicted"
            del parent.children[leaf.key[: self.block_size]]
            freed.extend(leaf.block_ids)
            self.num_blocks -= len(leaf.block_ids)
            if parent.parent is not None and not parent.children and parent.ref_count == 0:
                counter += 1
                heapq.heappush(heap, (parent.last_access, counter, parent))
        return freed

    def check_integrity(self) -> None:
        """Assert keys match blocks, refcounts are consistent and counters add up."""
        seen: set[int] = set()
        num_in_use = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            assert len(node.key) == len(node.block_ids) * self.block_size, "key/blocks mismatch"
            child_refs = sum(c.ref_count for c in node.children.values())
            assert node.parent is None or node.ref_count >= child_refs, "refcount below children"
            assert not seen.intersection(node.block_ids), "a block is owned by two nodes"
            seen.update(node.block_ids)
            if node.ref_count > 0:
                num_in_use += len(node.block_ids)
            for first, child in node.children.items():
                assert child.parent is node and child.key[: self.block_size] == first, "edge"
                stack.append(child)
        assert len(seen) == self.num_blocks, f"block count {len(seen)} != {self.num_blocks}"
        assert num_in_use == self.num_in_use_blocks, "in-use block count drifted"

    def _root(self, namespace: Namespace) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(key=(), block_ids=[], parent=None)
        return root

    def _shared_blocks(self, key: tuple[int, ...], tokens: list[int], pos: int) -> int:
        """Number of whole blocks of ``key`` equal to ``tokens[pos:]``."""
        bs, n = self.block_size, 0
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
            ref_count=child.ref_count,
            last_access=child.last_access,
        )
        parent.children[mid.key[: self.block_size]] = mid
        child.key, child.block_ids, child.parent = (
            child.key[cut:],
            child.block_ids[num_blocks:],
            mid,
        )
        mid.children[child.key[: self.block_size]] = child
        return mid

    def _leaves(self) -> list[TreeNode]:
        leaves, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None:
                leaves.append(node)
        return leaves
