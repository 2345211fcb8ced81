"""Scheduler: the request queue and the one loop that prefills and batch-decodes requests.

Continuous batching: requests join (admit + prefill from their prefix-cache hit) and leave
(finish, cancel, error) between decode steps, and each step decodes every running request at once.
Cache-aware ordering takes the waiting request with the longest cached prefix (SGLang's
longest-prefix-match) among the first few, FIFO when the queue is long or its head is old.
It drives the prefix cache and the batch KV; it knows nothing about HTTP or chat templates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from runtime.cache.prefix_cache import PrefixCache
from runtime.chunks.assembler import ChunkAssembler
from runtime.exceptions import EngineBusyError, RuntimeEngineError
from runtime.model.openmp import release_thread_workers
from runtime.model.runner import ModelRunner
from runtime.request.state import Request, RequestStatus
from runtime.scheduler.admission import is_all_cancelled
from runtime.scheduler.config import SchedulerConfig, SchedulerStats
from runtime.scheduler.executor import Executor
from runtime.scheduler.forks import check_group

_log = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]


class Scheduler(Executor):
    """Queue + loop thread. The loop holds ``lock`` (the engine's) during every iteration.

    Lock order: ``lock`` before the internal condition; callers of ``submit``/``cancel`` take
    only the condition, so they never wait for a model step except in ``cancel``.
    """

    def __init__(
        self,
        runner: ModelRunner,
        prefix_cache: PrefixCache,
        lock: threading.Lock,
        config: SchedulerConfig,
        *,
        debug_integrity: bool = False,
        chunks: ChunkAssembler | None = None,
    ) -> None:
        super().__init__(
            runner, prefix_cache, config, debug_integrity=debug_integrity, chunks=chunks
        )
        self._lock = lock
        self._thread: threading.Thread | None = None
        self._is_closed = False
        self._is_paused = False
        """Set by ``pause``: the loop thread runs no iteration (``step`` runs them instead)."""

    # --- called from consumer threads ------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a waiting request; the loop starts on the first submit.

        A request with ``forks`` (the other choices of ``n > 1``) is queued as one group: the
        forks are admitted with it and never wait on their own.

        Raises:
            EngineBusyError: the queue holds ``max_waiting`` requests.
            TooManyChoicesError, PromptTooLongError: the group can never run (``check_group``).
            RuntimeEngineError: the engine was closed.
        """
        self.submit_all([req])

    def submit_all(self, reqs: Sequence[Request]) -> None:
        """Queue several requests at once: the loop's next admission sees all of them.

        A request with ``forks`` (the other choices of ``n > 1``) is queued as one group: the
        forks are admitted with it and never wait on their own.

        Raises:
            EngineBusyError: they do not all fit under ``max_waiting`` (none is queued).
            TooManyChoicesError, PromptTooLongError: a group can never run (``check_group``).
            RuntimeEngineError: the engine was closed.
        """
        # NOTE: the submitting thread's OpenMP workers (a model loaded or a reference forward
        # run on it) would otherwise throttle the loop thread's: see runtime.model.openmp.
        release_thread_workers()
        for req in reqs:
            check_group(req, max_batch_size=self.max_batch_size,
                        position_bytes=self.batch.position_bytes,
                        batch_kv_bytes=self.config.batch_kv_bytes)  # fmt: skip
        with self._cv:
            if self._is_closed:
                raise RuntimeEngineError("the engine is closed")
            if len(self.waiting) + len(reqs) > self.config.max_waiting:
                raise EngineBusyError(
                    f"engine busy: {len(self.waiting)} requests waiting "
                    f"(max_waiting={self.config.max_waiting}); retry later"
                )
            for req in reqs:
                req.t_start, req.t_enqueue = time.perf_counter(), time.monotonic()
                self.waiting.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="runtime-scheduler")
                self._thread.daemon = True
                self._thread.start()
            self._cv.notify()

    def cancel(self, req: Request, *, wait: bool = True) -> None:
        """Mark ``req`` cancelled; with ``wait``, block until the loop released what it pinned.

        A request still waiting in the queue pinned nothing: a queued fork (another choice of
        ``n > 1``) is released at once, and its group leaves the queue once every member is
        cancelled; a queued head with live forks stays, to prefill for them.
        """
        with self._cv:
            req.is_cancelled = True
            if req.status is RequestStatus.WAITING:
                self._release_queued(req)
            self._cv.notify()
        if wait:
            req.released.wait()

    def _release_queued(self, req: Request) -> None:
        """Release cancelled ``req`` if it waits in the queue (holding ``_cv``).

        NOTE: the queue holds heads only. Taking a head out alone (as before) orphaned its
        forks: WAITING outside the queue, never admitted, never released, so closing one
        blocked forever (the server lost a worker thread per hung-up queued ``n > 1`` request).
        """
        head = next((h for h in self.waiting if h is req or req in h.forks), None)
        if head is None:
            return
        if is_all_cancelled(head):
            self.waiting.remove(head)
        for member in (head, *head.forks):
            if member.is_cancelled and (member is not head or is_all_cancelled(head)):
                member.status = RequestStatus.RELEASED
                member.released.set()

    def close(self) -> None:
        """Stop the loop (after its current step) and fail every queued or running request."""
        with self._cv:
            self._is_closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock, self._cv:
            closed = RuntimeEngineError("the engine was closed while this request was queued")
            queued = [member for head in self.waiting for member in (head, *head.forks)]
            for req in [*queued, *self.running]:
                self._fail(req, closed)
            self.waiting.clear()

    def pause(self) -> None:
        """Hold the loop thread between iterations until ``resume``; ``step`` runs one by hand.

        A seam for tests and debugging: it returns once no iteration is under way (it takes the
        engine lock), so what the caller reads afterwards stays put until it calls ``step`` or
        ``resume``. Requests are still queued and cancelled while paused, but a running request
        is only released by an iteration: ``cancel(wait=True)`` (``RequestStream.close``) of one
        blocks until then, so cancel with ``wait=False`` and ``step``. Costs one flag check per
        iteration when unused. ``close`` works while paused.
        """
        with self._lock, self._cv:
            self._is_paused = True

    def resume(self) -> None:
        """Let the loop thread run again after ``pause`` (no-op when not paused)."""
        with self._cv:
            self._is_paused = False
            self._cv.notify()

    def step(self) -> None:
        """Run one loop iteration on the calling thread while paused: release cancelled
        requests, admit and prefill up to the iteration's budget, one decode step.

        Raises:
            RuntimeEngineError: the scheduler is not paused (the loop thread would race this
                call), or it is closed.
        """
        with self._lock:
            if self._is_closed or not self._is_paused:
                raise RuntimeEngineError(
                    "Scheduler.step runs only while paused and open; call pause() first"
                )
            self._iterate()

    def stats(self) -> SchedulerStats:
        """Counts now (call with the engine lock held for a consistent pinned count)."""
        with self._cv:
            num_waiting = len(self.waiting)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=num_waiting,
            num_blocks_pinned=self.prefix_cache.radix.num_in_use_blocks,
            batch_kv_bytes=self.batch.bytes_allocated,
            max_batch_size=self.max_batch_size,
            prefill_tokens_computed=self._num_prefill_computed,
            generation_tokens=self._num_generated,
            decode_steps_by_rows=tuple(self._decode_steps_by_rows),
        )

    # --- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        has_workers = False  # NOTE: this thread's OpenMP pool is live (runtime.model.openmp)
        while True:
            # NOTE: read unlocked: a stale answer only costs rebuilding the pool
            if has_workers and not (self.waiting or self.running):
                release_thread_workers()
                has_workers = False
            is_idle_long = False
            with self._cv:
                while not self._is_closed and (
                    self._is_paused or not (self.waiting or self.running)
                ):
                    # NOTE: a burst's rows are kept idle_release_s, then handed back.
                    timeout = self.config.idle_release_s if self.batch.holds_idle_rows else None
                    if not self._cv.wait(timeout) and not self._is_paused:
                        is_idle_long = True
                        break
                if self._is_closed:
                    return
            with self._lock:
                # NOTE: re-read under the lock: ``pause`` sets the flag holding it, so no
                # iteration starts after ``pause`` returned.
                if self._is_paused:
                    continue
                if is_idle_long:
                    self.batch.release_idle()  # NOTE: a no-op once a request holds a row again
                    continue
                try:
                    has_workers = True
                    self._iterate()
                except Exception as exc:  # noqa: BLE001 - a fault outside every request's guard
                    self._recover(exc)

    def _recover(self, exc: Exception) -> None:
        """Fail every request in flight after an iteration raised outside the per-request
        guards, free their rows and cache pins, and keep serving (holding the engine lock).

        A request's own faults (its input, a forward over its rows, non-finite logits) fail it
        where they happen; reaching here means the scheduler's bookkeeping itself failed, so no
        request in flight is known to be sound and each gets an error naming the fault. Before
        this, the exception ended the loop thread: every stream in flight and every later
        request waited forever while ``/health`` still answered.
        """
        _log.error("agentcache: scheduler iteration failed; failing every request in flight",
                   exc_info=exc)  # fmt: skip
        error = RuntimeEngineError(
            f"the engine's scheduler failed ({type(exc).__name__}: {exc}); this request was "
            "ended, the engine keeps serving"
        )
        with self._cv:
            queued = [member for head in self.waiting for member in (head, *head.forks)]
            self.waiting.clear()
        for req in [*reversed(self.running), *queued]:
            try:
                self._fail(req, error)
            except Exception:  # noqa: BLE001 - its bookkeeping is broken too: end it anyway
                req.status = RequestStatus.RELEASED
                req.post(error)
                req.released.set()
        if self.running or self.batch.num_rows:  # NOTE: rows the pass above could not free
            _log.error("agentcache: %d rows left after the failure; the batch starts empty",
                       self.batch.num_rows)  # fmt: skip
            self.running.clear()
            self.batch = self.batch.empty_like()
        self._prefilling = None
