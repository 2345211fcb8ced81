"""The step planner: who runs in one loop iteration and for how many tokens (pure decisions).

Each function reads request state (prompt length, KV length, cancellation, forks) and the limits,
and returns a decision; none runs the model, allocates a row or touches the prefix cache, so each
is unit-tested without a model (tests/runtime/test_scheduler_plan.py). The executor
(``runtime.scheduler.executor``) runs the plan and finishes what it produced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from runtime.scheduler.admission import is_all_cancelled
from runtime.scheduler.config import SchedulerConfig

__all__ = [
    "Planned",
    "StepPlan",
    "decode_rows",
    "is_prefilling",
    "pack_tokens",
    "plan_step",
    "remaining",
    "reserve_rows",
]


class _KV(Protocol):
    @property
    def length(self) -> int: ...


class Planned(Protocol):
    """What the planner reads of a request (``runtime.request.state.Request`` has it all)."""

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def kv(self) -> _KV | None: ...
    @property
    def is_cancelled(self) -> bool: ...
    @property
    def forks(self) -> Sequence[Planned]: ...
    @property
    def max_total_len(self) -> int: ...


class StepPlan(NamedTuple):
    """One iteration's decisions before anything runs."""

    release: list[int]
    """Indices of running rows to release first (cancelled; a head mid-prefill whose forks
    still live is kept, to finish its prefill for them)."""
    prefill_budget: int
    """Prompt tokens this iteration may prefill: ``prefill_chunk_tokens`` while some row
    decodes (their streams wait for it), ``max_prefill_tokens`` when none does."""
    chunk_tokens: int
    """Most prompt tokens one prefill forward runs (``prefill_chunk_tokens``)."""


def remaining(req: Planned) -> int:
    """Prompt tokens of a running request not in its KV yet."""
    assert req.kv is not None, "a running request has a KV row"
    return len(req.prompt_ids) - req.kv.length


def is_prefilling(req: Planned) -> bool:
    """A running request whose KV does not cover its prompt yet (chunked prefill under way)."""
    return req.kv is not None and req.kv.length < len(req.prompt_ids)


def plan_step(
    running: Sequence[Planned], prefilling: Planned | None, config: SchedulerConfig
) -> StepPlan:
    """The iteration's releases and prefill budget from the running rows (in row order)."""
    release = [
        i
        for i, r in enumerate(running)
        if r.is_cancelled and (r is not prefilling or is_all_cancelled(r))  # type: ignore[arg-type]
    ]
    kept = [r for i, r in enumerate(running) if i not in release]
    is_decoding = any(not is_prefilling(r) for r in kept)
    chunk = config.prefill_chunk_tokens
    return StepPlan(release, chunk if is_decoding else config.max_prefill_tokens, chunk)


def decode_rows(running: Sequence[Planned]) -> list[int]:
    """Rows that take a decode step: every running row but the one mid-prefill (idle, fed
    nothing, its KV not committed)."""
    return [i for i, r in enumerate(running) if not is_prefilling(r)]


def pack_tokens(num_jobs: int, num_tokens: int, limit: int, max_jobs: int) -> int | None:
    """Tokens the next request packed into this prefill forward may run, or None to stop.

    Args:
        num_jobs: requests packed so far (the first included).
        num_tokens: their uncached prompt tokens (what they will run, at most ``limit``).
        limit: the forward's token budget.
        max_jobs: most requests in one forward (``max_prefill_batch``).
    """
    if num_tokens >= limit or num_jobs >= max_jobs:
        return None
    return limit - num_tokens


def reserve_rows(
    num_running: int, queued: Iterable[Planned], max_batch_size: int
) -> tuple[int, int]:
    """Rows and positions per row to reserve for the queued burst: the rows it will take in
    queue order (a request with its forks, up to ``max_batch_size``) and the longest of them.

    Returns:
        ``(rows, capacity)``; capacity 0 when nothing queued fits.
    """
    rows, capacity = num_running, 0
    for req in queued:
        if rows + 1 + len(req.forks) > max_batch_size:
            break
        rows, capacity = rows + 1 + len(req.forks), max(capacity, req.max_total_len)
    return rows, capacity
