"""The waiting queue and the order requests leave it for admission.

Cache-aware ordering: among the first ``lookahead`` waiting requests the one with the longest
cached prefix goes first (SGLang's longest-prefix-match), plain FIFO when the queue is long or
its head has waited ``max_wait_s``; a request that does not fit in free rows and the batch KV
budget waits. Which requests may share a packed prefill forward is decided here too. It knows
requests, the prefix cache's ``peek`` and the scheduler's condition, never the model.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from runtime.cache.prefix_cache import PrefixCache
from runtime.request.state import Request, RequestStatus
from runtime.scheduler.config import SchedulerConfig

__all__ = ["AdmissionQueue", "is_all_cancelled", "is_packable"]


def is_all_cancelled(req: Request) -> bool:
    """A waiting request leaves the queue once it and every fork riding with it are cancelled."""
    return req.is_cancelled and all(fork.is_cancelled for fork in req.forks)


def is_packable(req: Request) -> bool:
    """Plain prefill: no prompt scoring (logprobs) and no chunk reuse (both run alone)."""
    return req.params.prompt_logprobs is None and req.chunk_plan is None


class AdmissionQueue:
    """Waiting requests (``waiting``, oldest first) and the choice of the next to admit.

    Args:
        config: ``lookahead``, ``fifo_threshold`` and ``max_wait_s`` (seconds) are read here.
        prefix_cache: scored with ``peek`` (no pinning, no copy).
        cv: the scheduler's condition; ``pop`` holds it while it edits ``waiting``.
    """

    def __init__(
        self, config: SchedulerConfig, prefix_cache: PrefixCache, cv: threading.Condition
    ) -> None:
        self.config = config
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self._cv = cv

    def pop(
        self, fits: Callable[[Request], bool], accept: Callable[[Request], bool]
    ) -> Request | None:
        """Remove and return the next request (with its forks) to admit, or None: the queue is
        empty, the chosen one does not ``fits`` (rows and KV budget now: it waits for them to
        free), or ``accept`` refuses every one that fits (they stay queued)."""
        with self._cv:
            for req in [r for r in self.waiting if is_all_cancelled(r)]:
                self.waiting.remove(req)
                for member in (req, *req.forks):
                    member.status = RequestStatus.RELEASED
                    member.released.set()
            if not self.waiting:
                return None
            first = self._choose()
            if not fits(self.waiting[first]):
                return None  # NOTE: wait for rows to free; never exceed the KV budget.
            # NOTE: a refused choice stays queued; the next in the lookahead that fits may go.
            lookahead = range(min(len(self.waiting), self.config.lookahead))
            for index in (first, *(i for i in lookahead if i != first)):
                req = self.waiting[index]
                if fits(req) and accept(req):
                    del self.waiting[index]
                    return req
            return None

    def can_pack(self, req: Request, *, group: list[Request]) -> bool:
        """Whether ``req`` may prefill with ``group`` now: it scores no prompt, and it would not
        hit a whole block more of cache once a group member's prompt is stored."""
        if not is_packable(req):
            return False
        if not req.use_prefix_cache:
            return True
        hit = self.prefix_cache.peek(req.cache_namespace, req.cacheable_ids, use_cache=True)
        need = hit + self.prefix_cache.pool.block_size
        if need >= len(req.prompt_ids):
            return True
        head = req.prompt_ids[:need]
        return not any(
            other.use_prefix_cache
            and other.namespace == req.namespace
            and other.prompt_ids[:need] == head
            for other in group
        )

    def _choose(self) -> int:
        """Index in ``waiting`` of the request to admit next."""
        head = self.waiting[0]
        is_old = time.monotonic() - head.t_enqueue > self.config.max_wait_s
        if is_old or len(self.waiting) > self.config.fifo_threshold:
            return 0
        best, best_len = 0, -1
        for i, req in enumerate(itertools.islice(self.waiting, self.config.lookahead)):
            hit = self.prefix_cache.peek(
                req.cache_namespace, req.cacheable_ids, use_cache=req.use_prefix_cache
            )
            if hit > best_len:
                best, best_len = i, hit
        return best
