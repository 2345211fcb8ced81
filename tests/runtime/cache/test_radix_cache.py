"""Scenario tests of the radix tree, the KV pool and the prefix cache that joins them.

Exact token lists, block ids and eviction order; integrity is checked after every scenario.
"""

from __future__ import annotations

import torch

from runtime.cache.eviction import EvictionPolicy
from runtime.cache.kv_pool import KVPool, contiguous_runs
from runtime.cache.prefix_cache import PrefixCache, namespace_of
from runtime.cache.radix_cache import EvictedBlock, RadixCache, TreeNode, root_hash
from runtime.model.kv_cache import RequestKVCache

BS = 4
NS = namespace_of("m", None, "float32", None)


def make_pool(num_blocks: int, *, layers: int = 2, heads: int = 2, dim: int = 3) -> KVPool:
    block_bytes = layers * 2 * heads * BS * dim * 4
    return KVPool(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        block_size=BS,
        budget_bytes=num_blocks * block_bytes,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def make_kv(tokens: list[int], *, layers: int = 2, heads: int = 2, dim: int = 3) -> RequestKVCache:
    """A request cache whose KV at position p encodes token p (so copies can be checked)."""
    kv = RequestKVCache(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        capacity=len(tokens) + 8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    values = torch.tensor(tokens, dtype=torch.float32).view(1, 1, 1, -1, 1)
    kv.buffer[:, :, :, : len(tokens)] = values.expand(layers, 2, heads, -1, dim)
    kv.length = len(tokens)
    return kv


def store(pc: PrefixCache, tokens: list[int]) -> TreeNode | None:
    """Match then insert ``tokens`` as one request would; returns the node it keeps pinned."""
    hit = pc.match(NS, tokens, make_kv([]), use_cache=True)
    return pc.insert(NS, tokens, make_kv(tokens), hit.node)


def check(pc: PrefixCache) -> None:
    pc.check_integrity()


def test_match_splits_node_on_partial_block_match() -> None:
    tree = RadixCache(BS)
    node, unused = tree.insert(NS, list(range(12)), [7, 8, 9])
    assert unused == [] and node.block_ids == [7, 8, 9]
    # A query sharing the first two blocks, then diverging inside the third, splits the edge.
    hit = tree.match(NS, [0, 1, 2, 3, 4, 5, 6, 7, 8, 99, 10, 11])
    assert hit.cached_len == 8 and hit.block_ids == [7, 8]
    assert hit.node.key == tuple(range(8)) and list(hit.node.children.values())[0].block_ids == [9]
    # A partial block at the end is never matched.
    assert tree.match(NS, [0, 1, 2]).cached_len == 0
    tree.check_integrity()


def test_insert_reuses_existing_prefix_and_returns_unused_ids() -> None:
    tree = RadixCache(BS)
    tree.insert(NS, list(range(8)), [0, 1])
    node, unused = tree.insert(NS, list(range(12)), [5, 6, 2])
    assert unused == [5, 6] and node.block_ids == [2] and tree.num_blocks == 3
    tree.check_integrity()


def ids(evicted: list[EvictedBlock]) -> list[int]:
    return [e.block_id for e in evicted]


def test_eviction_is_lru_over_unpinned_leaves() -> None:
    tree = RadixCache(BS, policy="lru")
    a, _ = tree.insert(NS, [1] * 4 + [2] * 4, [0, 1])  # shared [1]*4 then a
    b, _ = tree.insert(NS, [1] * 4 + [3] * 4, [2, 3])  # branch b; block 2 unused
    c, _ = tree.insert(NS, [4] * 8, [4, 5])
    tree.match(NS, [1] * 4 + [2] * 4)  # a is now more recent than b and c
    tree.lock(c)
    assert ids(tree.evict(1)) == [3]  # b's leaf block: least recent unpinned leaf
    assert ids(tree.evict(10)) == [1, 0]  # then a's leaf, then the shared parent; c is pinned
    assert tree.num_in_use_blocks == 2 and tree.num_blocks == 2
    tree.unlock(c)
    assert ids(tree.evict(10)) == [5, 4]  # tail block first
    tree.check_integrity()


def test_namespaces_never_share_nodes() -> None:
    tree = RadixCache(BS)
    tenant_a = namespace_of("m", None, "float32", "a")
    tenant_b = namespace_of("m", None, "float32", "b")
    tree.insert(tenant_a, list(range(8)), [0, 1])
    assert tree.match(tenant_b, list(range(8))).cached_len == 0
    assert tree.match(tenant_a, list(range(8))).cached_len == 8
    assert namespace_of("m", None, "bfloat16", "a") != tenant_a
    assert namespace_of("m", "rev2", "float32", "a") != tenant_a


def test_empty_namespaces_are_removed() -> None:
    tree = RadixCache(BS)
    for salt in ("a", "b", "c"):
        assert tree.match(namespace_of("m", None, "float32", salt), list(range(8))).cached_len == 0
    assert tree.num_namespaces == 0  # a lookup never creates a root
    for i, salt in enumerate(("a", "b", "c")):
        tree.insert(namespace_of("m", None, "float32", salt), list(range(8)), [2 * i, 2 * i + 1])
    assert tree.num_namespaces == 3
    tree.evict(2)  # the least recently used namespace loses its only blocks, then its root
    assert tree.num_namespaces == 2
    tree.check_integrity()
    assert len(tree.evict(tree.num_blocks)) == 4
    assert tree.num_namespaces == 0
    tree.check_integrity()


def test_contiguous_runs() -> None:
    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert contiguous_runs([]) == []


def test_prefix_cache_roundtrip_copies_exact_kv() -> None:
    pc = PrefixCache(make_pool(8), is_enabled=True, disabled_reason=None)
    tokens = list(range(10, 23))  # 13 tokens -> 3 whole blocks stored
    writer = make_kv(tokens)
    hit = pc.match(NS, tokens, make_kv([]), use_cache=True)
    node = pc.insert(NS, tokens, writer, hit.node)
    assert node is not None and pc.radix.num_blocks == 3
    pc.release(node)
    reader = make_kv([])
    hit = pc.match(NS, tokens + [99], reader, use_cache=True)
    assert hit.cached_len == 12
    assert torch.equal(reader.span(0, 12), writer.span(0, 12))
    # The reader writing its own positions never touches stored blocks (copy-out).
    reader.buffer.zero_()
    again = make_kv([])
    pc.release(hit.node)
    hit2 = pc.match(NS, tokens, again, use_cache=True)
    assert torch.equal(again.span(0, 12), writer.span(0, 12))
    pc.release(hit2.node)
    check(pc)


def test_full_prompt_hit_leaves_last_token_to_compute() -> None:
    pc = PrefixCache(make_pool(8), is_enabled=True, disabled_reason=None)
    tokens = list(range(8))
    node = pc.insert(
        NS, tokens, make_kv(tokens), pc.match(NS, tokens, make_kv([]), use_cache=True).node
    )
    pc.release(node)
    kv = make_kv([])
    hit = pc.match(NS, tokens, kv, use_cache=True)
    assert hit.cached_len == 7 and kv.length == 7
    pc.release(hit.node)
    check(pc)


def test_budget_never_exceeded_and_pinned_blocks_survive() -> None:
    pc = PrefixCache(make_pool(4), is_enabled=True, disabled_reason=None)
    first = [1] * 8
    pinned = store(pc, first)
    second = [2] * 16  # 4 blocks wanted, 2 free: only 2 are stored, the pinned ones stay
    held = store(pc, second)
    assert pc.radix.num_blocks == 4 and pc.pool.num_free == 0 and pc.num_evictions == 0
    check(pc)
    pc.release(pinned)
    third = [3] * 8  # now the first prefix is evictable: it goes, LRU
    held3 = store(pc, third)
    assert pc.num_evictions == 2 and pc.radix.match(NS, first).cached_len == 0
    assert pc.radix.match(NS, second).cached_len == 8
    check(pc)
    pc.release(held)
    pc.release(held3)
    assert pc.flush() == 4 and pc.pool.num_free == 4
    check(pc)


def test_disabled_cache_is_a_force_miss() -> None:
    pc = PrefixCache(make_pool(4), is_enabled=False, disabled_reason="off")
    tokens = list(range(8))
    hit = pc.match(NS, tokens, make_kv([]), use_cache=True)
    assert hit == (0, None, ()) and pc.insert(NS, tokens, make_kv(tokens), None) is None
    assert pc.queried_tokens == 8 and pc.hit_tokens == 0
    check(pc)


def test_eviction_takes_only_the_tail_blocks_it_needs() -> None:
    tree = RadixCache(BS)
    leaf, _ = tree.insert(NS, list(range(16)), [10, 11, 12, 13])
    # One block wanted: the leaf loses its last block only; its head stays matchable.
    assert ids(tree.evict(1)) == [13]
    assert leaf.block_ids == [10, 11, 12] and leaf.key == tuple(range(12))
    assert tree.match(NS, list(range(16))).cached_len == 12
    assert ids(tree.evict(2)) == [12, 11]
    assert tree.num_blocks == 1
    tree.check_integrity()


def test_pool_fills_to_its_budget() -> None:
    pc = PrefixCache(make_pool(6), is_enabled=True, disabled_reason=None)
    pc.release(store(pc, [1] * 16))  # 4 blocks
    pc.release(store(pc, [2] * 16))  # 4 more, 2 free: only the first prompt's 2 tail blocks go
    assert pc.pool.num_free == 0 and pc.num_evictions == 2 and pc.radix.num_blocks == 6
    assert pc.radix.match(NS, [1] * 16).cached_len == 8
    check(pc)


def test_shared_prefix_outlives_single_use_tail_at_equal_recency() -> None:
    system = [7] * 8
    cases: list[tuple[EvictionPolicy, list[int]]] = [
        ("lru", [2, 3, 1, 0, 5, 4]),
        ("shared", [2, 3, 5, 4, 1, 0]),
    ]
    for policy, order in cases:
        tree = RadixCache(BS, policy=policy)
        tree.insert(NS, system + [1] * 4, [0, 1, 2])  # session a
        tree.insert(NS, system + [2] * 4, [8, 9, 3])  # session b: system now has two branches
        tree.insert(NS, [5] * 8, [4, 5])  # a single-use sequence, touched after the system
        # LRU drops the older system prompt before the newer single-use sequence; the shared
        # policy keeps the prompt that two sequences extend and drops the single-use one first.
        assert ids(tree.evict(6)) == order, policy
        tree.check_integrity()


def test_block_hashes_chain_over_namespace_and_tokens() -> None:
    tree = RadixCache(BS)
    node, _ = tree.insert(NS, list(range(8)), [0, 1])
    other = namespace_of("m", None, "float32", "tenant")
    node2, _ = tree.insert(other, list(range(8)), [2, 3])
    assert node.hashes[0] != node2.hashes[0] and len(set(node.hashes)) == 2
    # peek returns the hash the chain continues from; a split keeps each block's hash.
    assert tree.peek(NS, list(range(8)) + [1]) == (8, node.hashes[-1])
    assert tree.peek(NS, [9] * 4) == (0, root_hash(NS))
    h0, h1 = node.hashes
    upper = tree.match(NS, list(range(4)) + [9] * 4).node
    assert upper.hashes == [h0] and node.hashes == [h1] and upper.block_ids == [0]
    tree.check_integrity()


def test_eviction_heap_stays_bounded_under_churn() -> None:
    tree = RadixCache(BS)
    rng = __import__("random").Random(3)
    next_id = 0
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(BS * rng.randrange(1, 5))]
        n = len(tokens) // BS
        node, unused = tree.insert(NS, tokens, list(range(next_id, next_id + n)))
        next_id += n
        tree.lock(node)
        tree.unlock(node)
        if tree.num_blocks > 12:
            tree.evict(tree.num_blocks - 12)
    assert tree.num_blocks <= 12
    assert len(tree._heap._heap) <= 4 * tree._num_nodes + 64 + 8
    tree.check_integrity()


def test_evict_namespace_keeps_pinned_paths_and_other_namespaces() -> None:
    """Scenario: tenant a holds [0..7] (blocks 0, 1) with a pinned branch [0..3, 20..23]
    (block 2) and an unpinned branch [0..3, 30..33] (block 3); tenant b holds block 4.
    Evicting a's namespace frees blocks 1 and 3 only: block 0 is under the pin, 2 is pinned."""
    tree = RadixCache(BS)
    a, b = namespace_of("m", None, "float32", "a"), namespace_of("m", None, "float32", "b")
    tree.insert(a, list(range(8)), [0, 1])
    pinned, _ = tree.insert(a, [0, 1, 2, 3, 20, 21, 22, 23], [0, 2])
    tree.insert(a, [0, 1, 2, 3, 30, 31, 32, 33], [0, 3])
    tree.insert(b, list(range(4)), [4])
    tree.lock(pinned)
    freed = tree.evict_namespace(a)
    assert sorted(e.block_id for e in freed) == [1, 3] and tree.num_blocks == 3
    assert tree.match(a, [0, 1, 2, 3, 20, 21, 22, 23]).cached_len == 8
    assert tree.match(a, list(range(8))).cached_len == 4
    assert tree.match(b, list(range(4))).cached_len == 4
    tree.check_integrity()
    tree.unlock(pinned)
    assert sorted(e.block_id for e in tree.evict_namespace(a)) == [0, 2]
    assert tree.num_namespaces == 1  # a's root went with its last block
    tree.check_integrity()
