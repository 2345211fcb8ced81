"""The executor: runs one iteration's plan on the model runner, then finishes what it produced.

Run: admit and prefill within the planned budget (a prefill kind per request, several plain
prompts packed in one forward), one batched decode step over the planned rows. Postprocess: sample,
emit deltas, fork ``n > 1`` choices, store prompts in the prefix cache, release finished or failed
rows. A request's fault fails that request alone. It holds the batch rows and the running list;
the queue and the loop thread are ``runtime.scheduler.loop``'s, the decisions
``runtime.scheduler.plan``'s.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Iterator

import torch

from runtime.cache.prefix_cache import PrefixCache
from runtime.chunks.assembler import ChunkAssembler
from runtime.exceptions import RuntimeEngineError, SamplingError
from runtime.model.batch_kv import BatchKV
from runtime.model.kv_cache import RequestKVCache
from runtime.model.runner import ModelRunner
from runtime.outputs import StreamDelta
from runtime.request.state import Request, RequestStatus
from runtime.sampling.sampler import Sampled, sample_batch
from runtime.scheduler.admission import AdmissionQueue, is_all_cancelled, is_packable
from runtime.scheduler.chunk_prefill import ChunkPrefill
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.forks import copy_prompt, live_forks, running_group
from runtime.scheduler.plan import (
    decode_rows,
    is_prefilling,
    pack_tokens,
    plan_step,
    remaining,
    reserve_rows,
)
from runtime.scheduler.prefill import PrefillKinds

_log = logging.getLogger(__name__)

__all__ = ["Executor", "first_line"]


class Executor:
    """The batch rows, the running requests and one iteration's run (``_iterate``).

    Every method runs on the loop thread (or ``Scheduler.step``'s caller) holding the engine
    lock; ``_cv`` guards only the waiting queue.
    """

    def __init__(
        self,
        runner: ModelRunner,
        prefix_cache: PrefixCache,
        config: SchedulerConfig,
        *,
        debug_integrity: bool = False,
        chunks: ChunkAssembler | None = None,
    ) -> None:
        self.runner = runner
        self.chunks = None if chunks is None else ChunkPrefill(chunks, config.prefill_chunk_tokens)
        """Assembles requests that ask for chunk reuse (None: such requests fail)."""
        self.kinds = PrefillKinds(runner, self.chunks)
        self.prefix_cache = prefix_cache
        self.config = config
        self.max_batch_size = config.max_batch_size if runner.can_batch else 1
        shape = runner.kv_shape
        self.batch = BatchKV(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=runner.kv_dtype,
            device=runner.device,
            budget_bytes=config.batch_kv_bytes,
        )
        self.debug_integrity = debug_integrity
        self.max_prefill_batch = config.max_prefill_batch if runner.can_pack_prefill else 1
        """Most requests prefilled in one forward now (1 on the transformers path; a benchmark
        may lower it between runs to compare)."""
        self.running: list[Request] = []
        """Running requests in batch-row order (row i belongs to running[i])."""
        self._cv = threading.Condition()
        self.admission = AdmissionQueue(config, prefix_cache, self._cv)
        self.waiting = self.admission.waiting
        """Queued requests, oldest first (the admission queue's; edited under its condition)."""
        self._prefilling: Request | None = None
        """The request whose prompt is being prefilled in chunks (its row idles in decode steps;
        when it reuses chunks, ``chunks`` holds what it gathered so far)."""
        self._num_prefill_computed = 0
        self._num_generated = 0
        self._decode_steps_by_rows = [0] * (self.max_batch_size + 1)
        self._to_wake: list[Request] | None = None
        """While a step's rows are emitted: the requests posted to, woken after the last one."""

    def check_integrity(self) -> None:
        """Assert rows match running requests and the batch KV stays in its budget."""
        self.batch.check_integrity()
        assert len(self.running) == self.batch.num_rows <= self.max_batch_size, "rows drifted"
        for req, kv in zip(self.running, self.batch.rows, strict=True):
            assert req.kv is kv and req.status is RequestStatus.RUNNING, "row owner drifted"

    def _iterate(self) -> None:
        """One iteration: plan, release, admit and prefill within the budget, decode a step."""
        plan = plan_step(self.running, self._prefilling, self.config)
        for req in [self.running[i] for i in plan.release]:
            self._release(req, keep=True)  # NOTE: a head mid-prefill with live forks stays
        self._admit(plan.prefill_budget, plan.chunk_tokens)
        if self.running:
            self._decode_step()
        if self.debug_integrity:
            self.check_integrity()
            self.prefix_cache.check_integrity()
            if self.chunks is not None:
                self.chunks.store.check_integrity()

    def _admit(self, budget: int, chunk: int) -> None:
        """Prefill up to ``budget`` tokens, at most ``chunk`` per forward: the request mid-prefill
        first, then new ones, several requests' chunks packed in one forward where the runner
        can."""
        self._reserve_rows()
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
        rows, capacity = reserve_rows(len(self.running), queued, self.max_batch_size)
        if capacity:
            try:
                self.batch.reserve(rows, capacity, up_to=self.max_batch_size)
            except RuntimeError as exc:  # NOTE: rows are then added one by one, each may fail
                _log.warning("agentcache: cannot reserve the batch KV for %d rows: %s",
                             rows, first_line(exc))  # fmt: skip

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
        num_tokens = remaining(req)
        while (
            room := pack_tokens(len(jobs), num_tokens, limit, self.max_prefill_batch)
        ) is not None:
            if len(self.running) >= self.max_batch_size:
                break
            nxt = self.admission.pop(
                self._fits, functools.partial(self.admission.can_pack, group=[r for r, _ in jobs])
            )
            if nxt is None:
                break
            if not self._start(nxt):
                continue
            jobs.append((nxt, room))
            num_tokens += remaining(nxt)
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
            num_run, logits = self.kinds.of(req).run(req, max_tokens)
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop keeps serving
            for member in running_group(req):
                self._fail(member, exc)
            return num_run
        if logits is None:
            return num_run  # NOTE: chunks still to gather: decode steps run first
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
        with self._waking_after():
            for (req, _), row in zip(jobs, logits, strict=True):
                self._prefilled(req, row)
        return sum(len(ids) for ids, _ in chunks)

    def _prefilled(self, req: Request, logits: torch.Tensor) -> None:
        """After a prefill chunk of ``req`` (``[vocab]`` logits of its last position): unless
        prompt tokens remain, fork its choices, sample and emit their first tokens, and store
        the prompt in the prefix cache."""
        assert req.kv is not None, "a running request has a KV row"
        if is_prefilling(req):
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
                f"no memory for this request's KV rows ({first_line(exc)}); lower "
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
        rows = decode_rows(self.running)
        reqs = [self.running[i] for i in rows]
        if not reqs:
            return
        self._decode_steps_by_rows[len(reqs)] += 1
        try:
            tokens = [None if is_prefilling(r) else r.output_ids[-1] for r in self.running]
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
        with self._waking_after():
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
        for i, req in enumerate(reqs):
            if req.logits_log is not None:  # NOTE: not iterating ``logits``: a view per row
                req.logits_log.append(logits[i].float().clone())
        return sample_batch(logits, reqs)

    def _emit(self, req: Request, picked: Sampled) -> None:
        token, logprob = picked
        text = req.accept(token, logprob)
        logprobs = [] if logprob is None else [logprob]
        prompt = req.prompt_logprobs if len(req.output_ids) == 1 else None
        if req.finish_reason is None:
            if req.is_streamed:
                self._post(
                    req, StreamDelta([token], text, logprobs=logprobs, prompt_logprobs=prompt)
                )
            return
        self._release(req, keep=True)
        req.t_end = time.perf_counter()
        text += req.detokenizer.flush()
        completion = req.completion()
        self._post(req, StreamDelta([token], text, req.finish_reason, completion, logprobs, prompt))

    def _fail(self, req: Request, exc: BaseException) -> None:
        self._release(req, keep=False)
        self._post(req, exc)

    def _post(self, req: Request, item: StreamDelta | BaseException) -> None:
        """Post to ``req``'s consumer; within ``_waking_after`` wake it after the others."""
        if self._to_wake is None:
            req.post(item)
        else:
            req.post(item, wake=False)
            self._to_wake.append(req)

    @contextlib.contextmanager
    def _waking_after(self) -> Iterator[None]:
        """Post a step's deltas to every row first, then wake their consumers.

        NOTE: a consumer's wake-up hands the GIL to the server's event loop thread, which then
        writes its stream while this thread waits for the GIL to post the next row's delta: with
        16 rows that ping-pong cost a served decode step about 2 ms (smollm2-135m, bench load,
        ``post`` 0.12 ms a row). Posting first, 13 bench load runs alternating with the code
        before: 16 clients' throughput 0.91 / 1.06 / 1.30x per pair, ITL p99 median 45 vs 64 ms.
        """
        assert self._to_wake is None, "a step's emits are not nested"
        self._to_wake = []
        try:
            yield
        finally:
            to_wake, self._to_wake = self._to_wake, None
            for req in to_wake:
                req.wake()

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


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none."""
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__
