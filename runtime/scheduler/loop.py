"""Scheduler: the request queue and the one loop that prefills and batch-decodes requests.

Continuous batching: requests join (admit + prefill from their prefix-cache hit) and leave
(finish, cancel, error) between decode steps, and each step decodes every running request at once.
Cache-aware ordering takes the waiting request with the longest cached prefix (SGLang's
longest-prefix-match) among the first few, FIFO when the queue is long or its head is old.
It drives the prefix cache and the batch KV; it knows nothing about HTTP or chat templates.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Sequence

import torch

from runtime.batch_kv import BatchKV
from runtime.cache.prefix_cache import PrefixCache
from runtime.chunks.assembler import ChunkAssembler
from runtime.exceptions import EngineBusyError, RuntimeEngineError, SamplingError
from runtime.kv_cache import RequestKVCache
from runtime.model_runner import ModelRunner
from runtime.openmp import release_thread_workers
from runtime.outputs import StreamDelta
from runtime.request.state import Request, RequestStatus
from runtime.sampling.sampler import Sampled, sample_batch
from runtime.scheduler.admission import AdmissionQueue, is_all_cancelled, is_packable
from runtime.scheduler.chunk_prefill import ChunkPrefill
from runtime.scheduler.config import SchedulerConfig, SchedulerStats
from runtime.scheduler.forks import check_group, copy_prompt, live_forks, running_group
from runtime.scheduler.scoring import prefill_scored

_log = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]


class Scheduler:
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
        self.runner = runner
        self.chunks = None if chunks is None else ChunkPrefill(chunks, config.prefill_chunk_tokens)
        """Assembles requests that ask for chunk reuse (None: such requests fail)."""
        self.prefix_cache = prefix_cache
        self.config = config
        self.max_batch_size = config.max_batch_size if runner.can_batch else 1
        shape = runner.kv_shape
        self.batch = BatchKV(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=runner.dtype,
            device=runner.device,
            budget_bytes=config.batch_kv_bytes,
        )
        self.debug_integrity = debug_integrity
        self.max_prefill_batch = config.max_prefill_batch if runner.can_pack_prefill else 1
        """Most requests prefilled in one forward now (1 on the transformers path; a benchmark
        may lower it between runs to compare)."""
        self.running: list[Request] = []
        """Running requests in batch-row order (row i belongs to running[i])."""
        self._lock = lock
        self._cv = threading.Condition()
        self.admission = AdmissionQueue(config, prefix_cache, self._cv)
        self.waiting = self.admission.waiting
        """Queued requests, oldest first (the admission queue's; edited under its condition)."""
        self._thread: threading.Thread | None = None
        self._prefilling: Request | None = None
        """The request whose prompt is being prefilled in chunks (its row idles in decode steps;
        when it reuses chunks, ``chunks`` holds what it gathered so far)."""
        self._is_closed = False
        self._is_paused = False
        """Set by ``pause``: the loop thread runs no iteration (``step`` runs them instead)."""
        self._num_prefill_computed = 0
        self._num_generated = 0
        self._decode_steps_by_rows = [0] * (self.max_batch_size + 1)

    # --- called from consumer threads ------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a waiting request; the loop starts on the first submit.

        A request with ``forks`` (the other choices of ``n > 1``) is queued as one group: the
        forks are admitted with it and never wait on their own.

        Raises:
            EngineBusyError: the queue holds ``max_waiting`` requests.
            InvalidRequestError: the group has more choices than ``max_batch_size`` rows.
            PromptTooLongError: the group's KV rows alone exceed ``batch_kv_bytes``.
            RuntimeEngineError: the engine was closed.
        """
        self.submit_all([req])

    def submit_all(self, reqs: Sequence[Request]) -> None:
        """Queue several requests at once: the loop's next admission sees all of them.

        A request with ``forks`` (the other choices of ``n > 1``) is queued as one group: the
        forks are admitted with it and never wait on their own.

        Raises:
            EngineBusyError: they do not all fit under ``max_waiting`` (none is queued).
            InvalidRequestError: a group has more choices than ``max_batch_size`` rows.
            PromptTooLongError: a request's (group's) KV rows alone exceed ``batch_kv_bytes``.
            RuntimeEngineError: the engine was closed.
        """
        # NOTE: the submitting thread's OpenMP workers (a model loaded or a reference forward
        # run on it) would otherwise throttle the loop thread's: see runtime.openmp.
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

    def check_integrity(self) -> None:
        """Assert rows match running requests and the batch KV stays in its budget."""
        self.batch.check_integrity()
        assert len(self.running) == self.batch.num_rows <= self.max_batch_size, "rows drifted"
        for req, kv in zip(self.running, self.batch.rows, strict=True):
            assert req.kv is kv and req.status is RequestStatus.RUNNING, "row owner drifted"

    # --- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        has_workers = False  # NOTE: this thread's OpenMP pool is live (runtime.openmp)
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

    def _iterate(self) -> None:
        for req in [r for r in self.running if r.is_cancelled]:
            if req is not self._prefilling or is_all_cancelled(req):
                # NOTE: a head mid-prefill with live forks finishes its prefill for them.
                self._release(req, keep=True)
        self._admit()
        if self.running:
            self._decode_step()
        if self.debug_integrity:
            self.check_integrity()
            self.prefix_cache.check_integrity()
            if self.chunks is not None:
                self.chunks.store.check_integrity()

    def _admit(self) -> None:
        """Prefill up to this iteration's budget: the request mid-prefill first, then new ones,
        several requests' chunks packed in one forward where the runner can."""
        self._reserve_rows()
        chunk = self.config.prefill_chunk_tokens
        is_decoding = any(not _is_prefilling(r) for r in self.running)
        budget = chunk if is_decoding else self.config.max_prefill_tokens
        while budget > 0:
            jobs = self._gather(min(budget, chunk))
            if not jobs:
                return
            if len(jobs) == 1:
                budget -= self._prefill(*jobs[0])
            else:
                budget -= self._prefill_packed(jobs)

    def _reserve_rows(self) -> None:
        """Grow the batch buffer once for the queued burst instead of once per doubling as rows
        are added: room for the rows it will take (in queue order, up to ``max_batch_size``) and
        for as many more as the budget allows, within ``max_batch_size``.

        NOTE: a burst is often still arriving. On W1 (1 GiB, prompts of 1,378 tokens) 7 queued
        requests grew the buffer to 8 rows, the 9th to 16: two reallocations, 1.0 s of the
        first step. The buffer is allocated uninitialized, so rows that no request uses cost
        address space only (``BatchKV``).
        """
        with self._cv:
            queued = list(itertools.islice(self.waiting, self.max_batch_size))
        rows, capacity = len(self.running), 0
        for req in queued:
            if rows + 1 + len(req.forks) > self.max_batch_size:
                break
            rows, capacity = rows + 1 + len(req.forks), max(capacity, req.max_total_len)
        if capacity:
            try:
                self.batch.reserve(rows, capacity, up_to=self.max_batch_size)
            except RuntimeError as exc:  # NOTE: rows are then added one by one, each may fail
                _log.warning("agentcache: cannot reserve the batch KV for %d rows: %s",
                             rows, _first_line(exc))  # fmt: skip

    def _gather(self, limit: int) -> list[tuple[Request, int]]:
        """The next prefill jobs ``(request, max tokens)``: at most ``limit`` tokens in all and
        ``max_prefill_batch`` requests; the request mid-prefill comes first.

        A packed job is admitted here (rows, prefix-cache match), so its uncached length is
        known. A request that scores its prompt (prompt logprobs) or reuses chunks runs alone,
        and one that would hit the KV of a request in this group once stored waits for the next
        group.
        """
        req = self._prefilling
        if req is not None:
            if is_all_cancelled(req):
                self._release(req, keep=True)  # NOTE: stores only the positions computed
                return self._gather(limit)
        else:
            req = self.admission.pop(self._fits, lambda r: True)
            if req is None:
                return []
        jobs = [(req, limit)]
        if self.max_prefill_batch == 1 or not is_packable(req):
            return jobs
        if req.status is RequestStatus.WAITING and not self._start(req):
            return self._gather(limit)
        num_tokens = _remaining(req)
        while num_tokens < limit and len(jobs) < self.max_prefill_batch:
            if len(self.running) >= self.max_batch_size:
                break
            nxt = self.admission.pop(
                self._fits, functools.partial(self.admission.can_pack, group=[r for r, _ in jobs])
            )
            if nxt is None:
                break
            if not self._start(nxt):
                continue
            jobs.append((nxt, limit - num_tokens))
            num_tokens += _remaining(nxt)
        return jobs

    def _fits(self, req: Request) -> bool:
        """Whether ``req`` and its forks fit in free rows and the KV budget now."""
        size = 1 + len(req.forks)
        return len(self.running) + size <= self.max_batch_size and self.batch.can_fit(
            req.max_total_len, num_rows=size
        )

    def _prefill(self, req: Request, max_tokens: int) -> int:
        """Run the next chunk (at most ``max_tokens``) of ``req``'s prompt; the first chunk admits
        it (rows for it and its forks, prefix-cache match), the last forks ``n > 1`` choices
        (they copy the prompt KV) and samples every choice's first token.

        Returns:
            Prompt tokens run (at least 1, so the caller's budget always shrinks).
        """
        num_run = 1
        if req.status is RequestStatus.WAITING and not self._start(req):
            return num_run
        self._prefilling = req
        try:
            assert req.kv is not None, "a running request has a KV row"
            kv = req.kv
            if req.chunk_plan is not None:
                if self.chunks is None:
                    raise RuntimeEngineError("this scheduler has no chunk store")
                num_run, chunk_logits = self.chunks.step(req, max_tokens)
                if chunk_logits is None:
                    return num_run  # NOTE: chunks still to gather: decode steps run first
                logits = chunk_logits
            elif req.params.prompt_logprobs is None:
                chunk = req.prompt_ids[kv.length : kv.length + max_tokens]
                num_run = max(1, len(chunk))
                logits = self.runner.forward(chunk, kv)
            else:
                # NOTE: a scored prompt (prompt logprobs) runs whole, in its own logits chunks.
                num_run = len(req.prompt_ids)
                logits = prefill_scored(self.runner, req)
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop keeps serving
            for member in running_group(req):
                self._fail(member, exc)
            return num_run
        self._prefilled(req, logits)
        return num_run

    def _prefill_packed(self, jobs: list[tuple[Request, int]]) -> int:
        """Run several admitted requests' next chunks in one packed forward, then finish each as
        ``_prefill`` would. If the packed forward raises, each runs alone (nothing was
        committed), so a request that fails fails alone.

        Returns:
            Prompt tokens run.
        """
        chunks = []
        for req, max_tokens in jobs:
            assert req.kv is not None, "a packed job was admitted"
            chunks.append((req.prompt_ids[req.kv.length : req.kv.length + max_tokens], req.kv))
        try:
            shared = self.batch.common_prefix([kv for _, kv in chunks])
            logits = self.runner.forward_packed(chunks, shared_len=shared)
        except Exception:  # noqa: BLE001 - retried one by one: the failing request fails alone
            return sum(self._prefill(req, max_tokens) for req, max_tokens in jobs)
        for (req, _), row in zip(jobs, logits, strict=True):
            self._prefilled(req, row)
        return sum(len(ids) for ids, _ in chunks)

    def _prefilled(self, req: Request, logits: torch.Tensor) -> None:
        """After a prefill chunk of ``req`` (``[vocab]`` logits of its last position): unless
        prompt tokens remain, fork its choices, sample and emit their first tokens, and store
        the prompt in the prefix cache."""
        assert req.kv is not None, "a running request has a KV row"
        if _is_prefilling(req):
            self._prefilling = req
            return  # NOTE: decode steps run before its next chunk.
        self._prefilling = None
        group = running_group(req)
        try:
            copy_prompt(req, group[1:], self.prefix_cache)
            for fork in group[1:]:
                # NOTE: a fork's prompt is the head's, copied: so is the head's cached prefix
                assert fork.kv is not None, "fork admitted without a row"
                self.batch.share_like(fork.kv, req.kv)
            # NOTE: one logits row seen by every choice (the sampler edits its own copy).
            tokens = self._sample(group, logits.unsqueeze(0).expand(len(group), -1))
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop keeps serving
            for member in group:
                self._fail(member, exc)
            return
        t_first = time.perf_counter()
        for member, token in zip(group, tokens, strict=True):
            member.t_first = t_first
            self._finish_step(member, token)
        if req.status is RequestStatus.RUNNING:
            # NOTE: stored after the first token went out (not part of TTFT), and before the
            # next admission, so a waiting request that shares this prompt hits it.
            req.node = self.prefix_cache.insert(
                req.cache_namespace, req.cacheable_ids, req.kv, req.node
            )

    def _start(self, req: Request) -> bool:
        """Admit ``req`` and its live forks (rows, running) and match its cached prefix.

        Returns:
            False when the match failed (the group has failed).
        """
        group = [req, *live_forks(req)]
        try:
            kv = [self._add_row(member) for member in group][0]
        except RuntimeError as exc:  # NOTE: torch's allocator refused to grow the batch buffer
            error = RuntimeEngineError(
                f"no memory for this request's KV rows ({_first_line(exc)}); lower "
                "SchedulerConfig.batch_kv_bytes or the load"
            )
            for member in group:
                self._fail(member, error)
            return False
        try:
            hit = self.prefix_cache.match(
                req.cache_namespace, req.cacheable_ids, kv, use_cache=req.use_prefix_cache
            )
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop keeps serving
            for member in group:
                self._fail(member, exc)
            return False
        # NOTE: under chunk reuse a hit may end inside a span (kept: ChunkReuse.spans_from)
        req.cached_len, req.node = hit.cached_len, hit.node
        if hit.cached_len:
            # NOTE: positions [0, cached_len) are never rewritten (prefill starts there), so
            # rows that copied the same blocks may read them once per decode step.
            bs = self.prefix_cache.pool.block_size
            self.batch.share_prefix(kv, hit.block_ids, bs, hit.cached_len)
        return True

    def _add_row(self, req: Request) -> RequestKVCache:
        """Give an admitted request its batch row and make it running."""
        req.kv = self.batch.add_row(req.max_total_len)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        return req.kv

    def _decode_step(self) -> None:
        # NOTE: a row mid-prefill is idle in this step (fed nothing, its KV not committed).
        rows = [i for i, r in enumerate(self.running) if not _is_prefilling(r)]
        reqs = [self.running[i] for i in rows]
        if not reqs:
            return
        self._decode_steps_by_rows[len(reqs)] += 1
        try:
            tokens = [None if _is_prefilling(r) else r.output_ids[-1] for r in self.running]
            logits = self.runner.decode(tokens, self.batch)
            if len(rows) < len(tokens):
                logits = logits[rows]
            picks = self._sample(reqs, logits)
        except Exception as exc:  # noqa: BLE001 - the batch's forward failed: no row is sound
            for req in reqs:
                self._fail(req, exc)
            return
        # NOTE: a row that cannot be sampled ends alone; the others' KV rows are untouched.
        # Last row first: a finished row's slot takes the batch's last row (a copy of its KV),
        # so when several finish together (the same max_tokens) none of them is moved just to
        # be freed next; 16 W1 rows ending in one step spent 63 ms copying them.
        for req, picked in reversed(list(zip(reqs, picks, strict=True))):
            self._finish_step(req, picked)

    def _finish_step(self, req: Request, picked: Sampled | SamplingError) -> None:
        """Emit a row's pick, or fail that row alone (it could not be sampled)."""
        if isinstance(picked, SamplingError):
            self._fail(req, picked)
        else:
            self._emit(req, picked)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[Sampled | SamplingError]:
        """One pick per row of ``logits`` (``[n, vocab]``), or the error that ends that row."""
        for req, row in zip(reqs, logits, strict=True):
            if req.logits_log is not None:
                req.logits_log.append(row.float().clone())
        return sample_batch(logits, reqs)

    def _emit(self, req: Request, picked: Sampled) -> None:
        token, logprob = picked
        text = req.accept(token, logprob)
        logprobs = [] if logprob is None else [logprob]
        prompt = req.prompt_logprobs if len(req.output_ids) == 1 else None
        if req.finish_reason is None:
            req.post(StreamDelta([token], text, logprobs=logprobs, prompt_logprobs=prompt))
            return
        self._release(req, keep=True)
        req.t_end = time.perf_counter()
        text += req.detokenizer.flush()
        completion = req.completion()
        req.post(StreamDelta([token], text, req.finish_reason, completion, logprobs, prompt))

    def _fail(self, req: Request, exc: BaseException) -> None:
        self._release(req, keep=False)
        req.post(exc)

    def _release(self, req: Request, *, keep: bool) -> None:
        """Store the request's blocks (when ``keep``), unpin its node and free its row."""
        if req.status is RequestStatus.RELEASED:
            return
        if self._prefilling is req:
            if self.chunks is not None:  # NOTE: chunks computed alone are work done
                self._num_prefill_computed += self.chunks.drop()
            self._prefilling = None
        self._num_generated += len(req.output_ids)
        if req.status is RequestStatus.RUNNING:
            self._num_prefill_computed += req.num_prompt_computed()
            if keep and req.kv is not None:
                req.node = self.prefix_cache.insert(
                    req.cache_namespace, req.cacheable_ids, req.kv, req.node
                )
            index = self.running.index(req)
            last = self.running.pop()
            if index < len(self.running):
                self.running[index] = last
            self.batch.remove_row(index)
        self.prefix_cache.release(req.node)
        # NOTE: the row is reused by the next request; drop the view so nothing reads stale KV.
        req.node, req.kv, req.status = None, None, RequestStatus.RELEASED
        req.released.set()


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none."""
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__


def _remaining(req: Request) -> int:
    """Prompt tokens of a running request not in its KV yet."""
    assert req.kv is not None, "a running request has a KV row"
    return len(req.prompt_ids) - req.kv.length


def _is_prefilling(req: Request) -> bool:
    """A running request whose KV does not cover its prompt yet (chunked prefill under way)."""
    return req.kv is not None and req.kv.length < len(req.prompt_ids)
