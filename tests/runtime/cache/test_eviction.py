"""The adaptive eviction policy on tiny constructed traces, and the scores it follows.

Each trace is built so that one simple policy fails it: a loop that fits the cache only without
a stale shared prefix (``"shared"`` never lets the prefix go), a shared prefix that single-use
traffic pushes out (``"lru"`` loses it every round), and the two one after the other. Replays
run through the real prefix cache (``replay`` checks its integrity, shadows included).
"""

from __future__ import annotations

import pytest

from runtime.bench._replay import Step, replay
from runtime.cache.eviction import ExpertScores
from runtime.cache.prefix_cache import namespace_of
from runtime.cache.radix_cache import RadixCache

BS = 4
CAPACITY = 12  # blocks
NS = namespace_of("m", None, "float32", None)


def blocks(tag: int, n: int) -> list[int]:
    """``n`` whole blocks of token ids no other tag shares."""
    return [tag * 1000 + i for i in range(n * BS)]


def burst_then_loop(rounds: int = 60) -> list[Step]:
    """Five sequences extend a 4-block prefix once, then five 2-block sequences cycle forever:
    10 blocks, which fit the 12-block cache only once the prefix goes."""
    prefix = blocks(1, 4)
    steps: list[Step] = []
    for b in range(5):
        prompt = prefix + blocks(110 + b, 1)
        steps.append((prompt, prompt + blocks(120 + b, 1)))
    loop = [blocks(150 + i, 2) for i in range(5)]
    steps += [(seq, seq) for _ in range(rounds) for seq in loop]
    return steps


def shared_prefix(rounds: int = 60) -> list[Step]:
    """Each round two sessions extend one 4-block prefix, then four single-use 3-block prompts
    (12 blocks) follow: LRU drops the prefix every round, a sharing-aware policy keeps it."""
    prefix = blocks(2, 4)
    steps: list[Step] = []
    for r in range(rounds):
        for j in range(2):
            prompt = prefix + blocks(200_000 + 2 * r + j, 1)
            steps.append((prompt, prompt))
        for k in range(4):
            noise = blocks(250_000 + 4 * r + k, 3)
            steps.append((noise, noise))
    return steps


def hit_rates(steps: list[Step]) -> dict[str, float]:
    return {
        policy: replay(steps, capacity_blocks=CAPACITY, block_size=BS, policy=policy).hit_rate
        for policy in ("lru", "shared", "adaptive")
    }


def test_adaptive_follows_lru_on_a_loop_a_stale_shared_prefix_would_block() -> None:
    rates = hit_rates(burst_then_loop())
    # "shared" keeps the prefix forever (its clock never rises past the bonus while only
    # bonus-less blocks are evicted), so the loop never fits; LRU lets it go.
    assert rates["shared"] < 0.05 and rates["lru"] > 0.8, rates
    assert rates["adaptive"] >= rates["lru"] - 0.03, rates


def test_adaptive_follows_sharing_when_a_shared_prefix_pays() -> None:
    rates = hit_rates(shared_prefix())
    assert rates["shared"] > rates["lru"] + 0.15, rates
    assert rates["adaptive"] >= rates["shared"] - 0.01, rates


def test_adaptive_switches_both_ways_and_beats_each_simple_policy() -> None:
    # The loop first (LRU leads), then the shared prefix (sharing must lead again).
    rates = hit_rates(burst_then_loop() + shared_prefix())
    assert rates["adaptive"] > max(rates["lru"], rates["shared"]) + 0.05, rates


def test_scores_forget_and_switch_only_past_the_margin() -> None:
    scores = ExpertScores(100, margin=1.1)
    assert scores.leader == "shared"
    assert scores.record(100, {"lru": 10, "shared": 0}) == "lru"  # 10 > 1.1 * 0
    # 100 tokens later the old hits count half: lru 5; shared needs more than 5.5 to lead.
    assert scores.record(100, {"lru": 0, "shared": 5}) == "lru"
    assert scores.scores == {"lru": 5.0, "shared": 5.0}
    assert scores.record(0, {"lru": 0, "shared": 1}) == "shared"  # 6 > 5.5
    with pytest.raises(ValueError, match="half_life"):
        ExpertScores(0)
    with pytest.raises(ValueError, match="margin"):
        ExpertScores(10, margin=0.5)


def test_a_reset_empties_the_shadows_too() -> None:
    tree = RadixCache(BS, policy="adaptive", capacity_blocks=CAPACITY)
    prompt = blocks(3, 3)
    tree.insert(NS, prompt, [0, 1, 2])
    scores = tree.scores
    assert scores is not None
    tree.match(NS, prompt, is_request=True)
    assert scores.scores == {"lru": 12.0, "shared": 12.0}  # both shadows hold the prompt
    assert len(tree.evict_all()) == 3 and tree.num_blocks == 0
    tree.match(NS, prompt, is_request=True)
    keep = 0.5 ** (len(prompt) / scores.half_life)
    assert scores.scores == {"lru": 12.0 * keep, "shared": 12.0 * keep}  # no shadow hit
    tree.check_integrity()


def test_the_chunk_store_refuses_adaptive() -> None:
    from runtime.bench._replay import toy_pool
    from runtime.cache.chunk_store import ChunkStore

    with pytest.raises(ValueError, match="'shared' or 'lru'"):
        ChunkStore(toy_pool(4, BS), policy="adaptive")
