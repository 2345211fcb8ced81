"""BatchKV rows: the buffer gives a burst's bytes back when asked once every row has left, grows
once per burst, and a decode step never reads non-finite padding."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from runtime.model.batch_kv import BatchKV


def make_batch() -> BatchKV:
    return BatchKV(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                   device=torch.device("cpu"), budget_bytes=1 << 20)  # fmt: skip


def test_buffer_is_released_when_idle_after_a_burst() -> None:
    batch = make_batch()
    rows = [batch.add_row(10 + i) for i in range(3)]
    for kv in rows:
        kv.length = 5
    assert batch.bytes_allocated >= 3 * 12 * batch.position_bytes
    batch.remove_row(0)
    batch.remove_row(1)
    assert batch.bytes_allocated > 0  # one row still runs
    batch.check_integrity()
    batch.remove_row(0)
    assert batch.num_rows == 0 and batch.bytes_allocated > 0 and batch.holds_idle_rows
    assert batch.release_idle() and not batch.release_idle()
    assert batch.bytes_allocated == 0 and batch.num_shrinks == 1
    kv = batch.add_row(8)  # the next request allocates again, uninitialized
    batch.begin_step(torch.tensor([0]))  # its padding is zeroed before a step reads it
    assert kv.buffer.abs().sum().item() == 0
    batch.check_integrity()


def test_one_row_buffer_is_kept_between_requests() -> None:
    batch = make_batch()
    batch.add_row(8)
    kept = batch.bytes_allocated
    batch.remove_row(0)
    assert not batch.holds_idle_rows and not batch.release_idle()
    assert batch.bytes_allocated == kept > 0 and batch.num_shrinks == 0


def test_a_live_row_keeps_the_buffer() -> None:
    batch = make_batch()
    batch.add_row(8)
    batch.add_row(8)
    batch.remove_row(0)
    assert not batch.release_idle() and batch.num_rows == 1 and batch.bytes_allocated > 0


def test_a_burst_buffer_is_freed_without_the_cyclic_gc() -> None:
    # NOTE: the cyclic GC is off, so only reference counting can free what the burst held: a
    # reference cycle through a row view would keep the whole buffer alive until it ran.
    batch = make_batch()
    rows = [batch.add_row(10) for _ in range(3)]
    buffer = weakref.ref(batch.buffer)
    views = [weakref.ref(kv) for kv in rows]
    gc.disable()
    try:
        for _ in range(3):
            batch.remove_row(0)
        batch.release_idle()
        del rows
        assert [view() for view in views] == [None, None, None]
        assert buffer() is None
    finally:
        gc.enable()


def test_share_plan_points_rows_at_the_earliest_row_with_the_longest_common_blocks() -> None:
    """Rows that copied the same leading pool blocks share those positions (capped by what each
    recorded); a row that moves on ``remove_row`` takes its record along."""
    batch = make_batch()
    rows = [batch.add_row(64) for _ in range(5)]
    for kv, blocks, length in (
        (rows[0], (4, 5, 6), 40),  # 3 blocks of 16, 40 positions trusted
        (rows[1], (4, 5, 6, 7), 60),
        (rows[2], (4, 5, 9), 47),
        (rows[4], (4, 5, 6, 7), 63),
    ):
        kv.length = length
        batch.share_prefix(kv, blocks, 16, length)
    src, shared = batch.share_plan()
    # row 3 recorded nothing; row 4 shares four blocks with row 1 (more than with row 0)
    assert src.tolist() == [0, 0, 0, 3, 1] and shared.tolist() == [0, 40, 32, 0, 60]
    batch.remove_row(1)  # row 4 moves into slot 1
    src, shared = batch.share_plan()
    assert src.tolist() == [0, 0, 0, 3] and shared.tolist() == [0, 40, 32, 0]


def test_integrity_check_compares_the_shared_bytes() -> None:
    batch = make_batch()
    a, b = batch.add_row(32), batch.add_row(32)
    for kv in (a, b):
        kv.length = 20
        batch.share_prefix(kv, (1, 2), 8, 16)
    batch.buffer[:, :, 1, :, :16] = batch.buffer[:, :, 0, :, :16] = 1.5
    batch.check_integrity()
    batch.buffer[1, 0, 1, 0, 15, 3] = 2.0  # one value of row 1's shared keys drifts
    with pytest.raises(AssertionError, match="shared prefix drifted"):
        batch.check_integrity()


def test_reserve_grows_once_for_a_burst_within_the_budget() -> None:
    batch = make_batch()  # 2 layers x 2 (K/V) x 2 heads x 4 dims x 4 bytes = 128 bytes a position
    batch.add_row(10)
    grows = batch.num_grows
    batch.reserve(6, 40)
    assert batch.num_grows == grows + 1 and batch.buffer.shape[2] >= 6
    assert batch.buffer.shape[4] >= 40
    for _ in range(5):
        batch.add_row(40)
    assert batch.num_grows == grows + 1  # the five rows took the reserved room
    batch.reserve(100, 100)  # 100 x 100 x 128 bytes > the 1 MiB budget: nothing happens
    assert batch.num_grows == grows + 1
    batch.check_integrity()


def test_growth_takes_what_the_budget_allows_when_doubling_does_not_fit() -> None:
    """A budget that holds 17 rows of 1,000 positions but not 18 (W1's 1 GiB at ~1,380
    tokens): from 9 rows, the 10th grows the buffer once to all 17 rows that fit, not row by row;
    a longer row grows rows and capacity as far as the budget allows, not to the exact size
    (which reallocated again at the next row or position)."""
    batch = BatchKV(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                    device=torch.device("cpu"), budget_bytes=17 * 1000 * 128)  # fmt: skip
    batch.reserve(9, 1000)
    for _ in range(9):
        batch.add_row(1000)
    grows = batch.num_grows
    batch.add_row(1000)
    assert batch.num_grows == grows + 1 and batch.buffer.shape[2] == 17
    for _ in range(7):
        batch.add_row(1000)
    assert batch.num_grows == grows + 1 and batch.num_rows == 17
    for _ in range(9):
        batch.remove_row(0)
    batch.add_row(1100)  # NOTE: 17 rows of 1,100 do not fit: 15 rows of 1,133 do
    assert batch.num_grows == grows + 2 and tuple(batch.buffer.shape[2::2]) == (15, 1133)
    for _ in range(6):
        batch.add_row(1133)
    assert batch.num_grows == grows + 2 and batch.num_rows == 15
    for _ in range(14):
        batch.remove_row(0)
    batch.add_row(1134)  # NOTE: one position past the rows' capacity: room for more, not one
    assert tuple(batch.buffer.shape[2::2]) == (14, 1214)
    assert batch.bytes_allocated <= batch.budget_bytes
    batch.check_integrity()


def test_a_step_never_declares_shared_keys_past_what_it_reads() -> None:
    """Two rows sharing 40 positions, a step reading 10 keys (its decoding rows are short; an
    idle row mid-prefill may be longer): the plan is clamped to the keys read, which the
    kernel requires (a larger value would fail every row of the step)."""
    batch = make_batch()
    a, b = batch.add_row(64), batch.add_row(64)
    for kv in (a, b):
        kv.length = 40
        batch.share_prefix(kv, (1, 2, 3), 16, 40)
    batch.begin_step(torch.tensor([40, 40]), kv_len=10)
    slots = batch.step_slots()
    assert slots.src is not None and slots.shared is not None
    assert slots.src.tolist() == [0, 0] and slots.shared.tolist() == [0, 10]


def test_padding_is_zeroed_before_a_step_after_add_move_and_growth() -> None:
    """The buffer is allocated uninitialized and freed rows are not cleared, so a step must zero
    what it may read past each row's length: a new row (its slot held a NaN row), a row moved
    into a freed slot, and every live row after a reallocation; valid positions are kept."""
    batch = make_batch()
    a, b, c = batch.add_row(16), batch.add_row(16), batch.add_row(16)
    for kv in (a, b, c):
        kv.length = 6
    batch.begin_step(torch.tensor([6, 6, 6]))
    for kv, fill in ((a, 1.0), (b, float("nan")), (c, 3.0)):
        kv.buffer.fill_(fill)  # NOTE: b failed on NaN KV, written past its length too
    for kv in (a, c):
        kv.buffer[:, :, :, 6:] = 0.0
    batch.remove_row(1)  # c moves into b's slot, over b's NaN
    assert batch.rows[1] is c and not bool(c.buffer[:, :, :, 6:].isfinite().all())
    d = batch.add_row(16)  # in c's old slot, which still holds 3.0 everywhere
    batch.begin_step(torch.tensor([6, 6, 0]))
    assert bool((c.buffer[:, :, :, :6] == 3.0).all()) and bool((a.buffer[:, :, :, :6] == 1.0).all())
    for kv in (a, c):
        assert kv.buffer[:, :, :, 6:].abs().sum().item() == 0
    assert d.buffer.abs().sum().item() == 0
    grows = batch.num_grows
    batch.add_row(200)  # past the capacity: a new, uninitialized buffer
    assert batch.num_grows == grows + 1
    torch.nn.init.constant_(batch.buffer[:, :, 4:], float("nan"))  # whatever the allocator gave
    batch.buffer[:, :, :3, :, 6:] = float("nan")
    batch.begin_step(torch.tensor([6, 6, 0, 0]))
    assert bool((batch.rows[1].buffer[:, :, :, :6] == 3.0).all())
    assert bool(batch.buffer[:, :, :4].isfinite().all())
    batch.check_integrity()


def test_a_burst_reserves_every_row_the_budget_allows_in_one_growth() -> None:
    """``reserve(up_to=...)`` takes all the rows the budget holds (requests are still arriving),
    and later rows of the burst fit without another reallocation."""
    batch = BatchKV(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                    device=torch.device("cpu"), budget_bytes=16 * 1000 * 128)  # fmt: skip
    batch.reserve(7, 1000, up_to=64)
    assert tuple(batch.buffer.shape[2::2]) == (16, 1000) and batch.num_grows == 1
    for _ in range(16):
        batch.add_row(1000)
    assert batch.num_grows == 1 and batch.num_rows == 16
    batch.check_integrity()


def test_a_refused_headroom_falls_back_to_the_rows_in_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows a burst reserves beyond the requests in hand are optional: when the allocator
    refuses them (torch raises RuntimeError), the buffer takes just the rows asked for; when it
    refuses those too, the error propagates."""
    batch = make_batch()  # 128 bytes a position, a 1 MiB budget: 81 rows of 100 fit
    real_empty = torch.empty

    def stingy(*shape: Any, **kwargs: Any) -> torch.Tensor:
        if shape[0][2] > 3:  # NOTE: [L, 2, rows, H, capacity, D]
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", stingy)
    batch.reserve(3, 100, up_to=64)
    assert tuple(batch.buffer.shape[2::2]) == (3, 100) and batch.num_grows == 1
    with pytest.raises(RuntimeError, match="can't allocate"):
        batch.reserve(5, 100, up_to=64)
    assert tuple(batch.buffer.shape[2::2]) == (3, 100)
    batch.check_integrity()
