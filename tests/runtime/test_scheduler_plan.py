"""The step planner decides who runs and for how many tokens without a model: plain records
stand in for requests (prompt length, KV length, cancellation, forks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.plan import (
    decode_rows,
    is_prefilling,
    pack_tokens,
    plan_step,
    remaining,
    reserve_rows,
)

CONFIG = SchedulerConfig(prefill_chunk_tokens=64, max_prefill_tokens=1000)


@dataclass
class KV:
    length: int


@dataclass
class Req:
    prompt_len: int
    kv_len: int | None = None
    is_cancelled: bool = False
    forks: list[Req] = field(default_factory=list)
    max_total_len: int = 100

    @property
    def prompt_ids(self) -> list[int]:
        return list(range(self.prompt_len))

    @property
    def kv(self) -> KV | None:
        return None if self.kv_len is None else KV(self.kv_len)


def test_an_idle_engine_prefills_the_large_budget_a_decoding_one_the_chunk() -> None:
    prefilling = Req(500, kv_len=64)
    assert is_prefilling(prefilling) and remaining(prefilling) == 436
    assert plan_step([], None, CONFIG).prefill_budget == 1000
    assert plan_step([prefilling], prefilling, CONFIG).prefill_budget == 1000  # nothing decodes
    decoding = Req(10, kv_len=12)
    plan = plan_step([prefilling, decoding], prefilling, CONFIG)
    assert (plan.prefill_budget, plan.chunk_tokens, plan.release) == (64, 64, [])
    assert decode_rows([prefilling, decoding]) == [1]  # the row mid-prefill idles


def test_cancelled_rows_are_released_but_a_head_mid_prefill_with_live_forks_stays() -> None:
    fork = Req(500, kv_len=0)
    head = Req(500, kv_len=64, is_cancelled=True, forks=[fork])
    gone = Req(10, kv_len=11, is_cancelled=True)
    plan = plan_step([head, gone, fork], head, CONFIG)
    assert plan.release == [1]
    assert plan.prefill_budget == 1000  # once ``gone`` leaves, no row decodes
    fork.is_cancelled = True
    assert plan_step([head, gone, fork], head, CONFIG).release == [0, 1, 2]


def test_packing_stops_at_the_token_limit_or_the_request_limit() -> None:
    assert pack_tokens(1, 10, 64, 16) == 54
    assert pack_tokens(1, 64, 64, 16) is None
    assert pack_tokens(16, 10, 64, 16) is None
    assert pack_tokens(1, 10, 64, 1) is None  # max_prefill_batch 1: each request alone


def test_a_burst_reserves_the_rows_it_will_take_in_queue_order() -> None:
    queued = [Req(5, max_total_len=40), Req(5, forks=[Req(5), Req(5)], max_total_len=90),
              Req(5, max_total_len=300)]  # fmt: skip
    assert reserve_rows(1, queued, 8) == (6, 300)
    assert reserve_rows(1, queued, 4) == (2, 40)  # the second, with its forks, would not fit
    assert reserve_rows(4, queued, 4) == (4, 0)  # nothing fits: nothing to reserve
