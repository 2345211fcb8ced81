"""The trace replay and the Belady bound printed next to the measured hit rates."""

from __future__ import annotations

import random

from runtime.bench._replay import Step, agent_sessions, belady, distinct_blocks, replay

BS = 4


def small_trace(seed: int) -> list[Step]:
    rng = random.Random(seed)
    systems = [[rng.randrange(30) for _ in range(BS * 3)] for _ in range(3)]
    steps: list[Step] = []
    histories = [list(rng.choice(systems)) for _ in range(6)]
    for _ in range(40):
        h = rng.choice(histories)
        h += [rng.randrange(30) for _ in range(rng.randrange(1, 9))]
        prompt = list(h)
        h += [rng.randrange(30) for _ in range(rng.randrange(0, 5))]
        steps.append((prompt, list(h)))
    return steps


def test_belady_bounds_every_policy_and_a_full_budget_keeps_everything() -> None:
    for seed in range(3):
        steps = small_trace(seed)
        total = distinct_blocks(steps, BS)
        full = replay(steps, capacity_blocks=total, block_size=BS, policy="lru").hit_rate
        assert belady(steps, capacity_blocks=total, block_size=BS) == full
        for cap in (total // 8, total // 4, total // 2):
            bound = belady(steps, capacity_blocks=cap, block_size=BS)
            for policy in ("lru", "shared", "adaptive"):
                got = replay(steps, capacity_blocks=cap, block_size=BS, policy=policy)
                assert got.hit_rate <= bound + 1e-12 <= full + 1e-12, (seed, cap, policy)
                assert 0 < got.mean_fill <= 1


def test_agent_sessions_append_to_history_and_share_prefixes() -> None:
    steps = agent_sessions(num_agents=2, prefix_len=40, sessions=2, turns=3, seed=1)
    assert len(steps) == 12 and steps == agent_sessions(
        num_agents=2, prefix_len=40, sessions=2, turns=3, seed=1
    )
    firsts = {tuple(prompt[:40]) for prompt, _ in steps}
    assert len(firsts) == 2  # two agents' shared system + tool prefixes
    for prompt, full in steps:
        assert full[: len(prompt)] == prompt and len(full) > len(prompt)
