"""The scheduler's limits (``SchedulerConfig``) and its snapshot record (``SchedulerStats``).

Plain data, no torch: the server's protocol and metrics modules read the snapshot type without
loading the engine. The loop that honours these limits is ``runtime.scheduler.loop``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["SchedulerConfig", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching, ordering and admission limits.

    Raises:
        ValueError: on construction, for out-of-range values.
    """

    max_batch_size: int = 64
    """Most requests decoded together (1 for models whose padding masks cannot be built)."""
    max_waiting: int = 1024
    """Most requests queued; one more gets ``EngineBusyError`` (the server answers 429)."""
    batch_kv_bytes: int = 1 << 30
    """Byte budget of the running requests' KV rows (separate from the prefix cache pool)."""
    lookahead: int = 16
    """Waiting requests scored by cached prefix length at each admission (bounds its cost)."""
    fifo_threshold: int = 128
    """With more requests waiting than this, admission is plain FIFO."""
    max_wait_s: float = 2.0
    """A head of queue older than this (seconds) is admitted next: no starvation."""
    max_prefill_tokens: int = 8192
    """Prompt tokens prefilled per loop iteration while no request is decoding (idle engine)."""
    prefill_chunk_tokens: int = 512
    """Most prompt tokens one prefill forward runs, and the prefill budget of a loop iteration
    while requests are decoding: a longer prompt is prefilled in chunks with one decode step of
    the running requests between them, so an arriving long prompt does not stall every stream
    (smaller: steadier inter-token latency, slower admission of long prompts). A request with
    chunk reuse computes its missed chunks within the same budget, then places every chunk and
    runs its other rows in one iteration (NOTE: that step may exceed the budget by what it
    runs: the rows outside chunks, and in blend mode the recomputed ones)."""
    max_prefill_batch: int = 16
    """Most requests whose prefill chunks run packed in one forward (at most
    ``prefill_chunk_tokens`` tokens in all; compact forward only). Short prompts arriving
    together then share one pass over the weights; 1 prefills each request alone."""

    idle_release_s: float = 1.0
    """Seconds the loop stays idle (nothing waiting or running) before a burst's batch KV
    buffer is handed back (``BatchKV.release_idle``); a burst that follows sooner reuses its
    rows instead of regrowing them."""

    def __post_init__(self) -> None:
        counts = (
            self.max_batch_size,
            self.lookahead,
            self.fifo_threshold,
            self.max_prefill_tokens,
            self.prefill_chunk_tokens,
            self.max_prefill_batch,
        )
        if min(counts) < 1 or self.max_waiting < 0 or self.batch_kv_bytes < 1:
            raise ValueError(f"scheduler limits must be positive, got {self!r}")
        for name in ("max_wait_s", "idle_release_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")


class SchedulerStats(NamedTuple):
    """A snapshot of the scheduler (``Engine.scheduler_stats``)."""

    num_running: int
    num_waiting: int
    num_blocks_pinned: int
    batch_kv_bytes: int
    """Bytes of the batch KV buffer now reserved (address space: rows no request has used
    are not resident, ``BatchKV``)."""
    max_batch_size: int
    prefill_tokens_computed: int = 0
    """Prompt tokens run through the model by every request released so far: finished,
    cancelled or failed (cached and chunk-reused tokens excluded; work done is counted)."""
    generation_tokens: int = 0
    """Tokens sampled by every request released so far, cancelled or failed ones included."""
    decode_steps_by_rows: tuple[int, ...] = ()
    """Decode steps run so far by batch size: entry ``i`` counts the steps that decoded ``i``
    rows (length ``max_batch_size + 1``). Counted by the loop itself, so a reader that diffs
    two snapshots gets a phase's peak and mean decode batch without sampling the engine."""
