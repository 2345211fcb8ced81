"""The disk tier on its own and below a prefix cache: checksums, budget, restarts, bounds.

Real files in a temp directory; block tensors are small and carry recognisable values.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from runtime.bench._replay import make_disk, replay
from runtime.cache.disk_tier import DISK_HEADER_BYTES, DiskTier
from runtime.cache.prefix_cache import PrefixCache, namespace_of
from runtime.cache.radix_cache import BlockHash, block_hash, root_hash
from tests.runtime.cache.test_radix_cache import BS, make_kv, make_pool

NS = namespace_of("m", None, "float32", None)
SHAPE = (2, 2, 2, BS, 3)  # [L, 2, H, bs, D] as make_pool builds it
BLOCK_BYTES = 2 * 2 * 2 * BS * 3 * 4


def make_tier(path: Path, *, blocks: int = 16, fingerprint: str = "w0", **kw: int) -> DiskTier:
    budget = blocks * (BLOCK_BYTES + DISK_HEADER_BYTES)
    return DiskTier(path, budget_bytes=budget, fingerprint=fingerprint, block_shape=SHAPE,
                    dtype=torch.float32, **kw)  # fmt: skip


def block(value: float) -> torch.Tensor:
    return torch.full(SHAPE, value)


def chain(n: int) -> list[BlockHash]:
    h, out = root_hash(NS), []
    for i in range(n):
        h = block_hash(h, [i] * BS)
        out.append(h)
    return out


def test_put_load_and_reopen(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    keys = [tier.key(h) for h in chain(3)]
    for i, key in enumerate(keys):
        assert tier.put(key, block(float(i)))
    tier.drain()
    assert tier.num_blocks == 3 and tier.stats.num_writes == 3
    tier.check_integrity()
    tier.close()
    # A fresh tier on the same directory (a restart) finds and verifies the files.
    again = make_tier(tmp_path)
    loaded = again.load(keys[1])
    assert loaded is not None and torch.equal(loaded, block(1.0))
    # Another fingerprint (other weights or layout) names every block differently.
    assert make_tier(tmp_path, fingerprint="w1").key(chain(1)[0]) != keys[0]
    again.check_integrity()


def test_damaged_truncated_and_foreign_files_are_misses_and_removed(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    keys = [tier.key(h) for h in chain(4)]
    for i, key in enumerate(keys):
        tier.put(key, block(float(i)))
    tier.drain()
    files = {k: tier.file_of(k) or tmp_path / "missing" for k in keys}
    data = bytearray(files[keys[0]].read_bytes())
    data[-5] ^= 0xFF  # one flipped payload byte
    files[keys[0]].write_bytes(bytes(data))
    files[keys[1]].write_bytes(files[keys[1]].read_bytes()[:100])  # truncated
    files[keys[2]].write_bytes(files[keys[3]].read_bytes())  # another block's file
    assert [tier.load(k) for k in keys[:3]] == [None, None, None]
    assert tier.stats.num_corrupt == 3 and not any(files[k].exists() for k in keys[:3])
    assert torch.equal(tier.load(keys[3]), block(3.0))  # type: ignore[arg-type]
    tier.check_integrity()


def test_leftover_temp_files_are_removed_on_start(tmp_path: Path) -> None:
    (tmp_path / ".deadbeef.123.456.tmp").write_bytes(b"half a block")
    tier = make_tier(tmp_path)
    assert not list(tmp_path.glob("*.tmp")) and tier.num_blocks == 0
    tier.check_integrity()


def test_byte_budget_evicts_least_recently_used_files(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, blocks=3)
    keys = [tier.key(h) for h in chain(5)]
    for i, key in enumerate(keys[:3]):
        tier.put(key, block(float(i)))
    tier.drain()
    assert tier.load(keys[0]) is not None  # key 0 is now the most recently used
    for i, key in enumerate(keys[3:]):
        tier.put(key, block(float(3 + i)))
    tier.drain()
    kept = [k for k in keys if tier.contains(k)]
    assert kept == [keys[0], keys[3], keys[4]]
    assert tier.stats.bytes_used <= tier.budget_bytes
    tier.check_integrity()


def test_a_full_write_queue_drops_writes_never_blocks(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, blocks=4000, max_pending=2)
    for h in chain(500):
        tier.put(tier.key(h), block(1.0))
        assert len(tier._pending) <= 2
    tier.drain()
    assert tier.stats.num_dropped > 0
    assert tier.stats.num_writes + tier.stats.num_dropped == 500
    tier.check_integrity()


def test_prefix_match_continues_into_disk_with_exact_kv(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    pc = PrefixCache(make_pool(4), is_enabled=True, disabled_reason=None, disk=tier)
    tokens = list(range(10, 23))  # 3 whole blocks
    writer = make_kv(tokens)
    first = pc.match(NS, tokens, make_kv([]), use_cache=True)
    pc.release(pc.insert(NS, tokens, writer, first.node))
    assert pc.flush() == 3  # spilled, not lost
    tier.drain()
    assert pc.peek(NS, tokens + [1], use_cache=True) == 12  # counts (and prefetches) disk
    reader = make_kv([])
    hit = pc.match(NS, tokens + [1], reader, use_cache=True)
    assert hit.cached_len == 12 and pc.disk_hit_tokens == 12
    assert torch.equal(reader.span(0, 12), writer.span(0, 12))
    pc.release(hit.node)
    pc.check_integrity()
    # flush(include_disk=True) empties both tiers.
    pc.flush(include_disk=True)
    assert tier.num_blocks == 0 and pc.match(NS, tokens, make_kv([]), use_cache=True)[0] == 0


@pytest.mark.parametrize("policy", ["lru", "shared", "adaptive"])
def test_bounded_memory_and_disk_under_a_long_random_trace(tmp_path: Path, policy: str) -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(BS * rng.randrange(2, 8))] for _ in range(6)]
    steps = []
    for _ in range(600):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        steps.append((prompt, prompt + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]))
    disk = make_disk(tmp_path, 40, BS)
    result = replay(steps, capacity_blocks=10, block_size=BS, policy=policy, disk=disk)  # type: ignore[arg-type]
    # replay checks both tiers' integrity (pool in budget, disk index == directory, disk bytes
    # in budget, bounded queues) every 64 requests and at the end.
    assert disk.stats.bytes_used <= disk.budget_bytes and disk.num_blocks <= 40
    assert 0 < result.disk_hit_rate <= result.hit_rate < 1
    assert len(list(tmp_path.iterdir())) == disk.num_blocks
    disk.close()


def test_prefetch_stages_verified_blocks_for_the_next_load(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, max_staged=2)
    keys = [tier.key(h) for h in chain(4)]
    for i, key in enumerate(keys):
        tier.put(key, block(float(i)))
    tier.drain()
    (tier.file_of(keys[3]) or tmp_path / "missing").write_bytes(b"garbage")
    tier.prefetch(keys[2:])  # read and checked in the background
    tier.drain()
    assert list(tier._staged) == [keys[2]]  # keys[3] failed its check: removed, not staged
    assert tier.stats.num_corrupt == 1 and not tier.contains(keys[3])
    assert torch.equal(tier.load(keys[2]), block(2.0))  # type: ignore[arg-type]
    assert not tier._staged  # a staged block is handed over once
    tier.check_integrity()


# --- write-through support: offers, groups, a bounded flush -------------------------------------


def test_an_offer_copies_only_what_it_queues(tmp_path: Path) -> None:
    """A block on disk or queued already costs no copy (``read`` is not called)."""
    tier = make_tier(tmp_path, max_pending=1)
    reads: list[int] = []

    def read(i: int) -> torch.Tensor:
        reads.append(i)
        return block(float(i))

    key = tier.key(chain(1)[0])
    assert tier.offer(key, lambda: read(0))
    tier.drain()
    assert tier.offer(key, lambda: read(1))  # on disk: deduplicated by key
    assert reads == [0] and tier.stats.num_writes == 1
    tier.check_integrity()
    tier.close()


def test_remove_group_drops_one_groups_files_only_also_after_a_restart(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    mine, theirs = tier.group_of("tenant-a"), tier.group_of("tenant-b")
    keys = [tier.key(h) for h in chain(4)]
    for i, key in enumerate(keys):
        assert tier.put(key, block(float(i)), group=mine if i < 2 else theirs)
    tier.close()
    again = make_tier(tmp_path)  # the groups are in the file names: a restart still knows them
    assert again.remove_group(mine) == 2
    assert [again.contains(k) for k in keys] == [False, False, True, True]
    loaded = again.load(keys[3])
    assert loaded is not None and torch.equal(loaded, block(3.0))
    again.check_integrity()
    again.close()


def test_close_flushes_within_its_deadline_and_drops_the_rest(tmp_path: Path) -> None:
    """``close(0)`` writes at most the block in progress; the others are dropped and counted,
    and the directory a later start finds is consistent."""
    tier = make_tier(tmp_path, blocks=64, max_pending=64)
    keys = [tier.key(h) for h in chain(40)]
    for i, key in enumerate(keys):
        assert tier.put(key, block(float(i)))
    dropped = tier.close(0.0)
    assert dropped == 40 - tier.stats.num_writes and tier.num_pending == 0
    assert tier.close(5.0) == 0  # idempotent
    again = make_tier(tmp_path, blocks=64)
    assert again.num_blocks == tier.stats.num_writes
    again.check_integrity()
    full = make_tier(tmp_path / "full", blocks=64, max_pending=64)
    for i, key in enumerate(keys):
        assert full.put(key, block(float(i)))
    assert full.close(60.0) == 0 and full.num_blocks == 40  # a generous deadline writes all


def test_write_through_puts_each_new_block_on_disk_without_eviction(tmp_path: Path) -> None:
    """Under "write-through" blocks reach disk as they are cached; under "evict" only when
    evicted. A namespace flush drops that namespace alone, in memory and on disk."""
    other = namespace_of("m", None, "float32", "tenant-b")
    tokens = list(range(10, 23))  # 3 whole blocks
    for policy, on_disk in (("write-through", 3), ("evict", 0)):
        tier = make_tier(tmp_path / policy)
        pc = PrefixCache(make_pool(8), is_enabled=True, disabled_reason=None, disk=tier,
                         disk_policy=policy)  # type: ignore[arg-type]  # fmt: skip
        for ns in (NS, other):
            first = pc.match(ns, tokens, make_kv([]), use_cache=True)
            pc.release(pc.insert(ns, tokens, make_kv(tokens), first.node))
        tier.drain()
        assert tier.num_blocks == 2 * on_disk and pc.radix.num_blocks == 6
        assert pc.flush_namespace(NS) == 3 and pc.radix.num_blocks == 3
        tier.drain()
        assert tier.num_blocks == on_disk  # NS's files went, tenant-b's stay
        assert pc.match(NS, tokens, make_kv([]), use_cache=True).cached_len == 0
        hit = pc.match(other, tokens, make_kv([]), use_cache=True)
        assert hit.cached_len == 12
        pc.release(hit.node)
        pc.check_integrity()
        tier.close()


def test_over_budget_resident_blocks_go_first_then_the_deepest(tmp_path: Path) -> None:
    """Scenario (4-block budget): a chain of 4 blocks at depths 0-3, blocks 0-1 also in memory.
    Two more writes must evict two files: the resident ones go first (memory still has them),
    least recently used first; then, with none resident, the deepest goes, whatever its age."""
    tier = make_tier(tmp_path, blocks=4)
    keys = [tier.key(h) for h in chain(7)]
    for depth, key in enumerate(keys[:4]):
        assert tier.put(key, block(float(depth)), depth=depth)
    tier.drain()
    tier.mark_resident(keys[:2], is_resident=True)
    for depth, key in zip((0, 1), keys[4:6], strict=True):
        assert tier.put(key, block(9.0), depth=depth)
        tier.drain()
    assert [tier.contains(k) for k in keys[:6]] == [False, False, True, True, True, True]
    assert tier.put(keys[6], block(9.0), depth=0)
    tier.drain()
    assert [tier.contains(k) for k in keys[2:7]] == [True, False, True, True, True]  # depth 3 went
    tier.check_integrity()
    tier.close()
    again = make_tier(tmp_path, blocks=4)  # depths survive a restart (they are in file names)
    assert again.num_blocks == 4 and again.load(keys[2]) is not None  # now the most recent
    assert again.put(keys[0], block(0.0), depth=0)
    again.drain()
    assert not again.contains(keys[2])  # the deepest (depth 2) goes, though just used
    assert all(again.contains(k) for k in (keys[0], *keys[4:7]))
    again.check_integrity()


def test_persist_writes_every_block_memory_holds_with_its_depth(tmp_path: Path) -> None:
    """A graceful shutdown's ``persist`` offers every cached block (shallow first): here under
    "evict", so nothing was on disk before it."""
    tier = make_tier(tmp_path)
    pc = PrefixCache(make_pool(8), is_enabled=True, disabled_reason=None, disk=tier,
                     disk_policy="evict")  # fmt: skip
    tokens = list(range(10, 23))  # 3 whole blocks
    first = pc.match(NS, tokens, make_kv([]), use_cache=True)
    pc.release(pc.insert(NS, tokens, make_kv(tokens), first.node))
    tier.drain()
    assert tier.num_blocks == 0
    assert pc.persist(timeout_s=30.0) == 3
    tier.drain()
    names = [tier.file_of(tier.key(h)) for h in chain_of(tokens)]
    assert [p is not None and p.name.split("_")[1] for p in names] == ["0", "1", "2"]
    pc.check_integrity()
    tier.close()


def chain_of(tokens: list[int]) -> list[BlockHash]:
    h, out = root_hash(NS), []
    for start in range(0, len(tokens) - BS + 1, BS):
        h = block_hash(h, tokens[start : start + BS])
        out.append(h)
    return out
